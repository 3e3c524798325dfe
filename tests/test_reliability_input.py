"""Every kind of bad input the reliability issue lists, through the real CLI entry point: one
line naming the file (when there is one) and the field, exit code 2, no traceback — and the
traceback with --debug. Plus the unit checks of the security rules (loopback only, paths).

The CLI runs in this process (``kvfuzz.cli.main`` with a patched argv): the same code path as
the console script, without paying an interpreter start per row. One row also runs as a real
subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz.traces import EngineConfig, LoraSettings, Trace, load_trace
from kvfuzz.traces.errors import BadInput

GOOD_SEND = {"kind": "send", "request_id": "r0", "at": {"step": 0}, "prompt": {"length": 40, "seed": 1},
             "max_tokens": 4}


def trace_with(**changes) -> dict:
    t = {"schema_version": 1, "engine": {}, "events": [dict(GOOD_SEND)]}
    for k, v in changes.items():
        t[k] = v
    return t


def lora_engine(adapters: dict) -> dict:
    return {"lora": {"enabled": True, "adapters": adapters}}


# name -> (file content (None: no file), extra CLI args, field named, message needle)
CASES = {
    "malformed JSON": ('{"schema_version": 1, "events": [', None, None, "malformed JSON"),
    "wrong schema_version": (trace_with(schema_version=6), None, "schema_version", "unsupported schema_version 6"),
    "unknown event kind": (trace_with(events=[{**GOOD_SEND, "kind": "explode"}]), None, "events.0",
                           "does not match any of the expected tags"),
    "cancel of an unknown request": (trace_with(events=[GOOD_SEND, {"kind": "cancel", "request_id": "ghost",
                                                                    "at": {"step": 1}}]),
                                     None, "events[1].request_id", "cancel of unknown request 'ghost'"),
    "negative offset": (trace_with(events=[{**GOOD_SEND, "at": {"offset_ms": -5}}]), None, "events.0.send.at.offset_ms",
                        "greater than or equal to 0"),
    "prompt longer than the context": (trace_with(engine={"max_model_len": 256},
                                                  events=[{**GOOD_SEND, "prompt": {"length": 300, "seed": 1}}]),
                                       None, "events[0].prompt", "exceed engine.max_model_len 256"),
    "unknown adapter": (trace_with(engine=lora_engine({"a": "embedded:a"}), events=[{**GOOD_SEND, "adapter": "zz"}]),
                        None, "events[0].adapter", "unknown adapter 'zz'"),
    "missing model directory (trace)": (trace_with(engine={"model": "./no-such-model-dir"}), None, "engine.model",
                                        "no such directory './no-such-model-dir'"),
    "adapter path escapes": (trace_with(engine=lora_engine({"a": "/etc"}), events=[{**GOOD_SEND, "adapter": "a"}]),
                             None, "engine.lora.adapters.a", "outside the allowed directories"),
    "relative path escapes": (trace_with(engine={"model": "../../../../../../usr/lib"}), None, "engine.model",
                              "outside the allowed directories"),
    "trust_remote_code": (trace_with(engine={"extra_args": {"trust_remote_code": True}}), None,
                          "engine.extra_args.trust_remote_code", "would run code"),
    "missing model directory (--model)": (None, ["run", "--traces", "1", "--model", "{tmp}/absent"], "--model",
                                          "no such model directory"),
    "port already in use": (None, ["run", "--traces", "1", "--engine", "server", "--port", "{port}"], "--port",
                            "already in use"),
}


@pytest.fixture(scope="module")
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def run_cli(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    from kvfuzz import cli

    monkeypatch.setattr(sys, "argv", ["kvfuzz", *argv])
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        os.environ.pop("KVFUZZ_DEBUG", None)  # --debug sets it for the process
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_table(name, debug, tmp_path, busy_port, capsys, monkeypatch):
    content, args, field, needle = CASES[name]
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    source = None
    if content is not None:
        source = tmp_path / "input.json"
        source.write_text(content if isinstance(content, str) else json.dumps(content))
        argv = ["replay", str(source), "--out", str(out)]
    else:
        argv = [a.format(tmp=tmp_path, port=busy_port) for a in args] + ["--out", str(out)]
    code, err = run_cli((["--debug"] if debug else []) + argv, capsys, monkeypatch)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvfuzz: error: ") and needle in last, err
    if source is not None:
        assert str(source) in last
    if field is not None:
        assert field in last
    if debug:
        assert "Traceback (most recent call last)" in err
    else:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_input_in_a_real_subprocess(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(trace_with(schema_version=6)))
    env = {k: v for k, v in os.environ.items() if k != "KVFUZZ_DEBUG"}
    p = subprocess.run([sys.executable, "-m", "kvfuzz", "replay", str(bad)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == f"kvfuzz: error: {bad}: schema_version: unsupported schema_version 6 " \
                               f"(this kvfuzz reads 1, 2, 3, 4, 5)"


# -- security rules (units) ------------------------------------------------------------------


def test_managed_server_listens_on_loopback_only():
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.vllm_args import HOST, server_command

    cmd = server_command(default_engine(lora=True), model_path="/m", adapter_paths={"a": "/a"}, port=8123)
    assert HOST == "127.0.0.1"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd.count("--host") == 1
    assert "0.0.0.0" not in cmd and "--api-key" not in cmd  # the key goes by environment


def test_server_env_carries_the_key_not_the_command(tmp_path):
    from kvfuzz.harness.vllm_args import server_env

    env = server_env({"PATH": "/bin", "VLLM_API_KEY": "old"}, api_key="sekrit")
    assert env["VLLM_API_KEY"] == "sekrit"
    assert "VLLM_API_KEY" not in server_env({"VLLM_API_KEY": "old"}, api_key=None)


def test_port_in_use_is_refused_before_vllm_starts(tmp_path, busy_port):
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.process import port_free
    from kvfuzz.harness.server import ServerEngine, ServerOptions

    assert not port_free(busy_port)
    eng = ServerEngine(default_engine(), options=ServerOptions(log_dir=tmp_path, port=busy_port))
    with pytest.raises(BadInput, match=f"port {busy_port} is already in use"):
        eng.start()
    assert eng.server is None and not list(tmp_path.glob("server-*.log"))


def test_paths_inside_allowed_directories_load(tmp_path, monkeypatch):
    from kvfuzz.traces.paths import ALLOWED_ENV, allow, check_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ALLOWED_ENV, raising=False)
    inside = tmp_path / "models" / "m"
    inside.mkdir(parents=True)
    for ok in ("embedded:a", "Qwen/Qwen2-0.5B", "./models/m", str(inside), "models/../models/m"):
        check_path(ok, field="f")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    with pytest.raises(BadInput, match="outside the allowed directories"):
        check_path(str(elsewhere), field="engine.model")
    # A symlink inside that points outside is judged by where it leads.
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(BadInput):
        check_path("./link", field="engine.model")
    allow(elsewhere)
    check_path(str(elsewhere), field="engine.model")


def test_finding_files_are_plain_json_data(tmp_path):
    """A finding is written as JSON by pydantic and read back by the same models: no pickle,
    nothing executable; a file that smuggles an unknown field is refused."""
    from kvfuzz.traces import save

    t = Trace(engine=EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "embedded:a"})))
    p = tmp_path / "t.json"
    save(t, p)
    raw = p.read_bytes()
    assert json.loads(raw)["engine"]["lora"]["adapters"] == {"a": "embedded:a"}
    assert load_trace(p) == t
    data = json.loads(raw)
    data["__reduce__"] = "os.system"
    p.write_text(json.dumps(data))
    with pytest.raises(BadInput, match="__reduce__"):
        load_trace(p)
    src = "\n".join(Path(m).read_text() for m in ("traces/io.py", "fuzzer/corpus.py", "fuzzer/campaign.py"))
    assert "pickle" not in src and "eval(" not in src


# -- Hypothesis: path-like values in otherwise valid traces --------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

path_text = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(["..", ".", "~", "", "etc", "tmp", "x\x00y", "a" * 300, "embedded:a", "/"]),
             max_size=6).map("/".join),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=path_text, adapter=path_text, extra=st.dictionaries(st.sampled_from(["download_dir", "trust_remote_code",
                                                                                 "tokenizer_path"]),
                                                                path_text | st.booleans(), max_size=2))
def test_path_fields_raise_only_bad_input(model, adapter, extra):
    from kvfuzz.traces.io import parse_finding, parse_trace

    data = trace_with(engine={"model": model, "lora": {"enabled": True, "adapters": {"a": adapter}},
                              "extra_args": extra}, events=[{**GOOD_SEND, "adapter": "a"}])
    for parse in (parse_trace, parse_finding):
        try:
            parse(data if parse is parse_trace else {"kind": "finding", "trace": data,
                                                     "environment": {"kvfuzz_version": "x"}}, "fuzz.json")
        except BadInput as e:
            assert str(e).startswith("fuzz.json") and "\n" not in str(e)
