"""Rule 5.19 (issue 30, faults AL + AI on at once gave one bucket): a victim named by a break
the harness can enforce, that later broke another check, is replayed once with the first
enforced; if it still corrupts, the later break names a second cause, with a key (and a bucket)
of its own. Pure logic: the replayer below answers from a table; the enforcement itself runs on
the engine in tests/test_postconditions_engine.py."""

from test_report import finding

from kvfuzz.oracle import buckets as rule
from kvfuzz.oracle.check import check
from kvfuzz.oracle.postconditions import later
from kvfuzz.traces import Repair
from kvfuzz.traces.buckets import Bucket, BucketKey
from kvfuzz.traces.history import Break
from kvfuzz.traces.result import Checked, Judged, Recording
from kvfuzz.triage.campaign import REFUTED_ENOUGH, CampaignTriage


def brk(step, name, request="B", root=None):
    return Break(step=step, name=name, request=request, root=root)


def test_a_later_break_of_another_name_after_an_enforceable_one():
    assert later([brk(3, "worker-position"), brk(7, "worker-token")], "B") == "worker-token"
    # Not another cause's: the same name again, or a later break of a name that broke at once.
    assert later([brk(3, "worker-position"), brk(3, "worker-token"), brk(7, "worker-token")], "B") is None
    # One fault breaking several checks breaks them in one step (AF): slot named, not enforceable.
    assert later([brk(3, "worker-slot"), brk(3, "worker-position"), brk(9, "worker-token")], "B") is None
    # The first later break by step, then precedence; another request's breaks do not count.
    assert later([brk(2, "worker-token"), brk(5, "worker-sample-row"), brk(5, "worker-seq-len"),
                  brk(1, "worker-row", request="A")], "B") == "worker-seq-len"
    # A later break rooted in a latent one is named by its root, as a victim is.
    assert later([brk(2, "worker-token"), brk(4, "held-block-foreign", root="map-entry-stolen")],
                 "B") == "map-entry-stolen"
    assert later([brk(2, "worker-token")], "B") is None and later([], "B") is None


def test_the_oracle_records_the_later_break_of_a_diverged_run():
    f = finding()
    runs = [r.model_copy(update={"breaks": [brk(3, "worker-position"), brk(7, "worker-token")]}) for r in f.runs]
    (b,) = [d for d in check(f.trace, runs, dict(f.references)) if d.request_id == "B"]
    assert b.class_ == "corruption" and b.broke == "worker-position" and b.later == "worker-token"


def named(broke="worker-position", later_="worker-token", repair=None):
    f = finding()
    d = f.divergences[0]
    assert d.request_id == "B" and d.class_ == "corruption"
    d.explained_by, d.broke, d.later, d.repair = None, broke, later_, repair
    return f


def test_a_second_cause_keys_on_its_own_only_when_the_repair_leaves_the_divergence():
    kept = named(repair=Repair(name="worker-position", outcome="persists", broke="worker-token",
                               victim_class="corruption"))
    assert [k.broke for k in rule.keys_of(kept)] == ["worker-position", "worker-token"]
    # The victim speaks for both keys (the second key's replays are judged on it).
    assert rule.victim_of(kept, rule.keys_of(kept)[1]) == "B"
    gone = named(repair=Repair(name="worker-position", outcome="disappears", victim_class="ok"))
    assert [k.broke for k in rule.keys_of(gone)] == ["worker-position"]
    # Persisting with no break, or with the same one again: no name to key on.
    for r in (Repair(name="worker-position", outcome="persists"),
              Repair(name="worker-position", outcome="persists", broke="worker-position")):
        assert [k.broke for k in rule.keys_of(named(repair=r))] == ["worker-position"]
    assert [k.broke for k in rule.keys_of(named())] == ["worker-position"]  # not replayed yet


class Enforcing:
    """A step-exact replayer: enforcing ``worker-position`` leaves the victim ``left``,
    with ``then`` broken."""

    step_exact = True

    def __init__(self, left="corruption", then="worker-token"):
        self.left, self.then = left, then
        self.repairs: list[list[str]] = []

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), repair=(), settle=False):
        self.repairs.append(list(repair))
        if repair:
            return Judged(self.left, broke=self.then if self.left != "ok" else None)
        return Judged("corruption", broke="worker-position")


def triage(replayer, buckets, tmp_path):
    t = CampaignTriage(replayer, None, {}, tmp_path, clean_arm=[])  # type: ignore[arg-type]
    t.restore(buckets, {})
    return t


def checked(f):
    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    return Checked(rec, list(f.verdicts), f)


def position_bucket():
    return {"P": Bucket(id="P", key=BucketKey(cls="corruption", broke="worker-position"), first_index=0, count=5)}


def test_past_the_share_a_later_break_no_bucket_has_is_triaged_and_names_its_bucket(tmp_path):
    r = Enforcing()
    t = triage(r, position_bucket(), tmp_path)
    assert t._assign(checked(named())) is None  # triaged, not assigned by its first name
    g = t._repaired(checked(named())).finding
    assert r.repairs == [["worker-position"]]
    assert g is not None and g.divergences[0].repair is not None
    assert [k.broke for k in rule.keys_of(g)] == ["worker-position", "worker-token"]
    b, _, how = t._match(g, rule.keys_of(g)[0])
    assert b is not None and b.id == "P" and "post-condition" in how
    assert t._match(g, rule.keys_of(g)[1])[0] is None  # the second cause opens its own


def test_a_refuted_later_break_stops_costing_replays(tmp_path):
    """Enforcing the first break made the victim right: the later break followed from it (one
    cause). After REFUTED_ENOUGH such findings, its name no longer sends findings to triage."""
    r = Enforcing(left="ok")
    t = triage(r, position_bucket(), tmp_path)
    for _ in range(REFUTED_ENOUGH):
        assert t._assign(checked(named())) is None
        g = t._repaired(checked(named())).finding
        assert g is not None and [k.broke for k in rule.keys_of(g)] == ["worker-position"]
    out = t._assign(checked(named()))
    assert out is not None and [m.bucket for m in out.buckets] == ["P"]
    assert len(r.repairs) == REFUTED_ENOUGH


def test_once_the_second_cause_has_its_bucket_findings_are_assigned_without_a_replay(tmp_path):
    r = Enforcing()
    bs = {**position_bucket(),
          "T": Bucket(id="T", key=BucketKey(cls="corruption", broke="worker-token"), first_index=3, count=1)}
    t = triage(r, bs, tmp_path)
    out = t._assign(checked(named()))
    assert out is not None and out.status == "assigned" and not r.repairs
    assert [m.bucket for m in out.buckets] == ["P"]  # no second cause confirmed in this campaign
    # One enforced replay left a victim wrong with worker-token (before T's bucket opened): later
    # findings whose victim broke it later are listed in T's bucket too, without a replay.
    t = triage(r, position_bucket(), tmp_path)
    t._repaired(checked(named()))
    t.restore(bs, {})
    out = t._assign(checked(named()))
    assert out is not None and [m.bucket for m in out.buckets] == ["P", "T"] and len(r.repairs) == 1
    assert out.buckets[1].status == "assigned" and "later break: worker-token" in out.buckets[1].how


def test_not_on_an_engine_that_is_not_step_exact(tmp_path):
    r = Enforcing()
    r.step_exact = False
    t = triage(r, position_bucket(), tmp_path)
    assert t._assign(checked(named())) is not None
    assert t._repaired(checked(named())).finding.divergences[0].repair is None and not r.repairs


def test_the_report_says_what_enforcing_the_first_break_showed():
    from kvfuzz.present.report import markdown

    f = named(repair=Repair(name="worker-position", outcome="persists", broke="worker-token",
                            victim_class="corruption"))
    md = markdown(f, source="x.json")
    assert "Replayed with `worker-position` enforced, it still diverged and broke worker-token first: a second cause" in md
    f = named(repair=Repair(name="worker-position", outcome="disappears", victim_class="ok"))
    assert "enforced, it was right: one cause" in markdown(f, source="x.json")


def test_a_finding_triaged_into_the_first_causes_bucket_is_listed_in_the_seconds_too(tmp_path):
    """Before the share is spent, a finding joins by its first name (rule 5); once this campaign
    confirmed the later name as a second cause, it is listed in that bucket too (AL + AI at
    af8a3bb: AL's bucket held one finding while five traces broke `worker-token` later)."""
    from kvfuzz.driver.settings import TriageSettings

    class Guard:
        def check(self, trace, *, runs, arms):
            return checked(named())

    import contextlib

    class Session(Enforcing):
        @contextlib.contextmanager
        def scoring(self, which):
            yield

    r = Session()
    t = CampaignTriage(r, Guard(), {}, tmp_path, clean_arm=[],  # type: ignore[arg-type]
                       settings=TriageSettings(attribute=False, minimize=False, controls=False, ablate=False))
    t.restore(position_bucket(), {})
    t._repaired(checked(named()))  # confirmed: worker-token is a second cause here
    t.restore({**position_bucket(),
               "T": Bucket(id="T", key=BucketKey(cls="corruption", broke="worker-token"), first_index=3, count=1)}, {})
    out = t(named().trace)
    assert out.status == "joined" and [(m.bucket, m.status) for m in out.buckets] == [("P", "triaged"), ("T", "assigned")]


def test_a_resumed_campaign_and_each_ray_task_start_from_the_committed_record(tmp_path):
    """Rule 5.19's record is read from the recorded findings into the campaign state, so a
    resumed campaign lists by the second cause without confirming it again, and a Ray task
    starts from exactly what was committed below it (not from its worker's earlier replays)."""
    import json

    from kvfuzz.fuzzer.campaign import Campaign, CampaignOptions, CampaignState
    from kvfuzz.traces.buckets import BucketMembership, SecondCauses

    c = Campaign(CampaignOptions(out=tmp_path / "out", budget_s=None, max_traces=0))
    confirmed = named(repair=Repair(name="worker-position", outcome="persists", broke="worker-token",
                                    victim_class="corruption"))
    refuted = named(later_="worker-seq-len", repair=Repair(name="worker-position", outcome="disappears",
                                                           victim_class="ok"))
    for i, f in enumerate([confirmed, refuted, named()]):  # the last was not replayed: no evidence
        c.record_finding(i, f.trace, "fresh", f, [BucketMembership(bucket="P", key=BucketKey(cls="corruption",
                                                                                             broke="worker-position"),
                                                                   status="triaged")])
    want = SecondCauses(confirmed=["worker-token"], refuted={"worker-seq-len": 1})
    assert c.state.second_causes == want
    assert CampaignState(**json.loads(c.state.to_json())).second_causes == want  # campaign.json
    bs = {**position_bucket(),
          "T": Bucket(id="T", key=BucketKey(cls="corruption", broke="worker-token"), first_index=3, count=1)}
    r = Enforcing()
    t = triage(r, {}, tmp_path)
    t.restore(bs, {}, c.state.second_causes)  # what --resume (and a Ray task) hands triage
    out = t._assign(checked(named()))
    assert out is not None and [m.bucket for m in out.buckets] == ["P", "T"] and not r.repairs
    # A later task with an empty committed record: the worker's earlier view does not carry over.
    t.restore(bs, {}, SecondCauses())
    out = t._assign(checked(named()))
    assert out is not None and [m.bucket for m in out.buckets] == ["P"] and not r.repairs
    # Triage's own copy: what it confirms does not write into the campaign's state behind it.
    t.restore(position_bucket(), {}, SecondCauses())
    t._repaired(checked(named()))
    assert t.second.confirmed == ["worker-token"] and c.state.second_causes == want
