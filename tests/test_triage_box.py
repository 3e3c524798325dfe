"""Triage time boxes (issue 18): the ablation stops at its deadline and says so; a new
bucket's triage box follows --minimize-seconds and the campaign's budget. Pure logic, no
engine: the replayer below records what it was asked to replay."""

import contextlib
import time

import pytest

from test_report import finding

from kvfuzz.triage.campaign import MIN_NEW_BUCKET_BOX_S, NEW_BUCKET_SHARE, CampaignTriage
from kvfuzz.traces.result import Judged
from kvfuzz.triage.explain import explain


class Recorder:
    step_exact = False

    def __init__(self):
        self.replays = 0

    def judge(self, trace, *, victim, arm, toggles):
        self.replays += 1
        return "ok"  # every mechanism "needed": the divergence disappears

    def judge_victim(self, trace, *, others=(), settle=False, **kw):
        return Judged(self.judge(trace, **kw))


class Confirming:
    """A session that records each confirmation's deadline and judges by ``f``'s verdicts."""

    step_exact = False

    def __init__(self, f):
        self.f, self.deadlines = f, []

    @contextlib.contextmanager
    def scoring(self, which):
        yield

    def confirm(self, recording, runs, *, deadline=None):
        self.deadlines.append(deadline)
        return recording

    def verdicts_of(self, recording, *, carry=None):
        from kvfuzz.traces.result import Checked

        return Checked(recording, list(self.f.verdicts), carry)


def confirming_triage(tmp_path, budget_s=None):
    """An unexplained finding, its recording, a Confirming session and a triage with a 100 s
    box that only confirms (no minimization, controls, ablation or attribution)."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.result import Recording

    f = finding()
    f.divergences[0].explained_by = None
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    s = Confirming(f)
    t = CampaignTriage(session=s, guard=None, arms={}, out=tmp_path, confirm_runs=3,  # type: ignore[arg-type]
                       settings=TriageSettings(minimize_seconds=100.0, minimize=False, controls=False,
                                               ablate=False, attribute=False, budget_s=budget_s))
    return f, rec, s, t


def test_ablation_past_its_deadline_skips_the_rest_and_says_so():
    f = finding()
    r = Recorder()
    ex = explain(r, f, deadline=time.monotonic() - 1)
    assert r.replays == 0
    skipped = [a for a in ex.ablations if a.outcome == "skipped"]
    assert skipped and all(a.detail == "triage time box spent" for a in skipped)
    assert ex.needs == [] and ex.not_needed == []  # nothing claimed that was not measured
    # Without a deadline the same finding is ablated: the replays happen.
    full = explain(Recorder(), f)
    assert full.replays > 0 and not any(a.outcome == "skipped" for a in full.ablations)
    assert {a.mechanism for a in full.ablations} == {a.mechanism for a in ex.ablations}


def test_new_bucket_box_is_the_smaller_of_minimize_seconds_and_the_budget_share(tmp_path):
    from kvfuzz.driver.settings import TriageSettings

    def box(budget, minimize_seconds=120.0):
        t = CampaignTriage(session=None, guard=None, arms={}, out=tmp_path,  # type: ignore[arg-type]
                           settings=TriageSettings(minimize_seconds=minimize_seconds, budget_s=budget))
        return t.new_bucket_box

    assert box(None) == 120.0  # --traces N: only --minimize-seconds bounds it
    assert box(3600) == 120.0
    assert box(300) == NEW_BUCKET_SHARE * 300 < 120.0  # a 5-minute campaign keeps fuzzing
    assert box(60) == MIN_NEW_BUCKET_BOX_S  # a one-minute campaign still minimizes its bug
    assert box(600, minimize_seconds=30) == 30


def test_a_skipped_ablation_is_not_reported_as_measured():
    from kvfuzz.oracle.buckets import describe, keys_of, verdicts_of

    f = finding()
    f.explanation = explain(Recorder(), f, deadline=time.monotonic() - 1)
    assert f.explanation.summary().startswith("not ablated: the triage time box ran out")
    (key,) = keys_of(f, verdicts_of(f.explanation))
    d = describe(key, f)
    assert "needs: not measured" in d.text and d.needs == [] and not d.measured
    assert key.verdicts == {}  # skipped ablations are "not tried": never part of a key


def test_confirmation_runs_stop_at_the_new_buckets_deadline(tmp_path):
    """Issue 30: a long finding's confirmation ran 88 s past the campaign's budget. Inside the
    box it starts no run past the deadline, and runs up to K before it."""
    from kvfuzz.driver.session import build_session
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.traces.result import Recording

    f = finding()

    class Replaying:
        kind = "inprocess"
        config = f.trace.engine

        def __init__(self):
            self.replays = 0

        def compatible(self, config):
            return True

        def replay(self, trace, *, arm, run_index, toggles, repair=(), until=(), settled=None):
            self.replays += 1
            return f.runs[0].model_copy(update={"arm": arm, "run_index": run_index})

    session = build_session(SessionSettings(runs=3), tmp_path)
    session.engine = engine = Replaying()  # type: ignore[assignment]
    one = [h for h in f.runs if h.run_index == 0][:1]
    rec = Recording(trace=f.trace, histories=one, references=f.references, environment=f.environment,
                    arms={one[0].arm: []})
    late = session.confirm(rec, 3, deadline=time.monotonic() - 1)
    assert engine.replays == 0 and len(late.histories) == 1
    early = session.confirm(rec, 3, deadline=time.monotonic() + 3600)
    assert engine.replays == 2 and len(early.histories) == 3


def test_a_new_buckets_confirmation_gets_a_fifth_of_its_box_and_the_ablation_its_tail(tmp_path):
    """Issue 30: fault P's 18-request witness spent the whole box confirming its rate, and its
    bucket opened with no key evidence. The confirmation now ends at CONFIRM_BOX of the box."""
    from kvfuzz.traces.buckets import BucketKey
    from kvfuzz.traces.result import Checked
    from kvfuzz.triage.campaign import CONFIRM_BOX

    f, rec, s, t = confirming_triage(tmp_path)
    t0 = time.monotonic()
    out = t._triage(Checked(rec, list(f.verdicts), f), [], [BucketKey(cls="corruption")])
    (d,) = s.deadlines
    assert t0 + CONFIRM_BOX * 100.0 - 1 <= d <= time.monotonic() + CONFIRM_BOX * 100.0
    assert out.status == "opened"


def test_teacher_forcing_scores_only_the_classes_it_is_asked_for():
    """Scoring can turn a near tie into corruption, never the reverse: a campaign's fuzzed runs
    score only near ties (no engine or store is touched for a corruption verdict)."""
    from kvfuzz.harness.runner import score_diverged
    from kvfuzz.traces.result import Recording

    f = finding()
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    corrupt = [d for d in f.divergences if d.class_ == "corruption"]
    assert corrupt
    assert score_diverged(None, rec, corrupt, None, classes=("numeric-near-tie",)) == []  # type: ignore[arg-type]

    class Store:
        calls = 0

        def get(self, engine, send, toks, binding):
            Store.calls += 1
            return []

    assert score_diverged(None, rec, corrupt, Store()) and Store.calls > 0  # type: ignore[arg-type]


def test_a_campaigns_fuzzed_runs_score_near_ties_only_and_the_session_is_left_as_it_was(tmp_path):
    from kvfuzz.driver.session import build_session
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.traces.result import Checked, Recording

    f = finding()
    session = build_session(SessionSettings(), tmp_path)
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    seen = []

    class Guard:
        def check(self, trace, *, runs=None, arms=None):
            seen.append(session._score_classes)
            return Checked(rec, [], None)  # clean

    t = CampaignTriage(session, Guard(), {}, tmp_path)  # type: ignore[arg-type]
    assert t(f.trace).status == "clean"
    assert seen == [("numeric-near-tie",)] and session._score_classes == ("corruption", "numeric-near-tie")


def test_control_arms_past_the_box_are_recorded_as_not_run():
    """Issue 30: a clean bfloat16 campaign's one near-tie finding spent 120 s on control arms
    after its 30 s box. Past the deadline no control starts (the replayer here cannot replay),
    and each says why."""
    from kvfuzz.triage.controls import SPENT, run_controls

    f = finding()
    f.trace = f.trace.model_copy(update={"engine": f.trace.engine.with_dtype("bfloat16")})
    out = run_controls(Recorder(), f, deadline=time.monotonic() - 1)
    assert [c.name for c in out] == ["serialized", "float32", "batch-invariant"]
    assert all(not c.available and c.detail == SPENT for c in out)
    # Nor one that would end past it: 30 s left, the finding's own run took 40 s (Y + P at 3
    # minutes: an 18-request witness's serialized control ran 10 s past its box).
    for h in f.runs:
        h.wall_seconds = 40.0
    out = run_controls(Recorder(), f, runs=1, deadline=time.monotonic() + 30)
    assert all(not c.available and c.detail == SPENT for c in out)


class NoJudge:
    """A step-exact session that must not be asked to judge a replay."""

    step_exact = True

    @contextlib.contextmanager
    def scoring(self, which):
        yield

    def judge(self, *a, **k):
        raise AssertionError("no replay expected")


def test_nothing_runs_past_the_campaigns_budget(tmp_path):
    """Issue 30: 3-minute campaigns ran 255-265 s (a last finding's triage after the budget).
    A new bucket's box ends with the budget (a quarter box at least, for its key); past it, a
    finding of a known bucket is filed by its pre-key with no replay."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.buckets import Bucket, BucketKey
    from kvfuzz.traces.result import Checked

    f, rec, s, t = confirming_triage(tmp_path, budget_s=1000.0)
    t.started = time.monotonic() - 995  # 5 s of budget left; the box would be 100 s
    t._triage(Checked(rec, list(f.verdicts), f), [], [BucketKey(cls="corruption")])
    (d,) = s.deadlines
    assert d <= time.monotonic() + 0.2 * 25.0 + 1  # the confirmation's share of a 25 s (quarter) box
    assert not t.over_budget
    t.started -= 10
    assert t.over_budget

    class Guard:
        def check(self, trace, *, runs=None, arms=None):
            return Checked(rec, list(f.verdicts), f.model_copy(deep=True))

    t2 = CampaignTriage(session=NoJudge(), guard=Guard(), arms={}, out=tmp_path,  # type: ignore[arg-type]
                        settings=TriageSettings(budget_s=10.0), clean_arm=[])
    t2.restore({"A": Bucket(id="A", key=BucketKey(cls="corruption", verdicts={"prefix-caching": "disappears"}),
                            first_index=0, count=1)})
    t2._calls, t2.started = 1, time.monotonic() - 11
    out = t2(f.trace)
    assert out.status == "assigned" and out.buckets[0].bucket == "A" and out.buckets[0].how == "pre-key"


def test_an_unsettled_task_defers_a_finding_no_bucket_knows_and_replays_nothing_for_it(tmp_path):
    """On Ray a lower trace may be opening this finding's bucket right now: the worker files it
    by its pre-key (a bucket of its own, untriaged) and says so, with no triage replay; settled,
    the same finding is triaged in full (the box starts: here, its confirmation)."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.result import Checked

    f = finding()
    f.divergences[0].explained_by = None
    f.verdicts = [v.model_copy(update={"explained_by": None}) for v in f.verdicts]
    f.attribution = None
    rec = None

    class Guard:
        def check(self, trace, *, runs=None, arms=None):
            return Checked(rec, list(f.verdicts), f.model_copy(deep=True))  # type: ignore[arg-type]

    class NoReplays(NoJudge):
        # A step-exact session's box starts with minimization (no confirmation runs there).
        @property
        def reference_runs(self):
            raise RuntimeError("the box started")

    # Attribution on, but no bucket could take it: deferred before any re-run (the Guard here
    # has no ``rerun``: an attribution would fail).
    t = CampaignTriage(session=NoReplays(), guard=Guard(), arms={}, out=tmp_path,  # type: ignore[arg-type]
                       clean_arm=[])
    t.settled = False
    out = t(f.trace)
    assert out.status == "deferred" and len(out.buckets) == 1
    assert out.buckets[0].status == "assigned" and out.buckets[0].how.startswith("not triaged")
    t.settled = True
    t.settings = TriageSettings(attribute=False)
    with pytest.raises(RuntimeError, match="the box started"):
        t(f.trace)


def test_a_known_buckets_attribution_that_would_end_past_the_budget_is_not_started(tmp_path):
    """Issue 30: two 30 s LoRA-bug attributions started 16 s before the end of a 3-minute
    campaign. The re-runs are estimated from the trace's own run (one per arm attribution may
    add): one that would end past the budget is not started, the finding is filed by pre-key."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.result import Checked, Recording

    f = finding()
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    t = CampaignTriage(session=None, guard=None, arms={}, out=tmp_path,  # type: ignore[arg-type]
                       settings=TriageSettings(budget_s=100.0), clean_arm=[])
    t.started = time.monotonic() - 95  # 5 s left; attribution adds one arm (clean) here
    c = Checked(rec, list(f.verdicts), f)
    assert not t._outlasts_budget(c, 3.0)
    assert t._outlasts_budget(c, 6.0)
    t.settings = TriageSettings(budget_s=None)
    assert not t._outlasts_budget(c, 600.0)


def test_a_minimization_whose_share_of_the_box_is_spent_is_not_started(tmp_path, monkeypatch):
    """A clean bfloat16 LoRA campaign on Ray: confirming a 9-request near tie (12 s a run) left
    0.3 s of the minimization share of a 20 s box, and the minimization still replayed the
    original to accept it and three times to verify it (36 s). It is not started when its share
    cannot pay for two replays of the trace; the finding says so."""
    import kvfuzz.triage.campaign as campaign
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.buckets import BucketKey
    from kvfuzz.traces.result import Checked

    f, rec, s, t = confirming_triage(tmp_path)
    t.settings = TriageSettings(minimize_seconds=20.0, minimize=True, controls=False, ablate=False, attribute=False)
    called = []
    monkeypatch.setattr(campaign, "finish_finding", lambda *a, **k: called.append(k) or a[1])
    checked = Checked(rec, list(f.verdicts), f)
    t._run_seconds = 0.5  # the trace's own run
    out = t._open(checked, f, [], [BucketKey(cls="corruption")], start=time.monotonic() - 13, box=20.0)
    assert not called and "not minimized: the triage time box was spent" in out.finding.notes["minimize"]
    t._open(checked, f, [], [BucketKey(cls="corruption")], start=time.monotonic(), box=20.0)
    assert len(called) == 1 and 11 < called[0]["max_seconds"] <= 12
    # 0.3 s of the share left, a 12 s trace: two replays do not fit, it is not started either.
    t._run_seconds = 12.0
    t._open(checked, f, [], [BucketKey(cls="corruption")], start=time.monotonic() - 11.7, box=20.0)
    assert len(called) == 1
    t._open(checked, f, [], [BucketKey(cls="corruption")], start=time.monotonic(), box=20.0)
    assert len(called) == 1  # 12 s left is less than two 12 s replays
    t._run_seconds = 5.0
    t._open(checked, f, [], [BucketKey(cls="corruption")], start=time.monotonic(), box=20.0)
    assert len(called) == 2


def test_after_full_triage_a_new_name_joins_an_unnamed_bucket_only_on_every_verdict(tmp_path):
    """Rule 5.7 at the last merge check (Y + P on Ray at b5bf538: P's witness, triaged in full,
    had only "chunked prefill persists" — its other removals moved — agreed with Y's bucket and
    gave it P's name, one bucket of 57). It opens its own bucket; with a verdict for each of the
    bucket's checks it still merges."""
    from kvfuzz.traces.buckets import Bucket, BucketKey
    from kvfuzz.traces.result import Checked

    y = {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}
    for verdicts, status in (({"chunked-prefill": "persists"}, "opened"), (y, "joined")):
        f, rec, s, t = confirming_triage(tmp_path)
        t.restore({"Y": Bucket(id="Y", key=BucketKey(cls="corruption", verdicts=y), first_index=0, count=1)}, {})
        key = BucketKey(cls="corruption", broke="map-entry-orphaned", verdicts=verdicts)
        out = t._triage(Checked(rec, list(f.verdicts), f), [], [key])
        assert out.status == status, out.buckets


def test_a_full_match_that_would_take_the_known_buckets_past_their_share_is_not_started(tmp_path):
    """Fault AS (frequent) in bfloat16 at bce9bfc spent 28% of a 3-minute campaign in triage: the
    share was checked only before each match, and a match (attribution and up to three check
    replays, 15-20 s each on that machine) overshot it by its whole cost. A match whose estimated
    cost (its runs, each as long as the trace's own) would pass the share is not started: the
    finding is assigned."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.result import Checked, Recording

    f = finding()
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    t = CampaignTriage(session=None, guard=None, arms={}, out=tmp_path,  # type: ignore[arg-type]
                       settings=TriageSettings(budget_s=None), clean_arm=[])
    t.started = time.monotonic() - 100  # a 10 s share so far
    c = Checked(rec, list(f.verdicts), f)
    runs = 1 + 3  # the clean arm's attribution re-run, three checks
    assert not t._outlasts_share(c, 9.0 / runs)
    assert t._outlasts_share(c, 11.0 / runs)
    t.known_seconds = 5.0
    assert t._outlasts_share(c, 6.0 / runs) and not t._outlasts_share(c, 4.0 / runs)
    t.settings, t.known_seconds = TriageSettings(attribute=False), 0.0
    assert not t._outlasts_share(c, 9.0 / 3) and t._outlasts_share(c, 11.0 / 3)
    # Through the campaign's call: a known bucket, 2 s into the campaign (a 0.2 s share), a 0.3 s
    # trace whose match would cost four of its runs: assigned by its pre-key, nothing replayed.
    from kvfuzz.traces.buckets import Bucket, BucketKey

    class Guard:
        def check(self, trace, *, runs=None, arms=None):
            time.sleep(0.3)
            return Checked(rec, list(f.verdicts), f.model_copy(deep=True))

    f.divergences[0].explained_by = None
    f.verdicts = [v.model_copy(update={"explained_by": None}) for v in f.verdicts]
    t2 = CampaignTriage(session=NoJudge(), guard=Guard(), arms={}, out=tmp_path,  # type: ignore[arg-type]
                        settings=TriageSettings(attribute=False), clean_arm=[])
    t2.restore({"A": Bucket(id="A", key=BucketKey(cls="corruption"), first_index=0, count=1)})
    t2._calls, t2.started = 1, time.monotonic() - 2
    out = t2(f.trace)
    assert out.status == "assigned" and out.buckets[0].bucket == "A"


def test_ablation_starts_no_replay_that_would_end_past_its_deadline(monkeypatch):
    """Y + P at 3 minutes: an unminimized witness whose replays took 15 s started its ablation
    1 s before its 20 s box ended and ran 34 s. A replay is started only when the time left
    pays for one: the witness's own recorded run, then the longest replay so far."""
    from kvfuzz.triage import explain as ex_mod

    clock = [1000.0]
    monkeypatch.setattr(ex_mod.time, "monotonic", lambda: clock[0])

    class Slow(Recorder):
        def judge(self, trace, **kw):
            clock[0] += 10.0  # each replay takes 10 s
            return super().judge(trace, **kw)

    f = finding()
    for h in f.runs:
        h.wall_seconds = 1.0
    r = Slow()
    ex = explain(r, f, deadline=clock[0] + 25.0)
    # 25 s left: one replay (1 s expected), 15 s left: another (10 s now), 5 s left: none.
    assert r.replays == 2
    skipped = [a for a in ex.ablations if a.outcome == "skipped"]
    assert skipped and all(a.detail == "triage time box: 5.0 s left, a replay takes about 10.0 s" for a in skipped)
    # A witness whose own run took longer than the box starts none at all.
    for h in f.runs:
        h.wall_seconds = 30.0
    r = Slow()
    explain(r, f, deadline=clock[0] + 25.0)
    assert r.replays == 0


def test_a_replay_that_stops_at_its_victim_is_estimated_to_the_victims_end(monkeypatch):
    """Rule 5.24: a victim's replay stops once the victim (and the other victims judged with
    it) are done, so it costs the recorded run up to where they ended, not the whole run (Y + P:
    Y's victims ended a quarter of the way into 9 s traces)."""
    from kvfuzz.triage import explain as ex_mod
    from kvfuzz.triage.controls import replay_seconds

    f = finding()
    victim = f.divergences[0].request_id
    for h in f.runs:
        h.wall_seconds = 30.0
        for rid, rec in h.requests.items():
            rec.finished_ms, rec.cancel_ms = (2000.0, None) if rid == victim else (29000.0, None)
    assert replay_seconds(f) == 30.0
    assert replay_seconds(f, [victim]) == 2.0
    assert replay_seconds(f, [victim, "not-in-the-run"]) == 30.0  # one never ended: the whole run
    others = [r for r in f.runs[0].requests if r != victim]
    assert replay_seconds(f, [victim, *others[:1]]) == 29.0

    clock = [1000.0]
    monkeypatch.setattr(ex_mod.time, "monotonic", lambda: clock[0])

    class Quick(Recorder):
        def judge(self, trace, **kw):
            clock[0] += 2.0
            return super().judge(trace, **kw)

    r = Quick()
    explain(r, f, deadline=clock[0] + 25.0)
    assert r.replays >= 2  # a 30 s witness whose victim ends at 2 s is ablated in a 25 s box
