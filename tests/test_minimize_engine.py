"""Minimization on the real vLLM CPU engine: a finding under a fault toggle shrinks to <= 3
requests and still reproduces; the real vLLM bug (docs/findings.md #1) shrinks to one base and
one LoRA request; k-of-m acceptance spends exactly the replays it should."""

from collections import defaultdict

import pytest

from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK, LORA_NS
from kvfuzz.traces import At, CancelEvent, GenPrompt, MinimizedFrom, SendEvent, Trace, load_finding, save
from kvfuzz.driver.recovery import Recovering
from kvfuzz.triage.executor import Budget as TriageBudget, Executor
from kvfuzz.triage.minimize import Acceptance, Budget, Options, choose_target, minimize_finding

pytestmark = pytest.mark.engine

FAULT_ARMS = {"fault": [LORA_NS, LORA_CPU_MASK]}  # the fix keeps the real CPU bug out of it


def _s(rid, step, length, max_tokens, adapter=None, group=None, prefix=0, seed=0):
    return SendEvent(request_id=rid, at=At(step=step, offset_ms=step * 10.0), adapter=adapter, max_tokens=max_tokens,
                     prompt=GenPrompt(length=length, prefix_group=group, prefix_len=prefix, seed=seed))


def noisy_alias_trace(cfg):
    """The LoRA-namespace aliasing (B on adapter b reuses A's prefix blocks from adapter a)
    buried in distractors: other adapters, other prefixes, long prompts and cancels."""
    return Trace(engine=cfg, events=[
        _s("d0", 0, 300, 16, seed=10), CancelEvent(request_id="d0", at=At(after_tokens=2)),
        _s("A", 0, 140, 4, "a", "shared", 128, seed=1),
        _s("d1", 3, 64, 8, "c", "other", 64, seed=11),
        _s("d2", 5, 500, 12, seed=12),
        _s("d3", 8, 96, 6, "c", "shared", 32, seed=13),
        _s("B", 12, 150, 8, "b", "shared", 128, seed=2),
        _s("d4", 12, 33, 6, seed=14), CancelEvent(request_id="d4", at=At(step=14, offset_ms=140.0)),
    ])


class CountingSession:
    """The shared session as a triage Replayer, recording the victim's class for every replay
    the minimizer makes (its probe through judge; its final verification through check)."""

    def __init__(self, session, victim):
        self.s, self.victim = session, victim
        self.replays: dict[str, list[str]] = defaultdict(list)

    @property
    def step_exact(self):
        return self.s.step_exact

    @property
    def reference_runs(self):
        return self.s.reference_runs

    def judge(self, trace, *, victim, arm, toggles):
        cls = self.s.judge(trace, victim=victim, arm=arm, toggles=toggles)
        self.replays[trace.trace_id()].append(cls)
        return cls

    def judge_victim(self, trace, *, victim, arm, toggles, **kw):
        j = self.s.judge_victim(trace, victim=victim, arm=arm, toggles=toggles, **kw)
        self.replays[trace.trace_id()].append(j.cls)
        return j

    def check(self, trace, *, runs=None, arms=None):
        c = self.s.check(trace, runs=runs, arms=arms)
        cls = next(v.class_ for v in c.verdicts if v.request_id == self.victim)
        self.replays[trace.trace_id()].extend([cls] * (runs or 1))
        return c


def test_fault_toggle_finding_minimizes_to_at_most_3_requests_with_k_of_m(session, lora_engine_config, tmp_path):
    t = noisy_alias_trace(lora_engine_config)
    found = session.check(t, arms=FAULT_ARMS).finding
    # B and d3 (adapter c, one block of the shared prefix) both read adapter a's blocks.
    assert found is not None and found.signature() == "corruption:B,d3", found.signature()
    victim = choose_target(found).victim
    assert victim == "d3"  # as reproducible as B (3/3) and sent earlier
    path = tmp_path / "orig.json"
    save(found, path)

    # k = 2, m = 2 on the deterministic engine: a kept candidate costs exactly 2 replays, a
    # rejected one exactly 1 (after one miss, 2 of 2 is out of reach).
    counting = CountingSession(session, victim)
    opts = Options(acceptance=Acceptance(2, 2), engine=False, budget=Budget(max_replays=300))
    small = minimize_finding(counting, found, options=opts, original_path=str(path))

    m = small.minimization
    assert m is not None and m.verified and m.signature == f"corruption:{victim}" and m.stopped is None
    assert len(small.trace.sends) <= 3, [s.request_id for s in small.trace.sends]
    assert {"A", victim} <= {s.request_id for s in small.trace.sends}
    assert m.original == found.id and m.original_requests == 7 and m.requests == len(small.trace.sends)
    assert small.provenance.minimized_from == MinimizedFrom(id=found.id, file=str(path))
    assert small.id != found.id and small.signature() == f"corruption:{victim}"
    assert small.minimization.repeats == 2 and small.minimization.min_hits == 2
    # Replay accounting: every replay the minimizer made is counted, and k-of-m stopped early.
    assert m.replays == sum(len(v) for v in counting.replays.values())
    for tid, classes in counting.replays.items():
        if tid == small.trace.trace_id():
            continue  # the final verification replays it 3 more times
        hits = classes.count("corruption")
        assert (hits, len(classes)) in ((2, 2), (0, 1)), classes

    # The minimized finding reproduces when replayed from its file.
    save(small, tmp_path / "min.json")
    again = session.check(load_finding(tmp_path / "min.json").trace, runs=1, arms=FAULT_ARMS)
    v = {d.request_id: d for d in again.verdicts}
    assert v[victim].class_ == "corruption" and v[victim].runs_diverged == 1
    # ...and the fault is what does it: without the toggle the minimized trace is clean.
    assert session.check(small.trace, runs=1, arms={"clean": [LORA_CPU_MASK]}).finding is None


def real_bug_trace(cfg):
    """A campaign-like mix of base and LoRA requests on unmodified vLLM (no toggles)."""
    return Trace(engine=cfg, events=[
        _s("r0", 0, 257, 10, "a", "g", 64, seed=20),
        _s("r1", 1, 90, 12, seed=21), CancelEvent(request_id="r1", at=At(after_tokens=1)),
        _s("r2", 2, 400, 6, "c", seed=22),
        _s("r3", 4, 180, 16, "b", "g", 64, seed=23),
        _s("r4", 4, 75, 9, seed=24),
        _s("r5", 6, 33, 7, "a", seed=25),
        _s("r6", 9, 128, 5, seed=26),
    ])


def test_real_cpu_lora_bug_minimizes_to_one_base_and_one_lora_request(session, lora_engine_config, tmp_path):
    found = session.check(real_bug_trace(lora_engine_config)).finding
    assert found is not None and found.worst_class() == "corruption"
    # What `kvfuzz run` does with a finding that opens a bucket: its witness minimized, ablated
    # and with its control arms, linked to the original (the campaign's finding file).
    small = Executor(session, Recovering(session), budget=TriageBudget(share=1.0, floor=600.0)).witness(found, None)
    assert small.provenance.minimized_from.id == found.id
    assert small.provenance.minimized_from.file == f"findings/corruption-{found.id}.json" and found.controls == []
    assert small.explanation is not None and "lora" in small.explanation.needs
    assert [(c.name, c.available, c.reproduced) for c in small.controls] == [
        ("serialized", True, False), ("batch-invariant", False, False)]
    m = small.minimization
    assert m.verified and m.requests == 2, [(s.request_id, s.adapter) for s in small.trace.sends]
    base = [s for s in small.trace.sends if s.adapter is None]
    lora = [s for s in small.trace.sends if s.adapter is not None]
    assert len(base) == 1 and len(lora) == 1
    assert m.signature == f"corruption:{base[0].request_id}"
    # One adapter slot: the base request reads it while the LoRA request is in the batch.
    assert m.engine_changes == {"lora.max_loras": [2, 1]} and small.trace.engine.lora.max_loras == 1
    assert m.replays > 0 and m.reference_runs > 0
    again = session.check(small.trace, runs=2)
    assert {(d.request_id, d.class_) for d in again.verdicts if d.class_ != "ok"} == {(base[0].request_id, "corruption")}
    fixed = session.check(small.trace, runs=1, arms={"fixed": [LORA_CPU_MASK]})
    assert fixed.finding is None
