"""Rule 5.21 (issue 30; fault AJ in bfloat16 at b6de30e): a witness whose minimization did not
finish, about to open a bucket only because its removal verdicts differ from a live bucket's,
is minimized further and ablated again before the merge check. AJ's 9-request witness "needed
chunked prefill, KV pressure" (removing either moved its victim off the batch position the
fault writes short); its 2-request minimum needed neither, as the bucket's witness did. Pure
logic: minimization and ablation answer from a table here; the rule's campaigns ran on the
real engine (docs/benchmarks.md)."""

from test_report import finding

from kvfuzz.traces.buckets import Bucket, BucketKey
from kvfuzz.traces.finding import Ablation, Explanation, Minimization
from kvfuzz.triage import campaign as tc

MECHS = ("prefix-caching", "chunked-prefill", "preemption")


def explanation(**outcomes):
    return Explanation(victim="B", cls="corruption", arm="fault",
                       ablations=[Ablation(mechanism=m, change="x", outcome=outcomes.get(m.replace("-", "_"), "persists"),
                                           victim_class="ok" if outcomes.get(m.replace("-", "_")) == "disappears"
                                           else "corruption")
                                  for m in MECHS])


def unexplained(minimization=None):
    f = finding()
    f.divergences[0].explained_by = None
    f.minimization = minimization
    f.explanation = explanation(chunked_prefill="disappears", preemption="disappears")
    return f


class Session:
    step_exact = True


def triage(tmp_path, monkeypatch, bucket_key, *, shrinks=True):
    """A campaign triage whose further minimization drops request C (unless not ``shrinks``)
    and whose ablation of the smaller witness finds every mechanism unneeded."""
    calls = {"minimize": 0, "explain": 0}

    def finish_finding(session, f, *, out, do_minimize, controls, max_seconds, victim, recorded_here):
        calls["minimize"] += 1
        g = f.model_copy(deep=True)
        if shrinks:
            g.trace = g.trace.model_copy(update={"events": [e for e in g.trace.events if e.request_id != "C"]})
        g.minimization = Minimization(requests=len(g.trace.sends), verified=True)
        return g

    def explain(session, f, *, victim=None, deadline=None, mechanisms=None, first=None):
        calls["explain"] += 1
        return explanation()

    monkeypatch.setattr(tc, "finish_finding", finish_finding)
    monkeypatch.setattr(tc, "explain", explain)
    t = tc.CampaignTriage(Session(), None, {}, tmp_path, clean_arm=[])  # type: ignore[arg-type]
    t.restore({"P": Bucket(id="P", key=bucket_key, first_index=0, count=40)}, {})
    return t, calls


ALL_PERSIST = BucketKey(cls="corruption", verdicts=dict.fromkeys(MECHS, "persists"))


def test_a_split_on_removal_verdicts_alone_is_measured_again_on_a_smaller_witness(tmp_path, monkeypatch):
    t, calls = triage(tmp_path, monkeypatch, ALL_PERSIST)
    f = unexplained()
    key = BucketKey(cls="corruption")
    got = t._smaller_if_split(f, [key], "B")
    assert calls == {"minimize": 1, "explain": 1} and [x.request_id for x in got.trace.sends] == ["A", "B"]
    assert "chunked-prefill, preemption" in got.notes["rule 5.21"]
    # The merge check then reads the smaller witness's verdicts: they agree with the bucket.
    from kvfuzz.oracle import buckets as rule

    merged = key.model_copy(update={"verdicts": rule.verdicts_of(got.explanation)})
    assert [b.id for b in tc.rule.candidates(merged, t.alive)] == ["P"]
    assert not tc.rule.candidates(key.model_copy(update={"verdicts": rule.verdicts_of(f.explanation)}), t.alive)


def test_not_when_the_witness_is_minimal_or_another_difference_keeps_them_apart(tmp_path, monkeypatch):
    # Minimal already: its verdicts are the key's.
    t, calls = triage(tmp_path, monkeypatch, ALL_PERSIST)
    done = unexplained(Minimization(requests=3, verified=True))
    assert t._smaller_if_split(done, [BucketKey(cls="corruption")], "B") is done and calls["minimize"] == 0
    # Cut short by its box: measured again.
    cut = unexplained(Minimization(requests=3, verified=True, stopped="time budget of 12 s spent"))
    assert t._smaller_if_split(cut, [BucketKey(cls="corruption")], "B") is not cut and calls["minimize"] == 1
    # The bucket names a post-condition the finding's self-only name conflicts with, or its key
    # conflicts on an enforcement too: no removal-only split, nothing replayed.
    for other in (BucketKey(cls="corruption", broke="worker-seq-len", verdicts=ALL_PERSIST.verdicts),
                  ALL_PERSIST.model_copy(update={"enforced": {"worker-token": "persists"}})):
        t, calls = triage(tmp_path, monkeypatch, other)
        key = BucketKey(cls="corruption", enforced={"worker-token": "disappears"}) if other.enforced else \
            BucketKey(cls="corruption", broke="worker-position")
        assert t._smaller_if_split(unexplained(), [key], "B").trace.sends and calls["minimize"] == 0
    # A witness whose replays are too long for the box's ablation part to measure the split
    # again (two mechanisms, 5 s each, 8 s of a 20 s box): not minimized; rule 5.22 decides.
    t, calls = triage(tmp_path, monkeypatch, ALL_PERSIST)
    t.settings = t.settings.model_copy(update={"minimize_seconds": 20.0})
    slow = unexplained(Minimization(requests=3, verified=True, stopped="time budget of 12 s spent"))
    for h in slow.runs:
        h.wall_seconds = 5.0
    assert t._smaller_if_split(slow, [BucketKey(cls="corruption")], "B") is slow and calls["minimize"] == 0
    assert t._unpaid
    for h in slow.runs:
        h.wall_seconds = 3.0  # 6 s of the 8: measured again
    assert t._smaller_if_split(slow, [BucketKey(cls="corruption")], "B") is not slow and calls["minimize"] == 1
    # A smaller witness that is not smaller: the larger one stays.
    t, calls = triage(tmp_path, monkeypatch, ALL_PERSIST, shrinks=False)
    f = unexplained()
    assert t._smaller_if_split(f, [BucketKey(cls="corruption")], "B") is f and calls == {"minimize": 1, "explain": 0}


def test_the_merge_check_joins_the_bucket_on_the_smaller_witness(tmp_path, monkeypatch):
    """Through a new bucket's triage: the box's minimization stops early (3 requests kept), the
    ablation says "needs chunked prefill, KV pressure"; minimized further, the 2-request witness
    needs neither, and the finding joins the bucket instead of opening a second."""
    from kvfuzz.driver.settings import TriageSettings
    from kvfuzz.traces.result import Checked, Recording

    calls = {"minimize": 0}

    def finish_finding(session, f, *, out, do_minimize, controls, max_seconds, victim, recorded_here):
        calls["minimize"] += 1
        g = f.model_copy(deep=True)
        if calls["minimize"] == 1:
            g.minimization = Minimization(requests=3, verified=True, stopped="time budget of 12 s spent")
        else:
            g.trace = g.trace.model_copy(update={"events": [e for e in g.trace.events if e.request_id != "C"]})
            g.minimization = Minimization(requests=2, verified=True)
        return g

    def explain(session, f, *, victim=None, deadline=None, mechanisms=None, first=None):
        big = len(f.trace.sends) > 2
        return explanation(chunked_prefill="disappears", preemption="disappears") if big else explanation()

    monkeypatch.setattr(tc, "finish_finding", finish_finding)
    monkeypatch.setattr(tc, "explain", explain)
    t = tc.CampaignTriage(Session(), None, {}, tmp_path, clean_arm=[],  # type: ignore[arg-type]
                          settings=TriageSettings(controls=False))
    t.restore({"P": Bucket(id="P", key=ALL_PERSIST, first_index=0, count=40)}, {})
    f = unexplained()
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    out = t._open(Checked(rec, list(f.verdicts), f), f, [], [BucketKey(cls="corruption")], 0.0, 1e9)
    assert calls["minimize"] == 2 and out.status == "joined"
    assert [(m.bucket, m.status) for m in out.buckets] == [("P", "triaged")]
    assert len(out.finding.trace.sends) == 2 and "rule 5.21" in out.finding.notes


def test_a_check_this_trace_already_made_is_not_replayed_again(tmp_path, monkeypatch):
    """Past the share a sampled check replays a finding without one mechanism; when it disagrees
    the finding is triaged, and the match asks the same check again: on a step-exact engine the
    first answer is reused (AJ's 9-request witness replayed without chunked prefill twice)."""
    n = {"explain": 0}

    def explain(session, f, *, victim=None, deadline=None, mechanisms=None, first=None):
        n["explain"] += 1
        return explanation(chunked_prefill="disappears")

    monkeypatch.setattr(tc, "explain", explain)
    t = tc.CampaignTriage(Session(), None, {}, tmp_path, clean_arm=[])  # type: ignore[arg-type]
    f, key = unexplained(), BucketKey(cls="corruption")
    assert t._check(f, "chunked-prefill", key)["chunked-prefill"] == "disappears"
    assert t._check(f, "chunked-prefill", key) == {"chunked-prefill": "disappears"}  # from the record
    assert n["explain"] == 1 and len(t._checks) == 1
    Session.step_exact = False
    try:
        t._check(f, "chunked-prefill", key)
    finally:
        Session.step_exact = True
    assert n["explain"] == 2  # a wall-clock engine's replay is another schedule: asked again
