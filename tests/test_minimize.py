"""The minimizer's logic, without an engine: target choice, the passes, and a whole
minimization against a fake (flaky) oracle. The reducers have their own tests (test_reduce.py)."""

import random

import pytest

from kvfuzz.traces import CampaignOrigin, MinimizedFrom
from kvfuzz.traces import At, CancelEvent, Divergence, Environment, Finding, GenPrompt, LoraSettings, SendEvent, Trace
from kvfuzz.traces.result import Checked, Recording
from kvfuzz.traces.trace import EngineConfig
from kvfuzz.triage.minimize import Acceptance, Budget, Minimizer, Options, Target, choose_target


def _div(rid, cls, k, n, arm="default"):
    return Divergence(request_id=rid, class_=cls, arm=arm, runs_diverged=k, runs=n)


def _finding(trace, divs, arms=None):
    return Finding(trace=trace, environment=Environment(kvfuzz_version="t"), divergences=divs,
                   arms=arms or {"default": []})


def _send(rid, step, **kw):
    kw.setdefault("prompt", GenPrompt(length=kw.pop("length", 64), seed=sum(map(ord, rid))))
    return SendEvent(request_id=rid, at=At(step=step), **kw)


def test_choose_target_prefers_severity_then_reproducibility_then_order():
    t = Trace(events=[_send(f"r{i}", i) for i in range(4)])
    f = _finding(t, [_div("r0", "numeric-near-tie", 3, 3), _div("r1", "corruption", 1, 3),
                     _div("r2", "corruption", 3, 3), _div("r3", "corruption", 3, 3)],
                 arms={"default": [], "fault": ["x"]})
    tg = choose_target(f)
    assert (tg.cls, tg.victim) == ("corruption", "r2") and tg.signature == "corruption:r2"
    f.divergences.append(_div("r1", "error", 1, 3, arm="fault"))
    tg = choose_target(f)
    assert (tg.cls, tg.victim, tg.arm, tg.toggles) == ("error", "r1", "fault", ("x",))
    assert choose_target(f, "r3").victim == "r3"
    with pytest.raises(ValueError):
        choose_target(f, "nobody")


# -- a whole minimization against a fake oracle ---------------------------------------------------

LORA = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "embedded:a", "b": "embedded:b"}, max_loras=2))


def fake_bug(trace: Trace) -> bool:
    """'victim' (base) diverges iff it is live together with a request on adapter b, whose
    prompt is at least 40 tokens, and the victim asks for at least 3 tokens."""
    try:
        v = trace.send("victim")
    except KeyError:
        return False
    return v.max_tokens >= 3 and v.adapter is None and any(
        s.adapter == "b" and s.prompt.length >= 40 and abs(s.at.step - v.at.step) <= 2 for s in trace.sends)


def noisy_trace() -> Trace:
    events = [_send("d0", 0, adapter="a", max_tokens=9, length=300), CancelEvent(request_id="d0", at=At(after_tokens=2)),
              _send("d1", 3, max_tokens=12, length=90), _send("hit", 5, adapter="b", max_tokens=16, length=200),
              _send("victim", 6, max_tokens=20, length=120), _send("d2", 6, adapter="a", max_tokens=5, length=33),
              CancelEvent(request_id="d2", at=At(step=8)), _send("d3", 9, adapter="b", max_tokens=4, length=10)]
    return Trace(engine=LORA, events=events)


def test_minimizer_against_a_deterministic_fake():
    calls = []
    m = Minimizer(Target("corruption", "victim"), lambda t: calls.append(t) or fake_bug(t),
                  Options(engine=False))
    r = m.run(noisy_trace())
    t = r.trace
    assert fake_bug(t)
    assert sorted(s.request_id for s in t.sends) == ["hit", "victim"] and not t.cancels
    hit, victim = t.send("hit"), t.send("victim")
    # bisection with a bounded number of tries lands on or just above the smallest value
    assert hit.adapter == "b" and 40 <= hit.prompt.length <= 45 and hit.max_tokens == 1
    assert victim.max_tokens == 3 and victim.prompt.length == 1 and victim.adapter is None
    assert min(s.at.step for s in t.sends) == 0
    assert r.replays == len(calls) and r.stopped is None
    assert r.accepted[0] is not None and all(fake_bug(a) for a in r.accepted)


def test_minimizer_with_a_flaky_oracle_uses_k_of_m():
    rng = random.Random(5)
    calls: dict[str, list] = {}

    def flaky(t):  # reproduces 70% of the time when the bug is present, never otherwise
        hit = fake_bug(t) and rng.random() < 0.7
        calls.setdefault(t.trace_id(), [t, []])[1].append(hit)
        return hit

    m = Minimizer(Target("corruption", "victim"), flaky, Options(acceptance=Acceptance(5, 2), engine=False))
    r = m.run(noisy_trace())
    assert fake_bug(r.trace) and len(r.trace.sends) == 2
    assert r.replays == sum(len(h) for _, h in calls.values())
    accepted = {a.trace_id() for a in r.accepted}
    for tid, (t, hits) in calls.items():
        if not fake_bug(t):  # never hits: decided after k - m + 1 = 4 misses
            assert hits == [False] * 4 and tid not in accepted
        elif tid in accepted:  # kept on the 2nd hit, not a replay later
            assert sum(hits) == 2 and hits[-1] is True
        else:  # a real candidate unluckily rejected: 4 misses
            assert sum(hits) <= 1 and len(hits) - sum(hits) == 4


def test_minimizer_respects_the_replay_budget():
    m = Minimizer(Target("corruption", "victim"), fake_bug, Options(engine=False, budget=Budget(max_replays=5)))
    r = m.run(noisy_trace())
    assert r.replays == 5 and r.stopped and "budget" in r.stopped
    assert fake_bug(r.trace)  # the last accepted candidate, never an untested one


def test_minimizer_starts_no_candidate_its_time_budget_cannot_pay_for():
    """Checking the clock only before each candidate lets a minimization overrun its budget by
    a replay and a verification (replays of a large witness take seconds), leaving the ablation
    after it no time. A candidate starts only when it and the verification replay after it, each
    as long as the longest replay so far, still end within the budget."""
    clock = [0.0]

    def slow_bug(t):
        clock[0] += 3.0  # every replay takes 3 s
        return fake_bug(t)

    m = Minimizer(Target("corruption", "victim"), slow_bug, Options(engine=False, budget=Budget(max_seconds=10.0)),
                  clock=lambda: clock[0])
    r = m.run(noisy_trace())
    # 0 s: a candidate (nothing measured yet); 3 s: 3 + 2 x 3 < 10, another; 6 s: 6 + 6 >= 10, stop.
    assert r.replays == 2 and r.stopped == "time budget of 10 s spent" and clock[0] == 6.0
    assert fake_bug(r.trace)


def test_minimizer_engine_pass_and_adapter_unification():
    # Reproduces whenever two LoRA requests share one adapter and the victim runs with them.
    def bug(t):
        try:
            t.send("victim")
        except KeyError:
            return False
        ads = [s.adapter for s in t.sends if s.adapter]
        return len(ads) >= 2 and len(set(ads)) == 1

    events = [_send("x", 0, adapter="a"), _send("y", 0, adapter="b"), _send("victim", 0),
              _send("z", 1, adapter="a")]
    m = Minimizer(Target("corruption", "victim"), bug, Options())
    r = m.run(Trace(engine=LORA, events=events))
    assert bug(r.trace) and len(r.trace.sends) == 3
    assert m.engine_changes == {"lora.max_loras": [2, 1]}
    assert r.trace.engine.lora.max_loras == 1


def test_minimizer_keeps_the_adapter_lifecycle_a_trace_needs():
    """A lifecycle trace (schema 2): dropping requests keeps the load / reload events (they have
    no request id), so the plan stays valid and a reload the bug needs survives; lifecycle
    events the bug does not need go (here: another adapter's load, unload and reload)."""
    from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

    def bug(t):  # 'victim' on x diverges iff x was reloaded before it
        try:
            v = t.send("victim")
        except KeyError:
            return False
        return v.adapter == "x" and any(isinstance(e, ReloadAdapterEvent) and e.name == "x" and e.at.step <= v.at.step
                                        for e in t.events)

    events = [LoadAdapterEvent(name="x", source="embedded:c", at=At(step=0)), _send("d0", 0, adapter="x"),
              _send("d1", 1, adapter="a"), ReloadAdapterEvent(name="x", source="embedded:c@v2", same_path=True,
                                                              at=At(step=4)),
              _send("victim", 5, adapter="x", max_tokens=4), _send("d2", 6),
              LoadAdapterEvent(name="y", source="embedded:b", at=At(step=2)),
              ReloadAdapterEvent(name="a", source="embedded:a@v2", at=At(step=3)),
              UnloadAdapterEvent(name="y", at=At(step=7))]
    r = Minimizer(Target("corruption", "victim"), bug, Options(engine=False)).run(
        Trace(schema_version=2, engine=LORA, events=events))
    assert bug(r.trace) and [s.request_id for s in r.trace.sends] == ["victim"]
    assert [(e.kind, e.name) for e in r.trace.lifecycle] == [("load-adapter", "x"), ("reload-adapter", "x")]
    assert any(p.startswith("lifecycle: 5 -> 2 adapter events") for p in r.passes), r.passes


# -- minimize_finding against a fake wall-clock replayer (the server path, no engine) -------------


class FakeServer:
    """A triage Replayer on a wall-clock engine: replays by the fake_bug rule, reproducing with
    probability p per run."""

    step_exact = False
    reference_runs = 0

    def __init__(self, p, seed=0):
        self.p, self.rng, self.replays = p, random.Random(seed), 0

    def judge(self, trace, *, victim, arm, toggles):
        return next(v.class_ for v in self.check(trace, runs=1, arms={arm: list(toggles)}).verdicts
                    if v.request_id == victim)

    def check(self, trace, *, runs=None, arms=None):
        (arm,) = arms
        runs = runs or 1
        self.replays += runs
        k = sum(fake_bug(trace) and self.rng.random() < self.p for _ in range(runs))
        verdicts = [Divergence(request_id=s.request_id, class_="corruption" if k and s.request_id == "victim" else "ok",
                               arm=arm, runs_diverged=k if s.request_id == "victim" else 0, runs=runs)
                    for s in trace.sends]
        env = Environment(kvfuzz_version="t", engine="server")
        f = None
        if k:
            f = Finding(trace=trace, environment=env,
                        divergences=[v for v in verdicts if v.class_ != "ok"], verdicts=verdicts, arms={arm: []})
            f.id = f.compute_id()
        return Checked(Recording(trace=trace, histories=[], references={}, environment=env, arms={arm: []}),
                       verdicts, f)


def _noisy_finding():
    t = noisy_trace()
    f = Finding(trace=t, environment=Environment(kvfuzz_version="t", engine="server"),
                divergences=[Divergence(request_id="victim", class_="corruption", runs_diverged=3, runs=4)],
                arms={"default": []}, notes={"campaign": {"seed": 1, "index": 7}})
    f.id = f.compute_id()
    return f


def test_minimize_finding_on_a_flaky_wall_clock_engine():
    from kvfuzz.triage.minimize import minimize_finding

    server = FakeServer(p=0.8, seed=3)
    orig = _noisy_finding()
    small = minimize_finding(server, orig, original_path="orig.json")
    m = small.minimization
    assert m.verified and m.repeats == 4 and m.min_hits == 2  # wall-clock defaults
    assert sorted(s.request_id for s in small.trace.sends) == ["hit", "victim"]
    assert m.replays == server.replays and m.original == orig.id and m.original_requests == 6
    assert small.provenance.minimized_from == MinimizedFrom(id=orig.id, file="orig.json")
    assert small.provenance.campaign == CampaignOrigin(seed=1, index=7)
    # the offset clock was shrunk (a server schedules by offset_ms)
    assert all(e.at.offset_ms is not None for e in small.trace.events)
    assert min(e.at.offset_ms for e in small.trace.sends) == 0


def test_minimize_finding_refuses_what_does_not_reproduce():
    from kvfuzz.triage.minimize import NotReproduced, minimize_finding

    server = FakeServer(p=0.0)
    with pytest.raises(NotReproduced, match="corruption:victim"):
        minimize_finding(server, _noisy_finding())
    assert server.replays == 3  # 4 - 2 + 1 misses decide it


def test_a_spent_budget_does_not_walk_back_through_every_accepted_step():
    """After the time budget, a result that does not verify is not followed by a verification of
    each earlier accepted step (each is several full runs): the original is kept, unverified, and
    says why."""
    from kvfuzz.triage.minimize import Budget, Options, minimize_finding
    from kvfuzz.triage.reduce import Acceptance

    class SmallFails(FakeServer):
        """Reproduces every time in the search; a full check of anything smaller than the
        original never does (a result that fails its verification)."""

        verifications = 0

        def check(self, trace, *, runs=None, arms=None):
            full = (runs or 1) > 1
            self.verifications += full
            self.p = 0.0 if full and len(trace.sends) < 6 else 1.0
            return super().check(trace, runs=runs, arms=arms)

    server = SmallFails(p=1.0)
    opts = Options(acceptance=Acceptance(1, 1), budget=Budget(max_replays=8), clock="offset", engine=False)
    small = minimize_finding(server, _noisy_finding(), options=opts, runs=2)
    m = small.minimization
    assert m.stopped and not m.verified and m.requests == 6
    assert any("budget was spent" in p for p in m.passes), m.passes
    assert server.verifications == 1  # the result's, then no walk back


class TwoCauses:
    """A step-exact replayer with two causes on: 'victim' diverges whenever 'd1' is live (cause
    A, which breaks `worker-token` on it), and also whenever 'hit' is live (cause B, which breaks
    nothing); with both, A's break names it."""

    step_exact = True
    reference_runs = 0

    def __init__(self):
        self.replays = 0

    def _victim(self, trace):
        ids = {s.request_id for s in trace.sends}
        if "victim" not in ids:
            return "ok", None
        if "d1" in ids:
            return "corruption", "worker-token"
        return ("corruption", None) if "hit" in ids else ("ok", None)

    def judge_victim(self, trace, *, victim, arm, toggles, **kw):
        from kvfuzz.traces.result import Judged

        self.replays += 1
        cls, broke = self._victim(trace)
        return Judged(cls, broke=broke)

    def judge(self, trace, **kw):
        raise AssertionError("a step-exact minimization judges the victim's name too")

    def check(self, trace, *, runs=None, arms=None):
        (arm,) = arms
        runs = runs or 1
        self.replays += runs
        cls, broke = self._victim(trace)
        verdicts = [Divergence(request_id=s.request_id, class_=cls if s.request_id == "victim" else "ok", arm=arm,
                               runs_diverged=runs if s.request_id == "victim" and cls != "ok" else 0, runs=runs,
                               broke=broke if s.request_id == "victim" else None)
                    for s in trace.sends]
        env = Environment(kvfuzz_version="t", engine="inprocess")
        f = Finding(trace=trace, environment=env, divergences=[v for v in verdicts if v.class_ != "ok"],
                    verdicts=verdicts, arms={arm: []}) if cls != "ok" else None
        if f is not None:
            f.id = f.compute_id()
        return Checked(Recording(trace=trace, histories=[], references={}, environment=env, arms={arm: []}),
                       verdicts, f)


def test_a_named_victim_does_not_shrink_into_another_causes_witness():
    """A finding two causes hit, keyed by one cause's break (`worker-token`), must not shrink to a
    witness of the other cause (which breaks nothing): the name is part of the minimizer's
    target, so the bucket's witness is of its own cause."""
    from kvfuzz.triage.minimize import minimize_finding

    orig = _noisy_finding()
    orig.divergences[0].broke = "worker-token"
    r = TwoCauses()
    small = minimize_finding(r, orig)
    assert sorted(s.request_id for s in small.trace.sends) == ["d1", "victim"]
    assert small.divergences[0].broke == "worker-token" and small.minimization.verified
    assert small.minimization.signature == "corruption:victim"
    # Without the name in its target (as on a wall-clock engine), it shrinks to B's witness.
    r.step_exact = False
    r.judge = lambda trace, **kw: r.judge_victim(trace, **kw).cls
    small = minimize_finding(r, orig)
    assert sorted(s.request_id for s in small.trace.sends) == ["hit", "victim"]


def test_a_campaign_finding_on_a_step_exact_engine_is_not_replayed_to_accept_it():
    """Replaying a finding only to learn what its own recorded run already showed can cost a
    short minimization budget all its time. A finding recorded by this replayer
    (``recorded_here``) that diverged so in every run is taken as reproducing; one from a file
    (``kvfuzz minimize``) is still replayed first."""
    from kvfuzz.triage.minimize import minimize_finding

    class Counting(TwoCauses):
        originals = 0

        def judge_victim(self, trace, **kw):
            self.originals += len(trace.sends) == 6
            return super().judge_victim(trace, **kw)

    orig = _noisy_finding()
    d = orig.divergences[0]
    d.broke, d.runs_diverged, d.runs = "worker-token", 1, 1
    for here, replays_of_original in ((False, 1), (True, 0)):
        r = Counting()
        small = minimize_finding(r, orig, recorded_here=here)
        assert r.originals == replays_of_original and small.minimization.verified
        assert sorted(s.request_id for s in small.trace.sends) == ["d1", "victim"]
    # Its recorded run did not show the target in every run: replayed, as before.
    d.runs_diverged, d.runs = 1, 2
    r = Counting()
    minimize_finding(r, orig, recorded_here=True)
    assert r.originals == 1


def test_a_minimization_cut_after_its_structure_passes_goes_on_at_the_numbers_pass():
    """A minimization cut by its budget after the request, cancel, adapter and engine passes
    would, minimized again, run those passes first, find nothing, and never reach the prompt
    lengths. Minimizing it again starts with the numbers."""
    from kvfuzz.traces import Minimization
    from kvfuzz.triage.minimize import resumes_at_numbers

    cut = Minimization(stopped="time budget of 36 s spent",
                       passes=["probdd: 11 -> 5 requests (15 replays)", "cancels: 1 -> 1 (1 replay)"])
    assert resumes_at_numbers(cut)
    assert not resumes_at_numbers(cut.model_copy(update={"stopped": None}))  # it finished
    assert not resumes_at_numbers(cut.model_copy(update={"passes": [*cut.passes, "numbers: 900 -> 80 tokens"]}))
    assert not resumes_at_numbers(Minimization(stopped="budget", passes=[])) and not resumes_at_numbers(None)
    order = []

    class Recording(Minimizer):
        def numbers_pass(self, trace):
            order.append("numbers")
            return super().numbers_pass(trace)

        def events_pass(self, trace):
            order.append("events")
            return super().events_pass(trace)

    Recording(Target("corruption", "victim"), fake_bug, Options(engine=False, numbers_first=True)).run(noisy_trace())
    assert order[:2] == ["numbers", "events"] and order.count("numbers") <= 3
    order.clear()
    Recording(Target("corruption", "victim"), fake_bug, Options(engine=False)).run(noisy_trace())
    assert order[:2] == ["events", "numbers"]
