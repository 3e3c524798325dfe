"""Buckets: the key, the policy that places a finding (``oracle.buckets.decide``), the budget
its interventions run under, and what a campaign writes. Pure logic, no engine: the replayers
below answer each ablation from a table, as a fault with known mechanisms would. Real campaigns
are in tests/test_buckets_engine.py."""

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_report import finding

from kvfuzz.driver.settings import TriageSettings
from kvfuzz.fuzzer.campaign import Campaign, CampaignOptions, CampaignState
from kvfuzz.oracle import buckets as rule
from kvfuzz.oracle.buckets import INTERVENTIONS, Facts, Join, Open, Run, decide
from kvfuzz.traces import Finding, load_finding
from kvfuzz.traces.buckets import KEY_MECHANISMS, Bucket, BucketKey, BucketMembership, related
from kvfuzz.traces.result import Judged
from kvfuzz.triage.executor import Budget, Executor

DATA = Path(__file__).parent / "data" / "present"
verdicts = st.dictionaries(st.sampled_from(KEY_MECHANISMS), st.sampled_from(["disappears", "persists"]))
names = st.sampled_from([None, "worker-row", "worker-seq-len", "held-block-unwritten"])


def key(v=None, cls="corruption", explained_by=None, broke=None, provisional=False):
    return BucketKey(cls=cls, explained_by=explained_by, verdicts=dict(v or {}), broke=broke, provisional=provisional)


# -- the key: equality --------------------------------------------------------------------------
@given(verdicts, verdicts, names, names, st.booleans(), st.booleans())
def test_keys_are_equal_exactly_when_their_parts_are(a, b, na, nb, pa, pb):
    """Equal when class, explanation, crash kind, break, what the witness needs and provisional
    are: "persists" and "not applicable" both say the cause does not need it."""
    ka, kb = key(a, broke=na, provisional=pa), key(b, broke=nb, provisional=pb)
    needs = lambda v: sorted(m for m, o in v.items() if o == "disappears")  # noqa: E731
    same = (na, pa, needs(a)) == (nb, pb, needs(b))
    assert (ka == kb) == same == (ka.digest() == kb.digest())
    assert (ka == kb) == (hash(ka) == hash(kb)) or ka != kb


def test_class_explanation_and_crash_kind_are_part_of_the_key():
    assert key() != key(cls="numeric-near-tie")
    assert key(explained_by="fault-x") != key() != key(explained_by="fault-y")
    assert BucketKey(cls="engine-crash", crash_kind="hang") != BucketKey(cls="engine-crash", crash_kind="died")


def test_related_buckets_differ_only_in_what_the_confirmation_measured():
    a = Bucket(id="a", key=key({"prefix-caching": "disappears"}), first_index=0)
    b = Bucket(id="b", key=key(provisional=True), first_index=1)
    c = Bucket(id="c", key=key({"preemption": "disappears"}), first_index=2)
    d = Bucket(id="d", key=key(broke="worker-row"), first_index=3)
    e = Bucket(id="e", key=key(explained_by="fault-x"), first_index=4)
    every = [a, b, c, d, e]
    assert [x.id for x in related(a, every)] == ["b", "c"]
    assert related(d, every) == [] and related(e, every) == []


# -- the key: what the recorded run says --------------------------------------------------------
def _victims(*specs):
    """A finding whose divergences are (request, class, explained_by, broke)."""
    f = finding()
    d0 = f.divergences[0]
    f.divergences = [d0.model_copy(update={"request_id": r, "class_": c, "explained_by": e, "broke": b})
                     for r, c, e, b in specs]
    return f


@pytest.mark.parametrize("specs, want", [
    # one explained victim, one unexplained: two keys
    ([("A", "corruption", "fault-x", None), ("B", "corruption", None, None)],
     [("fault-x", None), (None, None)]),
    # a victim that broke nothing beside one that broke a break harming others: that cause's
    ([("A", "corruption", None, "held-block-unwritten"), ("B", "corruption", None, None)],
     [(None, "held-block-unwritten")]),
    # ...but beside one that harms only its own request: another cause
    ([("A", "corruption", None, "worker-seq-len"), ("B", "corruption", None, None)],
     [(None, "worker-seq-len"), (None, None)]),
    # two breaks: two keys
    ([("A", "corruption", None, "worker-row"), ("B", "corruption", None, "worker-token")],
     [(None, "worker-row"), (None, "worker-token")]),
    # only the most severe class is keyed
    ([("A", "numeric-near-tie", None, None), ("B", "corruption", "fault-x", None)], [("fault-x", None)]),
])
def test_keys_of_a_finding(specs, want):
    keys = rule.keys_of(_victims(*specs))
    assert [(k.explained_by, k.broke) for k in keys] == want
    assert all(not k.verdicts and not k.provisional for k in keys)


def test_each_key_is_judged_on_its_own_victim():
    f = _victims(("A", "corruption", None, "worker-row"), ("B", "corruption", None, "worker-token"))
    row, token = rule.keys_of(f)
    assert (rule.victim_of(f, row), rule.victim_of(f, token)) == ("A", "B")


def test_an_engine_crash_is_keyed_by_its_kind_and_what_it_said():
    from kvfuzz.traces.provenance import CrashInfo

    f = _victims(("A", "engine-crash", None, None))
    f.crash = CrashInfo(kind="died", detail="engine step 22 raised RuntimeError: selected index k out of range")
    (k,) = rule.keys_of(f)
    assert (k.cls, k.crash_kind, k.crash_state, rule.victim_of(f, k)) == (
        "engine-crash", "died", "RuntimeError: selected index k out of range", None)
    # Numbers and addresses vary between witnesses of one cause; the message does not.
    f.crash = CrashInfo(kind="died", detail="engine step 7 raised RuntimeError: selected index k out of range")
    assert rule.keys_of(f) == [k]
    f.crash = CrashInfo(kind="died", detail="engine step 9 raised RuntimeError: max(): Expected reduction dim to "
                                            "be specified for input.numel() == 0.")
    (other,) = rule.keys_of(f)
    assert other != k and other.base[:3] == k.base[:3]
    assert rule.crash_state("engine step 3 raised IndexError: index 4096 is out of bounds at 0x7f3a") == \
        "IndexError: index N is out of bounds at 0x?"


# -- the policy ---------------------------------------------------------------------------------
NONE: frozenset[str] = frozenset()
UNNAMED = key()
CONFIRMED = key({"prefix-caching": "disappears", "lora": "persists"})
PROVISIONAL = key(provisional=True)
NAMED = key(broke="worker-row")
EXPLAINED = key(explained_by="fault-x")
TIE = key(cls="numeric-near-tie")
CRASH = BucketKey(cls="engine-crash", crash_kind="died")


def buckets(*keys):
    return {k.digest(): Bucket(id=k.digest(), key=k, first_index=i) for i, k in enumerate(keys)}


@pytest.mark.parametrize("facts, have, want", [
    # attribution first, while the budget lasts; without it, the recorded arms' guess, provisional
    (Facts(EXPLAINED, attributed=False), (), Run("attribute")),
    (Facts(EXPLAINED, attributed=False, allowed=NONE), (), Open(key(explained_by="fault-x", provisional=True))),
    # a 16-bit near tie's float32 control before its class counts
    (Facts(TIE, victim="A", class_settled=False), (), Run("float32-control", "A")),
    (Facts(TIE, class_settled=False, allowed=NONE), (TIE,), Join(TIE)),
    # an unexplained, unnamed key is confirmed once, on its victim...
    (Facts(UNNAMED, victim="B"), (), Run("confirm", "B")),
    # ...its measured key joins an equal bucket, or opens one with the confirmation's witness
    (Facts(CONFIRMED, confirmed=True, witness=True), (CONFIRMED,), Join(CONFIRMED)),
    (Facts(CONFIRMED, confirmed=True, witness=True), (PROVISIONAL,), Open(CONFIRMED)),
    # ...without a budget it is provisional: its own bucket, never a confirmed one
    (Facts(UNNAMED, allowed=NONE), (CONFIRMED,), Open(PROVISIONAL)),
    (Facts(UNNAMED, allowed=NONE), (CONFIRMED, PROVISIONAL), Join(PROVISIONAL)),
    # a named or explained key is complete from the record: no confirmation
    (Facts(NAMED, victim="A"), (NAMED,), Join(NAMED)),
    (Facts(NAMED, victim="A"), (), Run("minimize", "A")),
    (Facts(NAMED, victim="A", witness=True), (), Open(NAMED)),
    (Facts(EXPLAINED), (EXPLAINED,), Join(EXPLAINED)),
    # a near tie has no cause to confirm
    (Facts(TIE), (), Run("minimize")),
    # an engine crash is never replayed
    (Facts(CRASH, allowed=INTERVENTIONS), (), Open(CRASH)),
    (Facts(CRASH), (CRASH,), Join(CRASH)),
    # no budget left: a new key opens with the finding as its witness
    (Facts(NAMED, allowed=NONE), (), Open(NAMED)),
])
def test_decide(facts, have, want):
    assert decide(facts, buckets(*have)) == want


@given(st.sampled_from([UNNAMED, CONFIRMED, PROVISIONAL, NAMED, EXPLAINED, TIE, CRASH]),
       st.frozensets(st.sampled_from(sorted(INTERVENTIONS))), st.booleans(), st.booleans(), st.booleans())
def test_decide_asks_only_what_is_allowed_and_never_joins_an_unequal_key(k, allowed, attributed, confirmed, witness):
    have = buckets(CONFIRMED, NAMED, EXPLAINED)
    d = decide(Facts(k, attributed=attributed, confirmed=confirmed, witness=witness, allowed=allowed), have)
    if isinstance(d, Run):
        assert d.intervention in allowed
    elif isinstance(d, Join):
        assert have[d.key.digest()].key == d.key
    else:
        assert isinstance(d, Open) and d.key.digest() not in have


# -- the budget ----------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_budget_is_a_share_of_the_time_so_far_plus_a_floor_never_past_the_campaign():
    c = Clock()
    b = Budget(share=0.2, floor=20.0, clock=c)
    b.start()
    assert b.left() == 20.0
    c.now += 100
    assert b.left() == 40.0
    with b.charged():
        c.now += 30
    assert b.spent == 30 and b.left() == pytest.approx(20 + 0.2 * 130 - 30)
    b.end_after = 135
    assert b.left() == pytest.approx(5.0)  # the campaign ends in 5 s


def test_the_executor_allows_what_the_settings_switch_on_while_the_budget_lasts():
    c = Clock()
    b = Budget(share=0.0, floor=10.0, clock=c)
    b.start()
    ex = Executor(None, None, TriageSettings(minimize=False), b)  # type: ignore[arg-type]
    assert ex.allowed() == {"attribute", "float32-control"}
    assert Executor(None, None, TriageSettings(), b).allowed() == INTERVENTIONS  # type: ignore[arg-type]
    b.spent = 10.0
    assert ex.allowed() == frozenset()
    # One is not started when what is left is less than the longest of its last few.
    b.spent = 4.0
    ex.costs = {"attribute": [7.0, 4.0]}
    assert ex.allowed() == {"float32-control"}
    ex.costs = {"attribute": [7.0, *[4.0] * 5]}
    assert ex.allowed() == {"attribute", "float32-control"}


# -- what a campaign writes ----------------------------------------------------------------------
def campaign(tmp_path):
    return Campaign(CampaignOptions(out=tmp_path, budget_s=None, max_traces=0))


def member(k, status="opened"):
    return BucketMembership(bucket=k.digest(), key=k, status=status)


def test_a_bucket_opens_with_its_own_witness_as_its_case_and_findings_join_it(tmp_path):
    c = campaign(tmp_path)
    f = unexplained()
    witness = f.model_copy(deep=True)
    witness.trace = witness.trace.model_copy(update={"events": witness.trace.events[1:2]})
    c.record_finding(0, f.trace, "fresh", f.model_copy(deep=True), [member(CONFIRMED)],
                     {CONFIRMED.digest(): witness})
    c.record_finding(1, f.trace, "fresh", f.model_copy(deep=True), [member(CONFIRMED, "triaged")])
    c.record_finding(2, f.trace, "fresh", f.model_copy(deep=True), [member(PROVISIONAL, "assigned")])
    b = c.state.bug_buckets[CONFIRMED.digest()]
    assert b.count == 2 and b.assigned == 0 and len(b.findings) == 2
    assert load_finding(tmp_path / b.case).trace == witness.trace  # the case is the witness, not the finding
    p = c.state.bug_buckets[PROVISIONAL.digest()]
    assert p.count == 1 and p.assigned == 1 and load_finding(tmp_path / p.case).trace == f.trace
    head, *lines = (json.loads(x) for x in (tmp_path / "buckets" / f"{b.id}.findings.jsonl").read_text().splitlines())
    assert head["bucket"]["count"] == 2 and [x["finding"] for x in lines] == b.findings
    # `kvfuzz gate OUT/buckets` reads every .json there as a regression case: listings are not .json.
    cases = {x.case for x in c.state.live_buckets() if x.case}
    assert {str(q.relative_to(tmp_path)) for q in (tmp_path / "buckets").rglob("*.json")} == cases
    for rel in c.state.finding_files:
        g = load_finding(tmp_path / rel)
        assert g.buckets and g.bucket in c.state.bug_buckets
    again = CampaignState(**json.loads(c.state.to_json()))  # what --resume reads
    assert again.bug_buckets == c.state.bug_buckets


def test_a_finding_without_memberships_still_gets_a_bucket(tmp_path):
    c = campaign(tmp_path)
    f = unexplained()
    f.buckets = []
    c.record_finding(0, f.trace, "fresh", f, [])
    c.record_finding(1, f.trace, "fresh", f.model_copy(deep=True), None)
    assert len(c.state.live_buckets()) == 1 and c.state.live_buckets()[0].count == 2 and not c.state.untriaged


def test_a_campaign_report_speaks_in_buckets_and_shows_related_ones(tmp_path):
    from kvfuzz.present.buckets import load_campaign, markdown, sections

    c = campaign(tmp_path)
    f = unexplained()
    for i in range(5):
        c.record_finding(i, f.trace, "fresh", f.model_copy(deep=True), [member(CONFIRMED, "opened" if i == 0 else "triaged")])
    c.record_finding(5, f.trace, "fresh", f.model_copy(deep=True), [member(PROVISIONAL, "assigned")])
    g = f.model_copy(deep=True)
    g.divergences[0].class_ = "numeric-near-tie"
    c.record_finding(6, f.trace, "fresh", g, [member(TIE)])
    (tmp_path / "campaign.json").write_text(c.state.to_json())
    rows, n = load_campaign(tmp_path)
    bugs, ties = sections(rows)
    assert [r.count for r in bugs] == [5, 1] and [r.id for r in ties] == [TIE.digest()] and n == 7
    assert bugs[0].related == (PROVISIONAL.digest(),) and bugs[1].related == (CONFIRMED.digest(),)
    md = markdown(rows, n)
    assert md.count(f"| `{CONFIRMED.digest()}` |") == 1 and "Near-tie buckets" in md and "1 assigned" in md
    assert f"related: {PROVISIONAL.digest()}" in md and "provisional" in md


def test_a_findings_report_names_its_bucket_and_how_its_key_was_made():
    from kvfuzz.present.buckets import finding_lines

    f = unexplained()
    f.buckets = [BucketMembership(bucket="Q", key=CONFIRMED, status="triaged", how="minimal witness ablated",
                                  victim="B")]
    (line,) = finding_lines(f)
    assert line.startswith("Bucket Q — corruption, unexplained, needs prefix-caching")
    assert "key from: minimal witness ablated" in line and "victim B" in line


def test_memberships_and_keys_written_before_keys_were_exact_still_load():
    old = {"bucket": "x", "status": "triaged", "how": "replay", "evidence": {}, "checks": [], "unsettled": [],
           "key": {"class": "corruption", "verdicts": {"lora": "disappears"}, "enforced": {"worker-row": "persists"}}}
    m = BucketMembership.model_validate(old)
    assert m.key == key({"lora": "disappears"})
    b = Bucket.model_validate({"id": "x", "key": old["key"], "merged_from": ["y"], "unsettled": 2})
    assert b.key.needs == ["lora"]


class Table:
    """A replayer whose victim diverges unless a mechanism in ``needs`` is removed."""

    step_exact = False  # a witness that does not reproduce is tested apart

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


def unexplained():
    f = finding()
    f.divergences[0].explained_by = None
    f.trace = f.trace.model_copy(update={"engine": f.trace.engine.model_copy(update={"enable_prefix_caching": True})})
    return f


class Witnessing(Table):
    """``Table`` as a campaign's session: full checks too (victim B diverges in every run), or,
    with ``never``, a victim that never diverges again."""

    reference_runs = 0
    device = "cpu"
    settings = None

    def __init__(self, needs, never=False):
        super().__init__(needs)
        self.never = never

    def scoring(self, mode):
        return contextlib.nullcontext()

    def judge(self, trace, *, victim, arm, toggles):
        return "ok" if self.never else super().judge(trace, victim=victim, arm=arm, toggles=toggles)

    def check(self, trace, *, runs=None, arms=None):
        from kvfuzz.traces import Divergence, Environment
        from kvfuzz.traces.result import Checked, Recording

        (arm,) = arms
        runs = runs or 1
        cls = self.judge(trace, victim="B", arm=arm, toggles=())
        verdicts = [Divergence(request_id=s.request_id, class_=cls if s.request_id == "B" else "ok", arm=arm,
                               runs_diverged=runs if s.request_id == "B" and cls != "ok" else 0, runs=runs)
                    for s in trace.sends]
        env = Environment(kvfuzz_version="t")
        diverged = [v for v in verdicts if v.class_ != "ok"]
        f = Finding(trace=trace, environment=env, divergences=diverged, verdicts=verdicts, arms=dict(arms))
        rec = Recording(trace=trace, histories=[], references={}, environment=env, arms=dict(arms))
        return Checked(rec, verdicts, f if diverged else None)


def test_the_confirmation_and_a_new_buckets_witness_are_one_step():
    """Both minimize the finding to the key's victim, then ablate it. The confirmation ablates
    only the key's mechanisms and gives nothing when the victim's signature does not reproduce; a
    bucket's witness is ablated on every mechanism, and kept unminimized when it does not."""
    from kvfuzz.triage.executor import minimal
    from kvfuzz.triage.explain import ABLATIONS

    def executor(**kw):
        b = Budget(share=1.0, floor=600.0)
        b.start()
        session = Witnessing(["prefix-caching"], **kw)
        return Executor(session, None, TriageSettings(controls=False), b)  # type: ignore[arg-type]

    f = unexplained()
    f.attribution = None  # attribution re-runs arms: not this fake's
    ex = executor()
    small = ex.witness(f, "B", confirm=True)
    assert [s.request_id for s in small.trace.sends] == ["B"] and minimal(small)
    assert [a.mechanism for a in small.explanation.ablations] == list(KEY_MECHANISMS)
    assert rule.verdicts_of(small.explanation)["prefix-caching"] == "disappears"
    small = ex.witness(f, "B")
    assert [s.request_id for s in small.trace.sends] == ["B"]
    assert [a.mechanism for a in small.explanation.ablations] == list(ABLATIONS)
    assert set(ex.costs) == {"confirm", "minimize"}
    ex = executor(never=True)
    assert ex.witness(f, "B", confirm=True) is None
    kept = ex.witness(f, "B")
    assert kept.trace == f.trace and kept.minimization == f.minimization and kept is not f
    assert [a.mechanism for a in kept.explanation.ablations] == list(ABLATIONS)


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


def test_plugin_modules_install_in_order_and_fail_with_their_name(monkeypatch):
    import pytest

    from kvfuzz.harness.toggles import plugin

    assert plugin.plugin_modules("a.b:go, c.d") == [("a.b", "go"), ("c.d", "install")]
    with pytest.raises(RuntimeError, match="KVFUZZ_PLUGIN_MODULES: cannot install no_such_module_x:install"):
        plugin.install_plugin_modules("no_such_module_x")


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
    assert key(a) == key(b)  # what a minimal witness needs is all a key compares
    assert rule.verdicts_of(ex("ok"))["chunked-prefill"] == "disappears"
    # 16-bit numerics is never keyed: float32 can remove one witness's flip and not another's.
    assert "numerics" not in rule.verdicts_of(ex("ok"))


class Drifting(Table):
    """A witness whose victim's tokens all match the reference with KV pressure removed (the flip
    was at a small margin), but whose logprobs drift far past the noise bound. Only that removal
    is asked of it here."""

    def __init__(self, drift, bound=1.1e-5):
        super().__init__([])
        self.drift, self.bound = drift, bound

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        return Judged("ok", drift=self.drift, bound=self.bound)


def test_a_token_equal_victim_whose_logprobs_drifted_past_noise_still_persists():
    """An ablation that only moves the victim off its flip must not read as "needs" the
    mechanism. A drift past the noise bound is wrong KV without a flip: the corruption persists,
    and the record says why. Within the bound it disappears."""
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
    """A finding whose victim reads exactly right KV without prefix caching, while another of its
    victims still corrupts (or, ``still=False``, is right too)."""

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
    """A removal under which the victim is right while another victim of the same finding still
    corrupts changed which request the cause hit, not whether it acts (read as "needs", it would
    split one bug's findings). It is "moved", and the key leaves it out, like a removal not
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


class StateDependent(Table):
    """A step-exact engine whose victim corrupted only in the finding's own first run, on state an
    earlier trace left; every replay after it is right, whatever is removed."""

    step_exact = True

    def __init__(self):
        super().__init__([])

    def judge_victim(self, trace, *, victim, arm, toggles, others=(), settle=False):
        self.replays += 1
        return Judged("ok")


def test_a_removal_is_no_evidence_when_the_witness_does_not_reproduce_with_nothing_removed():
    """A stale-state bug: its victim diverged in 1 of 3 runs, and every replay after the first one
    comes out right, so any removal would seem to cure it. A "disappears" is flaky (no evidence)
    when the victim's own runs were not all divergent, or, after one run, when a control replay
    of the finding as is is right too; a "persists" stands."""
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


def test_another_victim_still_corrupt_but_without_the_keys_post_condition_is_not_the_cause_moving(tmp_path):
    """"Moved" needs the other victim to break the key's post-condition again in that replay: one
    still corrupt by another cause that breaks nothing leaves this removal "disappears"."""
    from kvfuzz.triage.explain import explain

    f, victim = _two_victims(broke="map-entry-orphaned")
    f.divergences[0].broke = "map-entry-orphaned"
    (a,) = explain(MovedBut("chunked-prefill", others_broke=None), f, victim=victim,
                   mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "disappears"
    (a,) = explain(MovedBut("chunked-prefill"), f, victim=victim, mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "moved"


def test_a_victim_of_another_post_condition_is_not_asked():
    """With two faults on at once, a victim that broke another post-condition is the other
    cause's: it must not hide what this one needs."""
    from kvfuzz.triage.explain import explain

    f, victim = _two_victims(broke="map-entry-orphaned")
    r = Moving(still=True)
    (a,) = explain(r, f, victim=victim, mechanisms=["prefix-caching"]).ablations
    assert a.outcome == "disappears" and r.asked == [()]


# A bucket as an older kvfuzz wrote it in campaign.json: keyed by text, no id.
OLD_BUCKET = {"prekey": "corruption|fix-lora-cpu-no-lora-tokens", "count": 4, "first_index": 1,
              "key": {"class": "corruption", "explained_by": "fix-lora-cpu-no-lora-tokens", "needs": [],
                      "not_needed": [], "shape": {"requests": 3, "events": ["send"]}, "text": "old text"},
              "findings": ["findings/corruption-9832c835ba05.json"], "case": "buckets/1e15bc5e78.json"}


def test_old_campaigns_and_findings_load_without_their_old_buckets(tmp_path, caplog):
    """campaign.json and finding files an older kvfuzz wrote with text keys load with those
    buckets dropped and one warning naming the file; everything else in them is kept."""
    state = json.loads((DATA / "campaign.json").read_text())
    state["bug_buckets"] = {"1e15bc5e78": OLD_BUCKET}
    out = tmp_path / "out"
    out.mkdir()
    (out / "campaign.json").write_text(json.dumps(state))
    from kvfuzz.fuzzer.campaign import load_state
    from kvfuzz.traces import EngineConfig

    opts = CampaignOptions(out=out, seed=state["seed"], resume=True, mode=state["mode"], runs=state["runs"],
                           engine=EngineConfig.model_validate(state["engine"]))
    loaded = load_state(out, opts)  # what --resume reads
    assert loaded.bug_buckets == {} and loaded.finding_files == state["finding_files"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(out / "campaign.json") in line and "older kvfuzz" in line and "\n" not in line
    assert CampaignState(**state).bug_buckets == {}
    # Today's buckets, with the text-key field a kvfuzz before this one still wrote (always null).
    today = json.loads((DATA / "campaign.json").read_text())
    for b in today["bug_buckets"].values():
        b["prekey"] = None
    assert set(CampaignState(**today).bug_buckets) == set(today["bug_buckets"])
    caplog.clear()
    f = load_finding(DATA / "bf16-near-tie.json")  # its memberships in notes["buckets"]
    assert f.buckets == [] and "buckets" in f.notes
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(DATA / "bf16-near-tie.json") in line and "older kvfuzz" in line


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
