"""Rule 5.20 (issue 30, faults AM + AE on at once gave one bucket): a victim that broke nothing
agreed with a bucket named by a post-condition (`worker-adapter`) on every verdict, and the name
was lent across two causes. Where a named key meets an unnamed one over a name the harness can
enforce, the unnamed side's witness is replayed once with it enforced on every row: a victim
still wrong is not that name's. Pure logic: the replayer below answers from a table; the
enforcement itself runs on the engine in tests/test_postconditions_engine.py."""

from test_report import finding
from test_second_cause import checked, triage

from kvfuzz.oracle import buckets as rule
from kvfuzz.traces.buckets import Bucket, BucketKey, BucketMembership, agrees, mergeable, name_unearned, union, \
    with_evidence
from kvfuzz.traces.io import save
from kvfuzz.traces.result import Judged

WA = "worker-adapter"


def key(broke=None, **enforced):
    return BucketKey(cls="corruption", broke=broke, enforced={k.replace("_", "-"): v for k, v in enforced.items()})


def test_a_victim_still_wrong_with_the_name_enforced_is_not_that_names():
    assert agrees(key(), key(WA))  # no evidence either way: one cause, as before the rule
    assert not agrees(key(worker_adapter="persists"), key(WA))
    assert not agrees(key(WA), key(worker_adapter="persists"))
    assert agrees(key(worker_adapter="disappears"), key(WA))
    # Two unnamed keys the same enforcement told apart (AM's victims and AE's unnamed ones).
    assert not agrees(key(worker_adapter="persists"), key(worker_adapter="disappears"))
    assert agrees(key(worker_adapter="persists"), key())
    # Another name's enforcement says nothing about this one.
    assert agrees(key(worker_token="persists"), key(WA))


def test_the_enforcement_is_evidence_the_key_keeps():
    assert key(worker_adapter="persists").digest() != key().digest()
    assert union(key(), key(worker_adapter="persists")).enforced == {WA: "persists"}
    assert with_evidence(key(), {}, {WA: "disappears"}).enforced == {WA: "disappears"}
    assert with_evidence(key(worker_adapter="persists"), {}, {WA: "disappears"}).enforced == {WA: "persists"}
    # A name earned by its enforcement is not lent on no evidence (rule 5.7).
    assert name_unearned(key(WA), key(), ())
    assert not name_unearned(key(WA), key(worker_adapter="disappears"), ())
    am = Bucket(id="am", key=key(worker_adapter="persists"), first_index=0)
    ae = Bucket(id="ae", key=key(WA), first_index=1)
    assert mergeable({"am": am, "ae": ae}, {}) is None
    # Nor on no evidence (rule 5.7); an unnamed bucket the name fixes is the name's.
    assert mergeable({"am": am.model_copy(update={"key": key()}), "ae": ae}, {}) is None
    assert mergeable({"am": am.model_copy(update={"key": key(worker_adapter="disappears")}), "ae": ae},
                     {}) == ("am", "ae")


def unnamed():
    f = finding()
    d = f.divergences[0]
    assert d.request_id == "B" and d.class_ == "corruption"
    d.explained_by, d.broke, d.runs_diverged = None, None, d.runs
    return f


def adapter_named():
    f = unnamed()
    f.divergences[0].broke = WA
    return f


class Enforcing:
    """A step-exact replayer: the victim with ``worker-adapter`` enforced is ``left``."""

    step_exact = True

    def __init__(self, left="corruption"):
        self.left = left
        self.repairs: list[list[str]] = []

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), repair=(), settle=False):
        self.repairs.append(list(repair))
        return Judged(self.left if WA in repair else "corruption")


def adapter_bucket():
    return {"AE": Bucket(id="AE", key=key(WA), first_index=0, count=5)}


def test_an_unnamed_finding_joins_a_named_bucket_only_if_enforcing_the_name_fixes_it(tmp_path):
    r = Enforcing()
    t = triage(r, adapter_bucket(), tmp_path)
    f = unnamed()
    b, k, _ = t._match(f, rule.keys_of(f)[0])
    assert b is None and k.enforced == {WA: "persists"} and r.repairs == [[WA]]
    r = Enforcing(left="ok")
    t = triage(r, adapter_bucket(), tmp_path)
    b, k, how = t._match(f, rule.keys_of(f)[0])
    assert b is not None and b.id == "AE" and "enforced worker-adapter disappears" in how


def test_a_named_finding_measures_the_unnamed_buckets_own_witness_once(tmp_path):
    case = tmp_path / "buckets" / "AM.json"
    save(unnamed(), case)
    am = Bucket(id="AM", key=key(), first_index=0, count=5, case="buckets/AM.json")
    r = Enforcing()
    t = triage(r, {"AM": am}, tmp_path)
    f = adapter_named()
    b, _, _ = t._match(f, rule.keys_of(f)[0])
    assert b is None and r.repairs == [[WA]]  # AE's name does not take AM's bucket
    assert t._enforced == {"AM": {WA: "persists"}}  # the campaign adds it to AM's key
    m = t._done(checked(f), f, [BucketMembership(bucket="x", key=key(WA), status="opened")], "opened").buckets[0]
    assert m.enforced == {"AM": {WA: "persists"}}
    # Its bucket's witness is right with the name enforced: the name is that bucket's too.
    r = Enforcing(left="ok")
    t = triage(r, {"AM": am}, tmp_path)
    b, k, _ = t._match(f, rule.keys_of(f)[0])
    assert b is not None and b.id == "AM"


def test_past_the_share_an_unnamed_finding_is_checked_against_a_named_bucket(tmp_path):
    r = Enforcing()
    t = triage(r, adapter_bucket(), tmp_path)
    assert t._assign(checked(unnamed())) is None  # another cause: triaged
    r = Enforcing(left="ok")
    t = triage(r, adapter_bucket(), tmp_path)
    out = t._assign(checked(unnamed()))
    assert out is not None and [m.bucket for m in out.buckets] == ["AE"] and out.status == "assigned"
    assert "enforced worker-adapter disappears" in out.buckets[0].how
    assert [c.words for c in out.buckets[0].checks] == ["with worker-adapter enforced"]


def test_the_finding_is_not_replayed_twice_for_one_name(tmp_path):
    r = Enforcing()
    t = triage(r, adapter_bucket(), tmp_path)
    f = unnamed()
    assert t._assign(checked(f)) is None
    t._match(f, rule.keys_of(f)[0])  # the triage that follows: the check above is reused
    assert r.repairs == [[WA]]


def test_not_on_an_engine_that_is_not_step_exact(tmp_path):
    r = Enforcing()
    r.step_exact = False
    t = triage(r, adapter_bucket(), tmp_path)
    f = unnamed()
    b, _, _ = t._match(f, rule.keys_of(f)[0])
    assert b is not None and b.id == "AE" and not r.repairs


def test_a_victim_that_did_not_diverge_in_every_run_gives_no_evidence(tmp_path):
    """Rule 5.8: whether it is right with the name enforced says nothing about the name."""
    r = Enforcing()
    t = triage(r, adapter_bucket(), tmp_path)
    f = unnamed()
    f.divergences[0].runs_diverged = f.divergences[0].runs - 1
    b, k, _ = t._match(f, rule.keys_of(f)[0])
    assert b is not None and b.id == "AE" and k.enforced == {} and not r.repairs


def test_the_report_says_the_name_was_enforced():
    from kvfuzz.present.buckets import membership_text
    from kvfuzz.traces.buckets import MechanismCheck

    m = BucketMembership(bucket="AM", key=key(worker_adapter="persists"), status="triaged",
                         checks=[MechanismCheck(mechanism=WA, kind="enforced", victim="B", outcome="persists",
                                                verdict="persists"),
                                 MechanismCheck(mechanism="lora", victim="B", outcome="disappears", verdict="disappears")])
    assert membership_text(m).endswith("checks: with worker-adapter enforced: persists; without lora: disappears")
