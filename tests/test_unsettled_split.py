"""Rule 5.22 (issue 30; fault AQ, written after rule 5.21, split in-process at 3 minutes): near
a campaign's end, a finding that would open a bucket only because removal verdicts differ from
a live bucket's, where each "disappears" was measured on a witness whose minimization did not
finish and the budget leaves no box to finish it, joins that bucket, marked unsettled, instead
of opening a second one. Mid-campaign rule 5.21's box decides, as before. Pure logic:
minimization and ablation answer from a table here; the campaigns ran on the real engine
(docs/benchmarks.md). Last, a new bucket's 16-bit near tie gets its float32 control first (the
class decides the section its bucket is shown in)."""

import time

from test_smaller_witness import ALL_PERSIST, Session, explanation, unexplained

from kvfuzz.driver.settings import TriageSettings
from kvfuzz.traces import save
from kvfuzz.traces.buckets import Bucket, BucketKey, BucketMembership, unsettled
from kvfuzz.traces.finding import Minimization
from kvfuzz.traces.result import Checked, Recording
from kvfuzz.triage import campaign as tc

CUT = Minimization(requests=5, verified=True, stopped="time budget of 12 s spent")
CP_GONE = BucketKey(cls="corruption", verdicts={"chunked-prefill": "disappears", "preemption": "persists"})
CP_KEPT = BucketKey(cls="corruption", verdicts={"chunked-prefill": "persists", "preemption": "persists"})


def test_the_pure_rule_reads_which_side_disappeared_and_whether_it_was_minimal():
    # The new key's "disappears" on an unfinished witness, the bucket persisting: unsettled.
    assert unsettled(CP_GONE, CP_KEPT, key_minimal=set(), bucket_minimal=True) == ["chunked-prefill"]
    # ...measured on a minimal witness: a real difference (fault T's shape stays a split).
    assert unsettled(CP_GONE, CP_KEPT, key_minimal={"chunked-prefill"}, bucket_minimal=False) == []
    # The bucket's "disappears" on its unfinished witness, the new minimal key persisting.
    assert unsettled(CP_KEPT, CP_GONE, key_minimal={"chunked-prefill", "preemption"},
                     bucket_minimal=False) == ["chunked-prefill"]
    assert unsettled(CP_KEPT, CP_GONE, key_minimal=set(), bucket_minimal=True) == []
    # A difference that is not a removal verdict (names, a self-only name, an enforcement) is
    # never unsettled: it is not measured on a schedule.
    for a, b in ((CP_GONE.model_copy(update={"broke": "worker-token"}), CP_KEPT.model_copy(update={"broke": "worker-row"})),
                 (CP_GONE.model_copy(update={"broke": "worker-seq-len"}), CP_KEPT),
                 (CP_GONE.model_copy(update={"enforced": {"worker-token": "persists"}}),
                  CP_KEPT.model_copy(update={"broke": "worker-token"}))):
        assert unsettled(a, b, key_minimal=set(), bucket_minimal=False) == []
    # A name on one side only (faults Y + P in bfloat16 at 68acb5f: P's named witness joined Y's
    # unnamed bucket as unsettled and lent it the name): not a removal-only difference.
    assert unsettled(CP_GONE.model_copy(update={"broke": "map-entry-orphaned"}), CP_KEPT, key_minimal=set(),
                     bucket_minimal=True) == []
    assert unsettled(CP_GONE.model_copy(update={"broke": "worker-row"}), CP_KEPT.model_copy(update={"broke": "worker-row"}),
                     key_minimal=set(), bucket_minimal=True) == ["chunked-prefill"]
    # Agreeing keys have nothing to settle.
    assert unsettled(CP_KEPT, CP_KEPT, key_minimal=set(), bucket_minimal=False) == []


def _triage(tmp_path, monkeypatch, bucket_key, *, seconds_left, further_shrinks=True, case=None):
    """A triage whose box-cut witness (5 requests) "needs chunked prefill"; minimized further it
    needs nothing. ``seconds_left`` of the campaign's budget, each replay of the trace 5 s."""
    calls = {"minimize": 0}

    def finish_finding(session, f, *, out, do_minimize, controls, max_seconds, victim, recorded_here):
        calls["minimize"] += 1
        g = f.model_copy(deep=True)
        if calls["minimize"] == 1:
            g.minimization = CUT
        elif further_shrinks:
            g.trace = g.trace.model_copy(update={"events": [e for e in g.trace.events if e.request_id != "C"]})
            g.minimization = Minimization(requests=2, verified=True)
        return g

    def explain(session, f, *, victim=None, deadline=None, mechanisms=None, first=None):
        big = len(f.trace.sends) > 2
        return explanation(chunked_prefill="disappears") if big else explanation()

    monkeypatch.setattr(tc, "finish_finding", finish_finding)
    monkeypatch.setattr(tc, "explain", explain)
    t = tc.CampaignTriage(Session(), None, {}, tmp_path, clean_arm=[],  # type: ignore[arg-type]
                          settings=TriageSettings(controls=False, budget_s=180.0))
    t.started = time.monotonic() - 180.0 + seconds_left
    t._run_seconds = 5.0
    t.restore({"P": Bucket(id="P", key=bucket_key, first_index=0, count=1, case=case)}, {})
    return t, calls


def _open(t, f):
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    return t._open(Checked(rec, list(f.verdicts), f), f, [], [BucketKey(cls="corruption")], time.monotonic(), 20.0)


def test_at_the_campaigns_end_a_box_cut_witness_joins_instead_of_splitting(tmp_path, monkeypatch):
    t, calls = _triage(tmp_path, monkeypatch, ALL_PERSIST, seconds_left=2.0)
    out = _open(t, unexplained())
    assert calls["minimize"] == 1  # rule 5.21 could not be paid for
    assert out.status == "joined" and [(m.bucket, m.status, m.unsettled) for m in out.buckets] == \
        [("P", "triaged", ["chunked-prefill"])]
    assert "rule 5.22" in out.buckets[0].how


def test_mid_campaign_rule_5_21_decides_and_a_real_difference_still_opens(tmp_path, monkeypatch):
    # A box left: the witness is minimized further and joins on its smaller form (rule 5.21).
    t, calls = _triage(tmp_path, monkeypatch, ALL_PERSIST, seconds_left=100.0)
    out = _open(t, unexplained())
    assert calls["minimize"] == 2 and [(m.bucket, m.unsettled) for m in out.buckets] == [("P", [])]
    # Its smaller form still needs chunked prefill (paid for, not smaller): the split stands.
    t, calls = _triage(tmp_path, monkeypatch, ALL_PERSIST, seconds_left=100.0, further_shrinks=False)
    out = _open(t, unexplained())
    assert out.status == "opened" and out.buckets[0].bucket != "P" and not out.buckets[0].unsettled


def test_the_buckets_own_unfinished_witness_counts_only_when_no_box_is_left(tmp_path, monkeypatch):
    """The bucket's witness (its regression case) was cut by its box and "needs chunked
    prefill"; the new witness is minimal and does not."""
    bucket_witness = unexplained(CUT)
    save(bucket_witness, tmp_path / "buckets" / "P.json")

    def minimal_new():
        f = unexplained(Minimization(requests=2, verified=True))
        f.explanation = explanation()
        return f

    def finish_finding(session, f, **kw):
        return f  # already minimal: nothing to do

    for left, want in ((2.0, ("joined", "P", ["chunked-prefill"])), (100.0, ("opened", None, []))):
        t, _ = _triage(tmp_path, monkeypatch, CP_GONE, seconds_left=left, case="buckets/P.json")
        monkeypatch.setattr(tc, "finish_finding", finish_finding)
        monkeypatch.setattr(tc, "explain", lambda session, f, **kw: explanation())
        out = _open(t, minimal_new())
        m = out.buckets[0]
        assert (out.status, m.bucket if m.status != "opened" else None, m.unsettled) == want


def test_the_campaign_counts_and_shows_them(tmp_path):
    from kvfuzz.fuzzer.campaign import Campaign, CampaignOptions
    from kvfuzz.present.buckets import count_text, markdown, rows

    from test_report import finding

    camp = Campaign(CampaignOptions(seed=0, max_traces=2, out=tmp_path))
    key = BucketKey(cls="corruption")
    first, second = finding(), finding()
    first.divergences[0].explained_by = second.divergences[0].explained_by = None
    camp.record_finding(0, first.trace, "fresh", first,
                        [BucketMembership(bucket="P", key=key, status="opened", how="new key")])
    camp.record_finding(1, second.trace, "fresh", second,
                        [BucketMembership(bucket="P", key=key, status="triaged", how="rule 5.22",
                                          unsettled=["chunked-prefill"])])
    b = camp.state.bug_buckets["P"]
    assert (b.count, b.unsettled) == (2, 1)
    assert "1 on an unsettled split" in markdown(rows(camp.state.bug_buckets, camp.state.merges), 2)
    # --resume reads the mark back from campaign.json (no finding loses its bucket's mark).
    assert _resumed(camp, tmp_path).bug_buckets["P"].unsettled == 1
    assert count_text(3, 1, 0) == "3 (1 assigned, not triaged)" and count_text(3, 0, 0) == "3"


def test_mid_campaign_the_buckets_unfinished_witness_is_minimized_again_and_the_finding_joins(tmp_path, monkeypatch):
    """Fault AQ at 10 minutes (2b860da): the bucket's witness, cut by its box at 5 requests,
    "needed chunked prefill"; a later minimal witness did not, and opened a second bucket. Now
    the bucket's witness is minimized further; its smaller form needs nothing either, so the
    finding joins, and the campaign makes the smaller witness the bucket's case and its verdicts
    the bucket's."""
    from kvfuzz.fuzzer.campaign import Campaign, CampaignOptions
    from kvfuzz.traces import load_finding

    save(unexplained(CUT), tmp_path / "buckets" / "P.json")
    t, _ = _triage(tmp_path, monkeypatch, CP_GONE, seconds_left=100.0, case="buckets/P.json")
    shrunk = []

    def finish_finding(session, f, *, out, do_minimize, controls, max_seconds, victim, recorded_here):
        g = f.model_copy(deep=True)
        g.trace = g.trace.model_copy(update={"events": [e for e in g.trace.events if e.request_id != "C"]})
        g.minimization = Minimization(requests=2, verified=True)
        shrunk.append(len(f.trace.sends))
        return g

    def explain(session, f, **kw):
        return explanation(chunked_prefill="disappears") if len(f.trace.sends) > 2 else explanation()

    monkeypatch.setattr(tc, "finish_finding", finish_finding)
    monkeypatch.setattr(tc, "explain", explain)
    new = unexplained(Minimization(requests=2, verified=True))
    new.trace = new.trace.model_copy(update={"events": [e for e in new.trace.events if e.request_id != "C"]})
    new.explanation = explanation()
    out = _open(t, new)
    m = out.buckets[0]
    assert shrunk == [2, 3] and (out.status, m.bucket, m.unsettled) == ("joined", "P", [])
    assert m.rewitness is not None and m.rewitness.requests == (3, 2)
    assert m.rewitness.verdicts["chunked-prefill"] == "persists" and (tmp_path / m.rewitness.case).is_file()

    # The campaign applies it: the smaller witness is the bucket's case, its verdicts the key's.
    camp = Campaign(CampaignOptions(seed=0, max_traces=2, out=tmp_path))
    camp.state.bug_buckets["P"] = Bucket(id="P", key=CP_GONE, first_index=0, count=1, case="buckets/P.json")
    camp.record_finding(1, out.finding.trace, "fresh", out.finding, out.buckets)
    b = camp.state.bug_buckets["P"]
    assert (b.count, b.key.verdicts["chunked-prefill"], b.case) == (2, "persists", "buckets/P.json")
    assert len(load_finding(tmp_path / "buckets" / "P.json").trace.sends) == 2
    assert _resumed(camp, tmp_path).bug_buckets["P"].key.verdicts["chunked-prefill"] == "persists"
    assert not (tmp_path / m.rewitness.case).exists()


def test_a_16_bit_near_tie_gets_its_float32_control_before_anything_else(tmp_path, monkeypatch):
    """Fault AR in bfloat16 at 79c3552: an 18-request witness spent its box before its float32
    control, so a corruption (the same trace corrupts in float32) was filed among the near ties.
    A new 16-bit near tie now runs that control first; corruption there re-files it."""
    from kvfuzz.traces import ControlResult

    def near_tie(dtype):
        f = unexplained()
        f.trace = f.trace.model_copy(update={"engine": f.trace.engine.with_dtype(dtype)})
        f.divergences = [d.model_copy(update={"class_": "numeric-near-tie"}) for d in f.divergences]
        f.verdicts = [v.model_copy(update={"class_": "numeric-near-tie"}) if v.request_id == f.divergences[0].request_id
                      else v for v in f.verdicts]
        f.controls = []
        return f

    for dtype, f32_class, want in (("bfloat16", "corruption", "corruption"), ("bfloat16", "ok", "numeric-near-tie"),
                                   ("float32", "corruption", "numeric-near-tie")):
        t, _ = _triage(tmp_path, monkeypatch, ALL_PERSIST, seconds_left=100.0)
        t.settings = TriageSettings(controls=True, budget_s=180.0)
        calls = []

        def float32_control(session, f, *, runs, toggles, f32_class=f32_class):
            calls.append(len(f.trace.sends))
            v = f.divergences[0].model_copy(update={"class_": f32_class, "arm": "float32"})
            return ControlResult(name="float32", reproduced=f32_class == "corruption", available=True, verdicts=[v])

        monkeypatch.setattr(tc, "float32_control", float32_control)
        monkeypatch.setattr(tc, "add_controls", lambda session, f, deadline=None: f)  # the later, full set
        said = []
        monkeypatch.setattr(t, "status", said.append)
        f = near_tie(dtype)
        rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references),
                        environment=f.environment, arms=dict(f.arms))
        out = t._open(Checked(rec, list(f.verdicts), f), f, [], [BucketKey(cls="numeric-near-tie")],
                      time.monotonic(), 20.0)
        assert calls == ([] if dtype == "float32" else [3])
        assert [m.key.cls for m in out.buckets] == [want] and out.finding.worst_class() == want
        # A re-filed finding has a new id: the log names it, so the id it printed is in a file.
        assert (f"recorded as {out.finding.id}" in " ".join(said)) == (want == "corruption")


def _resumed(camp, out):
    """The state `--resume` starts from, after the campaign committed its own."""
    import dataclasses

    from kvfuzz.fuzzer.campaign import CAMPAIGN_FILE, load_state
    from kvfuzz.traces.io import atomic_write_text

    atomic_write_text(out / CAMPAIGN_FILE, camp.state.to_json())
    return load_state(out, dataclasses.replace(camp.opts, resume=True))
