"""pytest entry point: each finding/trace of a corpus becomes a test.

    pytest --kvfuzz-corpus traces/regressions            # one test per file (arm: vanilla)
    pytest --kvfuzz-corpus DIR --kvfuzz-self-test         # clean passes, fault arms still fail
    pytest --kvfuzz-corpus DIR --kvfuzz-engine server --kvfuzz-runs 3

Or, in your own tests, the ``kvfuzz_case`` fixture (parametrized over ``--kvfuzz-corpus``):

    def test_known_findings(kvfuzz_case):
        kvfuzz_case.check()          # fails with the verdict and the replay command

and the ``kvfuzz_session`` fixture, a ``kvfuzz.Session`` for your own property tests
(docs/fuzzer.md has an example with ``kvfuzz.strategies.traces``).

Registered through the ``pytest11`` entry point; inert unless a test uses a fixture or
``--kvfuzz-corpus`` is given. One engine is shared by every case and test of the pytest run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvfuzz.gate.gate import GateRunner
    from kvfuzz.harness.base import EngineKind
    from kvfuzz.driver.session import Session

# Per pytest run (config.stash): a pytest run inside a pytest run (pytester) has its own.
_STATE_KEY = pytest.StashKey[dict[str, Any]]()


def _state(config: pytest.Config) -> dict[str, Any]:
    return config.stash.setdefault(_STATE_KEY, {})


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvfuzz", "kvfuzz regression corpus")
    g.addoption("--kvfuzz-corpus", action="append", default=[], metavar="PATH",
                help="Finding/trace file or directory; each file becomes a test (repeatable).")
    g.addoption("--kvfuzz-engine", default="inprocess", help="inprocess or server.")
    g.addoption("--kvfuzz-base-url", default=None, help="Replay against this running vLLM server.")
    g.addoption("--kvfuzz-runs", type=int, default=None, help="Runs per case (default: 1 in-process, 3 over HTTP).")
    g.addoption("--kvfuzz-arms", default=None, help="Arms as in `kvfuzz gate --arms` (default: vanilla).")
    g.addoption("--kvfuzz-device", default="cpu", help="cpu or cuda.")
    g.addoption("--kvfuzz-strict", action="store_true", help="numeric-near-tie fails too.")
    g.addoption("--kvfuzz-self-test", action="store_true",
                help="Clean arm must pass and each fault arm a trace names must fail.")
    g.addoption("--kvfuzz-out", default=None, help="Where findings of failing cases and logs go "
                                                   "(default: kvfuzz-gate for a corpus; logs of kvfuzz_session: a "
                                                   "temporary directory).")


# Engines kept alive in a test process, one per engine configuration (harness/inprocess.py
# EnginePool): tests, and CLI commands run in-process, share them instead of starting new ones.
# 12: an engine of the embedded model adds about 28 MiB, and the explain ablations of one
# finding alone use 3-4 configurations (with 4, `kvfuzz run` end to end restarted its own).
POOL_SIZE = 12


def pytest_configure(config: pytest.Config) -> None:
    from kvfuzz.harness.inprocess import share_engines

    share_engines(POOL_SIZE)


def pytest_unconfigure(config: pytest.Config) -> None:
    from kvfuzz.harness.inprocess import unshare_engines

    unshare_engines()


def _planned(config: pytest.Config) -> list[Any]:
    state = _state(config)
    if "planned" in state:
        return state["planned"]
    from kvfuzz.driver import arms as arm_specs
    from kvfuzz.gate.gate import collect, gate_plan, load, self_test_plan

    paths = [Path(p) for p in config.getoption("kvfuzz_corpus")]
    entries = [load(p) for p in collect(paths)] if paths else []
    device = config.getoption("kvfuzz_device")
    if config.getoption("kvfuzz_self_test"):
        planned = self_test_plan(entries, device)
    else:
        spec = config.getoption("kvfuzz_arms")
        arm_map = arm_specs.build_arms(arms=spec, device=device) if spec else {arm_specs.VANILLA: []}
        planned = gate_plan(entries, arm_map)
    state["planned"] = planned
    return planned


def _kind(config: pytest.Config) -> tuple[EngineKind, str]:
    from kvfuzz.driver.settings import check_device, engine_kind

    device = check_device(config.getoption("kvfuzz_device"))
    return engine_kind(config.getoption("kvfuzz_engine"), config.getoption("kvfuzz_base_url"), device), device


def _session(config: pytest.Config) -> Session:
    """The one Session of this pytest run (shared by corpus cases and ``kvfuzz_session``)."""
    state = _state(config)
    if "session" not in state:
        from kvfuzz.gate.gate import default_runs
        from kvfuzz.driver.settings import SessionSettings
        from kvfuzz.driver.session import build_session

        kind, device = _kind(config)
        given = config.getoption("kvfuzz_out")
        out = Path(given) if given else Path(tempfile.mkdtemp(prefix="kvfuzz-pytest-"))
        out.mkdir(parents=True, exist_ok=True)
        runs = config.getoption("kvfuzz_runs") or default_runs(kind)
        state["session"] = build_session(SessionSettings(kind=kind, device=device, runs=runs,
                                                         base_url=config.getoption("kvfuzz_base_url")), out)
    return state["session"]


def _runner(config: pytest.Config) -> GateRunner:
    state = _state(config)
    if "runner" not in state:
        from kvfuzz.driver.arms import replay_engine_args
        from kvfuzz.gate.gate import GateRunner

        kind, device = _kind(config)
        out = Path(config.getoption("kvfuzz_out") or "kvfuzz-gate")
        session = _session(config)
        state["runner"] = GateRunner(session, runs=session.runs, strict=config.getoption("kvfuzz_strict"),
                                      engine_args=replay_engine_args(kind, device), findings_dir=out / "findings")
    return state["runner"]


@pytest.fixture(scope="session")
def kvfuzz_session(pytestconfig: pytest.Config) -> Session:
    """A ``kvfuzz.Session`` for the whole pytest run: the in-process vLLM engine (started on
    first use, restarted only for another engine configuration) or the engine that
    ``--kvfuzz-engine`` / ``--kvfuzz-base-url`` name. Closed when the run ends."""
    return _session(pytestconfig)


class KvfuzzCase:
    """One corpus file in one arm; ``check()`` replays it and fails the test if it should."""

    def __init__(self, config: pytest.Config, planned: Any) -> None:
        self._config = config
        self.planned = planned
        self.case: Any = None

    @property
    def id(self) -> str:
        return self.planned.id

    def check(self) -> Any:
        if self.planned.skipped:
            pytest.skip(self.planned.skipped)
        self.case, _ = _runner(self._config).run(self.planned)
        if not self.case.ok:
            pytest.fail(f"{self.case.status}: {self.case.verdict_text()}\nreplay: {self.case.replay_command}",
                        pytrace=False)
        return self.case


class KvfuzzItem(pytest.Item):
    def __init__(self, *, planned: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.planned = planned

    def runtest(self) -> None:
        KvfuzzCase(self.config, self.planned).check()

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.planned.entry.path, 0, f"kvfuzz {self.name}"


class KvfuzzCorpus(pytest.Collector):
    def collect(self) -> list[pytest.Item]:
        return [KvfuzzItem.from_parent(self, name=p.id, planned=p)
                for p in _planned(self.config)]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("kvfuzz_corpus"):
        return
    corpus = KvfuzzCorpus.from_parent(session, name="kvfuzz-corpus")
    items.extend(corpus.collect())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvfuzz_case" in metafunc.fixturenames:
        planned = _planned(metafunc.config) if metafunc.config.getoption("kvfuzz_corpus") else []
        metafunc.parametrize("kvfuzz_case", planned, ids=[p.id for p in planned],
                             indirect=True)


@pytest.fixture
def kvfuzz_case(request: pytest.FixtureRequest) -> KvfuzzCase:
    return KvfuzzCase(request.config, request.param)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _state(session.config)
    s = state.pop("session", None)
    if s is not None:
        s.close()
    state.clear()
