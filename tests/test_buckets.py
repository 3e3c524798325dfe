"""One bug, one bucket (issue 30): the key, the merge check and the assignment of every
finding. Pure logic, no engine: the replayer below answers each ablation from a table, as a
fault with known mechanisms would."""

import json
import shutil
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from test_report import finding

from kvfuzz.fuzzer.campaign import Campaign, CampaignOptions, CampaignState
from kvfuzz.oracle import buckets as rule
from kvfuzz.traces import Finding, load_finding, save
from kvfuzz.traces.buckets import (KEY_MECHANISMS, Bucket, BucketKey, BucketMembership, MechanismCheck, agrees, conflicts,
                                   union)
from kvfuzz.traces.result import Judged
from kvfuzz.triage.campaign import ASSIGN_CHECK_EVERY, CampaignTriage

DATA = Path(__file__).parent / "data" / "present"
verdicts = st.dictionaries(st.sampled_from(KEY_MECHANISMS), st.sampled_from(["disappears", "persists"]))


def key(v=None, cls="corruption", explained_by=None):
    return BucketKey(cls=cls, explained_by=explained_by, verdicts=dict(v or {}))


@given(verdicts, verdicts)
def test_agreement_is_symmetric_and_union_keeps_it(a, b):
    assert agrees(key(a), key(b)) == agrees(key(b), key(a))
    if agrees(key(a), key(b)):
        u = union(key(a), key(b))
        assert agrees(u, key(a)) and agrees(u, key(b)) and set(u.verdicts) == set(a) | set(b)


@given(verdicts, st.sampled_from(KEY_MECHANISMS))
def test_not_tried_never_counts_as_a_difference(v, m):
    """A witness whose box cut its ablation short agrees with the full one; a tried removal
    that went the other way does not."""
    partial = {k: o for k, o in v.items() if k != m}
    assert agrees(key(partial), key(v))
    flipped = {**v, m: "persists" if v.get(m) == "disappears" else "disappears"}
    assert not agrees(key(flipped), key({**v, m: "disappears" if flipped[m] == "persists" else "persists"}))
    assert conflicts(key(flipped), key({**flipped, m: v.get(m, "persists")})) in ([], [m])


def test_class_and_explanation_must_match():
    assert not agrees(key(), key(cls="numeric-near-tie"))
    assert not agrees(key(explained_by="fault-x"), key())
    # An explained key is decided by its toggle: mechanism verdicts are recorded, not compared.
    assert agrees(key({"prefix-caching": "disappears"}, explained_by="t"), key({"prefix-caching": "persists"},
                                                                               explained_by="t"))


def test_the_shape_and_schedule_ablations_are_not_in_the_key():
    f = finding()
    f.divergences[0].explained_by = None
    from kvfuzz.traces import Ablation, Explanation

    f.explanation = Explanation(victim="B", cls="corruption", arm="fault", ablations=[
        Ablation(mechanism="concurrency", change="x", outcome="disappears"),
        Ablation(mechanism="prefix-caching", change="x", outcome="disappears"),
        Ablation(mechanism="preemption", change="x", outcome="skipped"),
        Ablation(mechanism="cancels", change="x", outcome="persists")])
    (k,) = rule.keys_of(f, rule.verdicts_of(f.explanation))
    assert k.verdicts == {"prefix-caching": "disappears"}
    d = rule.describe(k, f)
    assert "concurrent requests" in d.text and "not tried: KV pressure" in d.text and d.requests == 3


class Table:
    """A replayer whose victim diverges unless a mechanism in ``needs`` is removed."""

    step_exact = False  # rule 5.8 (a flaky witness) is tested apart

    def __init__(self, needs):
        self.needs = set(needs)
        self.replays = 0

    def judge(self, trace, *, victim, arm, toggles):
        self.replays += 1
        e = trace.engine
        gone = {"prefix-caching": not e.enable_prefix_caching, "chunked-prefill": not e.enable_chunked_prefill,
                "lora": not e.lora.enabled}
        return "ok" if any(gone.get(m) for m in self.needs) else "corruption"

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        return Judged(self.judge(trace, victim=victim, arm=arm, toggles=toggles))


def bucket(bid, v, first, cls="corruption"):
    return Bucket(id=bid, key=key(v, cls=cls), first_index=first, count=1)


def triage(replayer, buckets, tmp_path):
    t = CampaignTriage(replayer, None, {}, tmp_path, clean_arm=[])  # type: ignore[arg-type]
    t.restore(buckets, {})
    return t


def unexplained():
    f = finding()
    f.divergences[0].explained_by = None
    f.trace = f.trace.model_copy(update={"engine": f.trace.engine.model_copy(update={"enable_prefix_caching": True})})
    return f


def test_one_replay_of_the_distinguishing_check_picks_the_bucket(tmp_path):
    """Two unexplained buckets that differ on prefix caching: a new witness is replayed without
    it once, and joins the one it agrees with, not the earlier one."""
    bs = {"P": bucket("P", {"prefix-caching": "persists", "lora": "disappears"}, 1),
          "Q": bucket("Q", {"prefix-caching": "disappears"}, 2)}
    r = Table(needs=["prefix-caching"])
    b, k, how = triage(r, bs, tmp_path)._match(unexplained(), key())
    assert b is not None and b.id == "Q" and k.verdicts["prefix-caching"] == "disappears"
    assert "prefix-caching disappears" in how and r.replays <= rule.MAX_CHECKS


def test_a_witness_that_agrees_with_no_bucket_opens_one(tmp_path):
    bs = {"Q": bucket("Q", {"prefix-caching": "disappears"}, 2)}
    b, k, _ = triage(Table(needs=["lora"]), bs, tmp_path)._match(unexplained(), key())
    assert b is None and k.verdicts["prefix-caching"] == "persists"


def test_past_the_share_a_finding_is_assigned_never_left_without_a_bucket(tmp_path):
    f = unexplained()
    bs = {"Q": bucket("Q", {"prefix-caching": "disappears"}, 2)}
    r = Table(needs=["prefix-caching"])
    t = triage(r, bs, tmp_path)
    from kvfuzz.traces.result import Checked, Recording

    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    out = t._assign(Checked(rec, list(f.verdicts), f))
    # The first assignment is sampled: one replay of the bucket's verdict, which agrees.
    assert out.status == "assigned" and [m.bucket for m in out.buckets] == ["Q"] and r.replays == 1
    assert out.finding.buckets[0].status == "assigned" and out.finding.bucket == "Q"
    assert "prefix-caching disappears" in out.finding.buckets[0].how
    # The next ones (until the next sample) by pre-key alone.
    for _ in range(ASSIGN_CHECK_EVERY - 1):
        again = t._assign(Checked(rec, list(f.verdicts), unexplained()))
        assert again is not None and again.buckets[0].bucket == "Q" and again.buckets[0].how == "pre-key"
    assert r.replays == 1


def checked_of(f):
    from kvfuzz.traces.result import Checked, Recording

    rec = Recording(trace=f.trace, histories=list(f.runs), references=dict(f.references), environment=f.environment,
                    arms=dict(f.arms))
    return Checked(rec, list(f.verdicts), f)


def test_past_the_share_a_sampled_replay_sends_a_second_cause_to_triage(tmp_path):
    """Past the share a second cause would otherwise be filed by pre-key under the only
    bucket of its class (P + S: 23 of 29 findings assigned, all to one bucket). The sampled
    replay of one of the bucket's verdicts disagrees, and the finding is triaged instead."""
    bs = {"S": bucket("S", {"prefix-caching": "disappears", "lora": "persists"}, 1)}
    r = Table(needs=["prefix-caching", "lora"])  # a witness of P: needs LoRA too
    t = triage(r, bs, tmp_path)
    # The rotation reaches every verdict of the bucket: LoRA at the first sample.
    assert t._assign(checked_of(unexplained())) is None and r.replays == 1


def test_past_the_share_a_finding_that_broke_what_the_bucket_never_did_is_checked_on_every_verdict(tmp_path):
    """Issue 30, faults Y + P: Y's bucket (no post-condition broken, nothing needed) took P's
    first finding past the share — its one sampled replay, chunked prefill, agreed — and with
    it P's name, so every later P finding joined by name: two causes, one bucket. A finding
    whose run broke a post-condition that the bucket's witnesses never broke is replayed on
    each of the bucket's verdicts; P needs prefix caching, Y does not."""
    bs = {"Y": bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)}
    r = Table(needs=["prefix-caching"])  # a witness of P
    f = unexplained()
    f.divergences[0].broke = "map-entry-orphaned"
    t = triage(r, bs, tmp_path)
    assert t._assign(checked_of(f)) is None  # triaged as another cause
    assert r.replays == 3  # chunked prefill and KV pressure agreed, prefix caching did not
    # Y's own findings (nothing broken) are still assigned by the sampled rule.
    r2 = Table(needs=[])
    t2 = triage(r2, bs, tmp_path)
    out = t2._assign(checked_of(unexplained()))
    assert out is not None and out.buckets[0].bucket == "Y" and r2.replays == 1


class ByTrace(Table):
    """A replayer for two causes: a trace whose first request asks for ``tokens`` tokens is
    the second cause's witness (it needs ``other``); any other trace needs ``needs``."""

    def __init__(self, needs, other, tokens):
        super().__init__(needs)
        self.other, self.tokens = set(other), tokens

    def judge(self, trace, *, victim, arm, toggles):
        needs = self.needs
        if trace.sends[0].max_tokens == self.tokens:
            self.needs = self.other
        try:
            return super().judge(trace, victim=victim, arm=arm, toggles=toggles)
        finally:
            self.needs = needs


def test_a_bucket_without_key_evidence_is_measured_on_its_own_witness(tmp_path):
    """Fault P's bucket opened with no verdicts (its box ran out), and every later unexplained
    finding joined it unchecked (P + Q: one bucket). Now its own witness is replayed once; the
    new witness, of another cause, disagrees; the measured verdicts go back to the bucket."""
    old = unexplained()
    save(old, tmp_path / "buckets" / "P.json")
    bs = {"P": Bucket(id="P", key=key(), first_index=1, count=1, case="buckets/P.json")}
    new = unexplained()
    s0 = new.trace.sends[0]
    new.trace = new.trace.model_copy(update={"events": [s0.model_copy(update={"max_tokens": s0.max_tokens + 1}),
                                                        *new.trace.events[1:]]})
    r = ByTrace(needs=["prefix-caching", "lora"], other=["prefix-caching"], tokens=s0.max_tokens + 1)
    t = triage(r, bs, tmp_path)
    b, k, _ = t._match(new, key())
    assert b is None and k.verdicts["lora"] == "persists"
    assert set(t._evidence) == {"P"} and t._evidence["P"]["prefix-caching"] == "disappears"
    assert t._evidence["P"]["lora"] == "disappears"  # where the two causes differ
    # Carried on the finding's first membership, and added to the bucket's key by the campaign.
    out = t._done(checked_of(new), new, [member("N", k.verdicts)], "opened")
    assert out.buckets[0].evidence["P"]["lora"] == "disappears"
    c = campaign(tmp_path)
    c.state.bug_buckets["P"] = bs["P"].model_copy()
    c.record_finding(5, new.trace, "fresh", new, out.buckets)
    assert c.state.bug_buckets["P"].key.verdicts == t._evidence["P"]
    assert set(c.state.bug_buckets) == {"P", "N"} and not c.state.merges


def test_a_witness_of_the_same_cause_still_joins_after_its_bucket_is_measured(tmp_path):
    old = unexplained()
    save(old, tmp_path / "buckets" / "P.json")
    bs = {"P": Bucket(id="P", key=key(), first_index=1, count=1, case="buckets/P.json")}
    r = Table(needs=["prefix-caching"])
    b, k, _ = triage(r, bs, tmp_path)._match(unexplained(), key())
    assert b is not None and b.id == "P" and k.verdicts["prefix-caching"] == "disappears"


def test_against_a_deadline_the_key_mechanisms_are_ablated_first():
    """The box runs out in order: the mechanisms a key is made of go before the schedule ones
    (concurrency, cancels), which are only described."""
    from kvfuzz.traces.buckets import KEY_MECHANISMS
    from kvfuzz.triage.explain import ABLATIONS, explain

    f = unexplained()
    ablated = {m: a(f.trace)[0] for m, a in ABLATIONS.items()}
    ablated = {m: t.model_dump(mode="json") for m, t in ablated.items() if t is not None}

    class Order(Table):
        def __init__(self):
            super().__init__([])
            self.seen = []

        def judge(self, trace, *, victim, arm, toggles):
            d = trace.model_dump(mode="json")
            self.seen.append(next(m for m, t in ablated.items() if t == d))
            return "corruption"

    r = Order()
    import time as _t
    explain(r, f, deadline=_t.monotonic() + 3600)
    applicable = [m for m in KEY_MECHANISMS if m in ablated]
    assert applicable and set(r.seen[: len(applicable)]) == set(applicable)
    assert set(r.seen) - set(KEY_MECHANISMS)  # the schedule ablations still ran, after
    # Rule 5.21's box: the mechanisms its split hangs on go before every other.
    last = r.seen[len(applicable) - 1]  # the last key mechanism in the default order
    r2 = Order()
    explain(r2, f, deadline=_t.monotonic() + 3600, first=[last])
    assert r2.seen[0] == last and r2.seen[0] != r.seen[0]


def campaign(tmp_path):
    return Campaign(CampaignOptions(out=tmp_path, budget_s=None, max_traces=0))


def member(bid, v, status="opened"):
    return BucketMembership(bucket=bid, key=key(v), status=status)


def test_buckets_merge_when_their_evidence_comes_to_agree_and_findings_follow(tmp_path):
    c = campaign(tmp_path)
    f = unexplained()
    # Two witnesses of one cause: one knows prefix caching, the other KV pressure (box cut).
    c.record_finding(0, f.trace, "fresh", f.model_copy(deep=True), [member("A", {"prefix-caching": "disappears",
                                                                                 "lora": "persists"})])
    c.record_finding(1, f.trace, "fresh", f.model_copy(deep=True), [member("B", {"lora": "disappears"})])
    assert set(c.state.bug_buckets) == {"A", "B"} and not c.state.merges  # they conflict on lora
    # A third finding joins B with evidence that settles the conflict? No: B's lora verdict
    # stays; but a bucket without evidence agrees with A and is merged into it, findings and all.
    c.record_finding(2, f.trace, "fresh", f.model_copy(deep=True), [member("C", {}, status="assigned")])
    assert c.state.merges == {"C": "A"}
    a = c.state.bug_buckets["A"]
    assert a.count == 2 and a.merged_from == ["C"] and len(a.findings) == 2
    # A finding a worker filed under the merged bucket lands in the survivor.
    c.record_finding(3, f.trace, "fresh", f.model_copy(deep=True), [member("C", {}, status="assigned")])
    assert a.count == 3 and a.assigned == 2
    head, *lines = (json.loads(x) for x in (tmp_path / "buckets" / "A.findings.jsonl").read_text().splitlines())
    assert head["bucket"]["count"] == 3 and [x["finding"] for x in lines] == a.findings
    assert json.loads((tmp_path / "buckets" / "C.findings.jsonl").read_text().splitlines()[0])["merged_into"] == "A"
    # `kvfuzz gate OUT/buckets` reads every .json there as a regression case: listings are not .json.
    cases = {b.case for b in c.state.live_buckets() if b.case}
    assert {str(p.relative_to(tmp_path)) for p in (tmp_path / "buckets").rglob("*.json")} == cases
    # A bucket opened with its regression case and merged later: the case leaves OUT/buckets
    # (the gate would replay one cause twice) and is kept in OUT/merged-buckets.
    c.record_finding(4, f.trace, "fresh", f.model_copy(deep=True), [member("D", {})])
    assert c.state.merges["D"] == "A" and not (tmp_path / "buckets" / "D.json").exists()
    assert c.state.bug_buckets["D"].case == "merged-buckets/D.json" and (tmp_path / "merged-buckets" / "D.json").is_file()
    # Every finding file names its bucket, typed; none is without one.
    for rel in c.state.finding_files:
        g = load_finding(tmp_path / rel)
        assert g.buckets and g.bucket in c.state.bug_buckets and "buckets" not in g.notes
    # The state round-trips (what --resume reads).
    again = CampaignState(**json.loads(c.state.to_json()))
    assert again.bug_buckets == c.state.bug_buckets and again.merges == c.state.merges


def test_a_finding_without_memberships_still_gets_a_bucket(tmp_path):
    c = campaign(tmp_path)
    f = unexplained()
    f.buckets = []
    c.record_finding(0, f.trace, "fresh", f, [])
    c.record_finding(1, f.trace, "fresh", f.model_copy(deep=True), None)
    assert len(c.state.live_buckets()) == 1 and c.state.live_buckets()[0].count == 2 and not c.state.untriaged


def test_old_campaigns_and_findings_still_load(tmp_path):
    """campaign.json and finding files written before issue 30 (notes["buckets"], prekeys)."""
    state = json.loads((DATA / "campaign.json").read_text())
    assert state["bug_buckets"] and all("prekey" in b for b in state["bug_buckets"].values())
    s = CampaignState(**state)
    assert set(s.bug_buckets) == set(state["bug_buckets"])
    b = next(iter(s.bug_buckets.values()))
    assert isinstance(b, Bucket) and b.prekey and b.key.cls == b.prekey.split("|")[0] and b.text
    f = json.loads(json.dumps(finding().model_dump(mode="json", by_alias=True)))
    f["notes"]["buckets"] = [{"id": "abc", "prekey": "corruption|unexplained|concurrency", "first": True,
                              "key": {"class": "corruption", "needs": ["prefix-caching", "concurrency"],
                                      "not_needed": ["cancels"], "shape": {"requests": 2, "events": ["send"]},
                                      "text": "old text"}}]
    g = Finding.model_validate(f)
    assert "buckets" not in g.notes and g.buckets[0].bucket == "abc" and g.buckets[0].status == "opened"
    assert g.buckets[0].key.verdicts == {"prefix-caching": "disappears"} and g.buckets[0].description.text == "old text"
    # The resumed campaign: the old state in OUT, loaded as --resume does.
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(DATA / "campaign.json", out / "campaign.json")
    from kvfuzz.fuzzer.campaign import load_state

    opts = CampaignOptions(out=out, seed=state["seed"], resume=True, mode=state["mode"])
    try:
        loaded = load_state(out, opts)
    except Exception as e:  # a differing option is a one-line BadInput, never a traceback
        assert "cannot resume" in str(e)
    else:
        assert set(loaded.bug_buckets) == set(state["bug_buckets"])


def test_a_campaign_report_speaks_in_buckets(tmp_path):
    from kvfuzz.present.buckets import load_campaign, markdown, sections

    c = campaign(tmp_path)
    f = unexplained()
    for i in range(5):
        c.record_finding(i, f.trace, "fresh", f.model_copy(deep=True),
                         [member("A", {"prefix-caching": "disappears"}, "opened" if i == 0 else "assigned")])
    g = f.model_copy(deep=True)
    g.divergences[0].class_ = "numeric-near-tie"
    c.record_finding(5, f.trace, "fresh", g, [BucketMembership(bucket="N", key=key(cls="numeric-near-tie"),
                                                                status="opened")])
    (tmp_path / "campaign.json").write_text(c.state.to_json())
    rows, n = load_campaign(tmp_path)
    bugs, ties = sections(rows)
    assert [r.count for r in bugs] == [5] and [r.id for r in ties] == ["N"] and n == 6
    md = markdown(rows, n)
    assert md.count("| `A` |") == 1 and "Near-tie buckets" in md and "4 assigned" in md


def test_plugin_modules_install_in_order_and_fail_with_their_name(monkeypatch):
    import pytest

    from kvfuzz.harness.toggles import plugin

    assert plugin.plugin_modules("a.b:go, c.d") == [("a.b", "go"), ("c.d", "install")]
    with pytest.raises(RuntimeError, match="KVFUZZ_PLUGIN_MODULES: cannot install no_such_module_x:install"):
        plugin.install_plugin_modules("no_such_module_x")


def test_a_findings_report_names_its_bucket_and_how_it_got_there():
    from kvfuzz.present.buckets import finding_lines

    f = unexplained()
    f.buckets = [member("Q", {"prefix-caching": "disappears"}, "assigned")]
    (line,) = finding_lines(f)
    assert line.startswith("Bucket Q — corruption, unexplained") and "assigned, not triaged" in line
    # The check replays are shown with their outcome, also those that gave no verdict.
    f.buckets[0].checks = [MechanismCheck(mechanism="preemption", victim="B", outcome="moved", detail="A still corrupt")]
    (line,) = finding_lines(f)
    assert line.endswith("checks: without preemption: moved (A still corrupt).")


def test_a_removal_that_leaves_a_milder_divergence_is_not_evidence():
    """Corruption that chunked prefill off turns into a flipped near tie: the token still
    flips, and whether it is called a near tie depends on the witness's margin."""
    from kvfuzz.traces import Ablation, Explanation

    def ex(cls):
        return Explanation(victim="B", cls="corruption", arm="fault", ablations=[
            Ablation(mechanism="prefix-caching", change="x", outcome="disappears", victim_class="ok"),
            Ablation(mechanism="chunked-prefill", change="x", outcome="disappears" if cls != "corruption"
                     else "persists", victim_class=cls),
            Ablation(mechanism="numerics", change="x", outcome="disappears", victim_class="ok")])

    a, b = rule.verdicts_of(ex("numeric-near-tie")), rule.verdicts_of(ex("corruption"))
    assert a == {"prefix-caching": "disappears"} and b["chunked-prefill"] == "persists"
    assert agrees(key(a), key(b))
    assert rule.verdicts_of(ex("ok"))["chunked-prefill"] == "disappears"
    # 16-bit numerics is never keyed (fault R in bfloat16: float32 removed it on one witness only).
    assert "numerics" not in rule.verdicts_of(ex("ok"))


def test_a_second_cause_that_needs_more_than_the_bucket_disagrees_where_the_bucket_did_not_need(tmp_path):
    """Bucket S needs prefix caching and not KV pressure; a witness of P needs both. Replaying
    only what S needs would file P under S (two faults, one bucket: the first P+S run)."""
    bs = {"S": bucket("S", {"prefix-caching": "disappears", "lora": "persists"}, 1)}
    r = Table(needs=["prefix-caching", "lora"])
    b, k, _ = triage(r, bs, tmp_path)._match(unexplained(), key())
    assert b is None and k.verdicts == {"prefix-caching": "disappears", "lora": "disappears"} and r.replays == 2


def test_the_pre_key_knows_a_bucket_explained_by_a_fix_the_arm_left_off():
    """The CPU LoRA bug's bucket is explained by a fix that the vanilla arm leaves off; a
    finding of it past the budget (no attribution replay) must still find that bucket by its
    pre-key (issue 30: it opened a second, unexplained bucket)."""
    f = finding()
    arm = f.divergences[0].arm
    f.arms = {arm: []}  # vanilla: no toggle on
    lora = Bucket(id="L", key=key(explained_by="fix-lora-cpu-no-lora-tokens"), first_index=0, count=1)
    other = Bucket(id="O", key=key(explained_by="fault-elsewhere"), first_index=1, count=1)
    clean = ["fix-lora-cpu-no-lora-tokens", "fix-other"]
    assert [b.id for b in rule.prekey_candidates(f, [lora, other], clean)] == ["L"]
    f.arms = {arm: ["fault-elsewhere", *clean]}  # an arm that turns a fault on, every fix on
    assert [b.id for b in rule.prekey_candidates(f, [lora, other], clean)] == ["O"]


class Drifting(Table):
    """Fault W's witness on Ray: with KV pressure removed its victim's tokens all match the
    reference (the flip was at a 0.0047 margin), but its logprobs drift by 0.0039 against a
    bound of 1.1e-5. Only that removal is asked of it here."""

    def __init__(self, drift, bound=1.1e-5):
        super().__init__([])
        self.drift, self.bound = drift, bound

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        return Judged("ok", drift=self.drift, bound=self.bound)


def test_a_token_equal_victim_whose_logprobs_drifted_past_noise_still_persists():
    """Issue 30, fault W on Ray (63 + 1 buckets): an ablation that only moved the victim off its
    flip read as "needs KV pressure". A drift past the noise bound is wrong KV without a flip:
    the corruption persists, and the record says why. Within the bound it disappears."""
    from kvfuzz.triage.explain import explain

    f = unexplained()
    for drift, outcome in ((0.0039, "persists"), (1e-6, "disappears"), (None, "disappears")):
        ex = explain(Drifting(drift), f, mechanisms=["preemption"])
        (a,) = ex.ablations
        assert (a.outcome, a.victim_class) == (outcome, "ok"), (drift, a)
        assert ("drifted by 0.0039" in (a.detail or "")) == (outcome == "persists")
        assert rule.verdicts_of(ex) == {"preemption": outcome}


def test_drift_without_a_flip_is_no_evidence_for_a_near_tie():
    """Only corruption is kept alive by drift: a near tie's victim (noise by every measure) that
    stops flipping has disappeared, whatever its drift."""
    from kvfuzz.triage.explain import explain

    f = unexplained()
    f.divergences[0].class_ = "numeric-near-tie"
    (a,) = explain(Drifting(0.5), f, mechanisms=["preemption"]).ablations
    assert a.outcome == "disappears" and a.detail is None


def test_judged_drifted_only_for_a_token_equal_run_past_its_bound():
    assert Judged("ok", drift=0.2, bound=0.1).drifted
    assert not Judged("ok", drift=0.1, bound=0.1).drifted  # at the bound is noise
    assert not Judged("ok").drifted and not Judged("corruption", drift=0.2, bound=0.1).drifted


class Moving(Table):
    """Fault Y's 19-request finding on Ray: without prefix caching its victim reads exactly right
    KV, but another of its victims still corrupts (or, ``still=False``, is right too)."""

    def __init__(self, still):
        super().__init__([])
        self.still, self.asked = still, []

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        self.asked.append(tuple(others))
        return Judged("ok", drift=0.0, bound=1e-5, others=tuple((r, Judged("corruption" if self.still else "ok"))
                                                               for r in others))


def _two_victims(broke=None):
    f = unexplained()
    d = f.divergences[0]
    other = d.model_copy(update={"request_id": "A", "broke": broke})
    f.divergences = [d, other]
    return f, d.request_id


def test_a_removal_that_moves_the_cause_to_another_victim_is_no_evidence():
    """Issue 30, rule 5.6 (fault Y split 60 + 1 on Ray, "needs prefix caching"): a removal under
    which the victim is right while another victim of the same finding still corrupts changed
    which request the cause hit. It is "moved", and the key leaves it out, like a removal not
    tried; with every victim right it disappears."""
    from kvfuzz.triage.explain import explain

    f, victim = _two_victims()
    r = Moving(still=True)
    ex = explain(r, f, victim=victim, mechanisms=["prefix-caching"])
    (a,) = ex.ablations
    assert a.outcome == "moved" and "A still corrupt" in a.detail and r.asked == [("A",)]
    assert rule.verdicts_of(ex) == {} and ex.needs == [] and ex.not_needed == []
    (a,) = explain(Moving(still=False), f, victim=victim, mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "disappears"


def test_a_victim_of_another_post_condition_is_not_asked():
    """With two faults on at once, a victim that broke another post-condition is the other
    cause's: it must not hide what this one needs (faults Y + P)."""
    from kvfuzz.triage.explain import explain

    f, victim = _two_victims(broke="map-entry-orphaned")
    r = Moving(still=True)
    (a,) = explain(r, f, victim=victim, mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "disappears" and r.asked == [()]


class ByVictim(Table):
    """Two causes hit one finding: request A (Y's victim) needs nothing, B (P's victim, which
    broke ``map-entry-orphaned``) needs prefix caching."""

    def __init__(self):
        super().__init__([])
        self.victims = []

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        self.victims.append(victim)
        gone = not trace.engine.enable_prefix_caching and victim == "B"
        return Judged("ok" if gone else "corruption")


def test_a_named_key_is_measured_on_the_victim_that_broke_its_post_condition(tmp_path):
    """Issue 30, faults Y + P (one bucket at d2840d2): a finding hit by both was keyed by the
    name P broke on B, but its merge check replayed A (Y's victim, the default target), agreed
    with Y's bucket, and lent it P's name; the two buckets then merged by name. The key's
    replays now judge B."""
    f, _ = _two_victims()
    a, b = f.divergences
    a.request_id, a.broke = "A", None
    b.request_id, b.broke = "B", "map-entry-orphaned"
    assert rule.victim_of(f, key()) == "A"
    named = BucketKey(cls="corruption", broke="map-entry-orphaned")
    assert rule.victim_of(f, named) == "B"
    bs = {"Y": bucket("Y", {"prefix-caching": "persists"}, 1),
          # P's bucket opened on a witness that broke nothing (a bucket of that name is taken by
          # name, no replay: the test after the next).
          "P": Bucket(id="P", key=BucketKey(cls="corruption", verdicts={"prefix-caching": "disappears"}),
                      first_index=2, count=1)}
    r = ByVictim()
    got, k, _ = triage(r, bs, tmp_path)._match(f, named)
    assert got is not None and got.id == "P" and r.victims == ["B"] and k.verdicts["prefix-caching"] == "disappears"


class MovedBut(Table):
    """Removing ``persists_without`` leaves the victim corrupt; any other removal moves the
    cause to the finding's other victim (no verdict)."""

    def __init__(self, persists_without, others_broke="map-entry-orphaned"):
        super().__init__([])
        self.persists_without, self.others_broke = persists_without, others_broke

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        self.replays += 1
        if not trace.engine.enable_chunked_prefill and self.persists_without == "chunked-prefill":
            return Judged("corruption")
        return Judged("ok", drift=0.0, bound=1e-5,
                      others=tuple((r, Judged("corruption", broke=self.others_broke)) for r in others))


def test_a_name_is_lent_to_a_bucket_only_on_a_verdict_for_every_check(tmp_path):
    """Issue 30, rule 5.7 (faults Y + P on Ray, one bucket at the final rule 5.6): P's first
    named finding was checked on Y's three verdicts; chunked prefill agreed (persists), the two
    that tell P from Y gave no verdict, and the finding joined Y's bucket with P's name. Now a
    check without a verdict sends such a finding to triage, and every check replay is kept on
    the finding with its outcome and why (merge-check explanations were not kept)."""
    bs = {"Y": bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)}
    f, _ = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    t = triage(MovedBut("chunked-prefill"), bs, tmp_path)
    assert t._assign(checked_of(f)) is None
    assert [(c.mechanism, c.outcome) for c in t._checks] == [("chunked-prefill", "persists"), ("preemption", "moved")]
    assert "still corrupt" in (t._checks[1].detail or "") and t._checks[1].victim in ("A", "B")
    # Kept on the finding's membership wherever it is placed after.
    placed = t._done(checked_of(f), f, [BucketMembership(bucket="P", key=key({}), status="opened")], "opened")
    assert [c.outcome for c in placed.finding.buckets[0].checks] == ["persists", "moved"]
    # A finding of the bucket's own kind (nothing broken) is still assigned on its sampled check.
    t2 = triage(MovedBut("chunked-prefill"), bs, tmp_path)
    out = t2._assign(checked_of(unexplained()))
    assert out is not None and out.buckets[0].bucket == "Y" and [c.outcome for c in out.finding.buckets[0].checks] == ["persists"]


def test_a_name_whose_checks_cost_more_than_a_box_goes_to_the_box_unchecked(tmp_path):
    """Y + P at 3 minutes: P's first named finding, a 15 s trace, spent 30 s on its checks
    against Y's bucket before its 20 s box. Where the checks (one replay of the whole trace
    each) cost more than the box that triages it as a new cause, none is replayed: the box's
    merge check compares its minimized witness instead."""
    from kvfuzz.oracle import buckets as rule

    bs = {"Y": bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)}
    f, _ = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    r = MovedBut("chunked-prefill")
    t = triage(r, bs, tmp_path)
    t._run_seconds = t.new_bucket_box / 2  # three checks: 1.5 boxes
    assert t._assign(checked_of(f)) is None and r.replays == 0 and t._unchecked
    (k,) = [k for k in rule.keys_of(f) if k.broke == "map-entry-orphaned"]
    assert t._match(f, k, max_checks=0)[0] is None and r.replays == 0  # a new key: the box
    # Cheap checks are still made, on every verdict (rule 5.5).
    r2 = MovedBut("chunked-prefill")
    t2 = triage(r2, bs, tmp_path)
    t2._run_seconds = t2.new_bucket_box / 4
    assert t2._assign(checked_of(f)) is None and r2.replays == 2 and not t2._unchecked


class StateDependent(Table):
    """Fault AA's shape on a step-exact engine: the victim corrupted only in the finding's own
    first run, on state an earlier trace left; every replay after it is right, whatever is
    removed."""

    step_exact = True

    def __init__(self):
        super().__init__([])

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        self.replays += 1
        return Judged("ok")


def test_a_removal_is_no_evidence_when_the_witness_does_not_reproduce_with_nothing_removed():
    """Issue 30, rule 5.8 (fault AA, written after rule 5.7: a stale-state bug split 41 + 5 in
    both dtypes, the odd witness "needs KV pressure, cancels"): its victim diverged in 1 of 3
    runs, and every replay after the first one came out right. A "disappears" is flaky — no
    evidence — when the victim's own runs were not all divergent, or, after one run, when a
    control replay of the finding as is is right too; a "persists" stands."""
    from kvfuzz.triage.explain import explain

    f = unexplained()
    d = f.divergences[0]
    f.divergences = [d.model_copy(update={"runs": 3, "runs_diverged": 1})]
    ex = explain(StateDependent(), f, mechanisms=["prefix-caching", "chunked-prefill"])
    assert [a.outcome for a in ex.ablations] == ["flaky", "flaky"] and rule.verdicts_of(ex) == {}
    assert "1 of its 3 runs" in ex.ablations[0].detail
    # One run only (a check past the share): a control replay decides, and is counted.
    f.divergences = [d.model_copy(update={"runs": 1, "runs_diverged": 1})]
    ex = explain(StateDependent(), f, mechanisms=["prefix-caching"])
    assert [a.outcome for a in ex.ablations] == ["flaky"] and ex.replays == 2 and "nothing removed" in ex.ablations[0].detail
    # A reproducible witness keeps its verdicts: all runs diverged, or the control diverges.
    f.divergences = [d.model_copy(update={"runs": 3, "runs_diverged": 3})]
    t = Table(needs=["prefix-caching"])
    t.step_exact = True
    assert rule.verdicts_of(explain(t, f, mechanisms=["prefix-caching"])) == {"prefix-caching": "disappears"}
    f.divergences = [d.model_copy(update={"runs": 1, "runs_diverged": 1})]
    ex = explain(t, f, mechanisms=["prefix-caching", "chunked-prefill"])
    assert rule.verdicts_of(ex) == {"prefix-caching": "disappears", "chunked-prefill": "persists"} and ex.replays == 3


def test_the_merge_check_too_lends_a_name_only_on_a_verdict_for_every_check(tmp_path):
    """Rule 5.7 in ``_match`` (Y + P on Ray at fee862f, one bucket of 85): P's first named
    finding was triaged, not assigned; its merge check against Y's bucket got chunked prefill
    persists and "moved" on preemption and prefix caching, and it joined with P's name. It
    opens its own bucket now; a finding of Y's kind still joins."""
    bs = {"Y": bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)}
    f, _ = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    t = triage(MovedBut("chunked-prefill"), bs, tmp_path)
    (k,) = rule.keys_of(f)
    b, k2, _ = t._match(f, k)
    assert b is None and k2.verdicts == {"chunked-prefill": "persists"}
    assert [c.outcome for c in t._checks] == ["persists", "moved", "moved"]
    b, _, how = triage(Table(needs=[]), bs, tmp_path)._match(unexplained(), key())
    assert b is not None and b.id == "Y" and "prefix-caching persists" in how


def test_another_victim_still_corrupt_but_without_the_keys_post_condition_is_not_the_cause_moving(tmp_path):
    """Issue 30, Y + P on Ray at dc0082e (44 + 1 buckets, P's name on Y's): without prefix
    caching P's named victim was right, and P's other named victims were still corrupt — by Y,
    breaking nothing. "Moved" needs the other victim to break the key's post-condition again in
    that replay; here P's removal disappears, and its bucket is told from Y's by the verdicts."""
    from kvfuzz.triage.explain import explain

    f, victim = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    (a,) = explain(MovedBut("chunked-prefill", others_broke=None), f, victim=victim,
                   mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "disappears"
    (a,) = explain(MovedBut("chunked-prefill"), f, victim=victim, mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "moved"
    # And two buckets whose keys agree merge only when a name is earned (rule 5.7).
    y = bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)
    p = Bucket(id="P", key=BucketKey(cls="corruption", broke="map-entry-orphaned",
                                     verdicts={"chunked-prefill": "persists"}), first_index=2, count=1)
    assert rule.mergeable({"Y": y, "P": p}, {}) is None
    p2 = p.model_copy(update={"key": p.key.model_copy(update={"verdicts": dict(y.key.verdicts)})})
    assert rule.mergeable({"Y": y, "P": p2}, {}) == ("Y", "P")


def test_past_the_share_a_named_finding_goes_to_its_names_bucket_never_lends_it_to_an_earlier_one(tmp_path):
    """Y + P on Ray at 845bf8f (one bucket after a merge): a P finding past the share had two
    candidates, Y's unnamed bucket (earlier) and P's named one. The merge check looked only at
    the first for a name, its one check gave no verdict, and the fallback filed it under Y's
    bucket, which took P's name and then merged with P's. The bucket of its name takes it; with
    none and no verdict it is triaged."""
    y = bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)
    p = Bucket(id="P", key=BucketKey(cls="corruption", broke="map-entry-orphaned",
                                     verdicts={"chunked-prefill": "persists", "preemption": "disappears"}),
               first_index=2, count=1)
    f, _ = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    r = MovedBut("chunked-prefill")
    out = triage(r, {"Y": y, "P": p}, tmp_path)._assign(checked_of(f))
    assert out is not None and out.buckets[0].bucket == "P" and r.replays == 0
    # A second name with no bucket of its own: no verdict on the distinguishing check, triaged.
    f.divergences = [d.model_copy(update={"broke": "map-entry-stolen"}) for d in f.divergences]
    q = Bucket(id="Q", key=BucketKey(cls="corruption", verdicts={"preemption": "disappears"}), first_index=3, count=1)
    assert triage(MovedBut("chunked-prefill", others_broke="map-entry-stolen"), {"Y": y, "Q": q},
                  tmp_path)._assign(checked_of(f)) is None


def test_with_no_replay_left_a_named_finding_takes_its_names_bucket_or_its_own(tmp_path):
    """Y + P on Ray at 1ad31a0: the campaign's last P finding, past its budget (no replay),
    was filed by pre-key under the earliest candidate, Y's unnamed bucket, which took P's name
    and merged with P's bucket. It goes to the bucket of its name; with none, to its own."""
    y = bucket("Y", {"chunked-prefill": "persists", "preemption": "persists", "prefix-caching": "persists"}, 1)
    p = Bucket(id="P", key=BucketKey(cls="corruption", broke="map-entry-orphaned",
                                     verdicts={"preemption": "disappears"}), first_index=2, count=1)
    f, _ = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    out = triage(Table([]), {"Y": y, "P": p}, tmp_path)._assign(checked_of(f), replays=False)
    assert out is not None and [m.bucket for m in out.buckets] == ["P"]
    out = triage(Table([]), {"Y": y}, tmp_path)._assign(checked_of(f), replays=False)
    assert out is not None and out.buckets[0].bucket not in ("Y", "P") and out.buckets[0].key.broke == "map-entry-orphaned"


def test_the_kv_pressure_removal_gives_few_engine_configurations():
    """Its cache size is a power of two at least twice the trace's demand, so the replays of many
    traces share a few engines (the pool), not one start each."""
    from kvfuzz.fuzzer.shapes import embedded_bytes_per_token
    from kvfuzz.triage.explain import no_kv_pressure

    base = finding().trace
    base = base.model_copy(update={"engine": base.engine.model_copy(update={"kv_cache_bytes": 3 * 2**20})})
    sizes = set()
    for n in (400, 410, 570, 900, 1000, 1200):
        sends = [s.model_copy(update={"max_tokens": n}) if hasattr(s, "max_tokens") else s for s in base.events]
        t = base.model_copy(update={"events": sends})
        ablated, _ = no_kv_pressure(t)
        size = ablated.engine.kv_cache_bytes
        demand = sum(s.prompt.length + s.max_tokens for s in t.sends) * embedded_bytes_per_token(t.engine)
        assert size >= 2 * demand and size >= t.engine.kv_cache_bytes
        assert size & (size - 1) == 0
        sizes.add(size)
    assert len(sizes) <= 2


def test_a_second_pass_of_a_trace_reuses_its_first_pass_check_replays(tmp_path):
    """A Ray task deferred at the commit point runs again, settled: on a step-exact engine its
    first pass's check replays give the same verdicts, so none is replayed (Y + P on Ray: a
    deferred first pass spent 21.7 s on checks)."""
    bs = {"P": bucket("P", {"prefix-caching": "persists", "lora": "disappears"}, 1),
          "Q": bucket("Q", {"prefix-caching": "disappears"}, 2)}
    first = Table(needs=["prefix-caching"])
    t1 = triage(first, bs, tmp_path)
    b1, k1, how1 = t1._match(unexplained(), key())
    assert first.replays >= 1 and all(c.verdict for c in t1._checks)
    again = Table(needs=["prefix-caching"])
    again.step_exact = True
    t2 = triage(again, bs, tmp_path)
    t2.prior = list(t1._checks)
    b2, k2, how2 = t2._match(unexplained(), key())
    assert again.replays == 0 and (b2.id, k2.verdicts, how2) == (b1.id, k1.verdicts, how1)
    assert t2._checks == t1._checks  # still kept with the finding
    # Only on a step-exact engine (elsewhere a replay is a new sample), and only for its victim.
    wall = Table(needs=["prefix-caching"])
    t3 = triage(wall, bs, tmp_path)
    t3.prior = list(t1._checks)
    t3._match(unexplained(), key())
    assert wall.replays >= 1
    other = Table(needs=["prefix-caching"])
    other.step_exact = True
    t4 = triage(other, bs, tmp_path)
    t4.prior = [c.model_copy(update={"victim": "someone else"}) for c in t1._checks]
    t4._match(unexplained(), key())
    assert other.replays >= 1


def test_a_near_tie_its_float32_control_re_files_as_corruption_is_keyed_as_corruption(tmp_path, monkeypatch):
    """The keys of a new bucket are the finding's after its controls: a bfloat16 near tie whose
    float32 control reproduces it as corruption is corruption (``escalate``), and must not be
    filed under the near-tie key it had before, among the ties (faults AJ + AH on Ray in
    bfloat16 at a429c6d: one corruption finding was shown only in a near-tie bucket)."""
    import kvfuzz.triage.campaign as tc
    from kvfuzz.oracle.controls import FLOAT32
    from kvfuzz.traces.finding import ControlResult
    from kvfuzz.driver.settings import TriageSettings

    f = unexplained()
    f.divergences[0].class_ = "numeric-near-tie"
    f.verdicts = [v.model_copy(update={"class_": "numeric-near-tie"}) if v.request_id == f.divergences[0].request_id
                  else v for v in f.verdicts]
    victim = f.divergences[0].request_id
    f.controls = []

    def with_f32(_session, g, deadline=None):
        v = next(v for v in g.verdicts if v.request_id == victim).model_copy(update={"class_": "corruption",
                                                                                      "arm": FLOAT32})
        return g.model_copy(update={"controls": [ControlResult(name=FLOAT32, reproduced=False, verdicts=[v])]})

    monkeypatch.setattr(tc, "add_controls", with_f32)
    for escalated in (True, False):
        if not escalated:
            monkeypatch.setattr(tc, "add_controls", lambda _s, g, deadline=None: g)
        t = CampaignTriage(Table(needs=[]), None, {}, tmp_path, clean_arm=[],  # type: ignore[arg-type]
                           settings=TriageSettings(minimize=False, ablate=False, attribute=False))
        t.restore({"tie": bucket("tie", {}, 1, cls="numeric-near-tie")}, {})
        out = t._open(checked_of(f), f, [], rule.keys_of(f), 0.0, 10.0)
        classes = [m.key.cls for m in out.buckets]
        assert classes == (["corruption"] if escalated else ["numeric-near-tie"]), (escalated, out.buckets)
        if escalated:
            assert out.buckets[0].status == "opened" and out.buckets[0].bucket != "tie"
