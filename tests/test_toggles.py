"""Toggles on the real vLLM CPU engine (in-process): every toggle is inert when off; every
output-changing toggle has a trace whose outputs change when it is on; GPU-only toggles are
shown to be applied where they should be. Plus the registry's self-checks and the plugin."""

from __future__ import annotations

import dataclasses

import pytest

from kvfuzz.harness import toggles as reg
from kvfuzz.harness.toggles.builtin import (
    CANCEL_FREES_SHARED,
    CPU_KERNELS_UNBOUND,
    CROSS_GROUP_ONE_PHASE,
    EARLY_HIT,
    EMPTY_TOPK,
    EXPAND_FILLS,
    EXPAND_UNWRITTEN,
    LORA_BATCH_IDS,
    LORA_CPU_MASK,
    LORA_IDENTITY,
    LORA_NS,
    MASKED_ROW_RECOVERED,
    MIN_TOKENS_ROWS,
    PENALTY_IDS,
    PREEMPT_STALE,
    ROW_STATE,
    SAME_STEP_GUARD,
    STALE_TAIL,
    ZERO_RECYCLED,
)
from kvfuzz.traces import At, CancelEvent, EngineConfig, GenPrompt, SendEvent, Trace

ALL = [CANCEL_FREES_SHARED, CPU_KERNELS_UNBOUND, CROSS_GROUP_ONE_PHASE, EARLY_HIT, EMPTY_TOPK, EXPAND_FILLS,
       EXPAND_UNWRITTEN, LORA_BATCH_IDS, LORA_CPU_MASK, LORA_IDENTITY, LORA_NS, MASKED_ROW_RECOVERED, MIN_TOKENS_ROWS,
       PENALTY_IDS, PREEMPT_STALE, ROW_STATE, SAME_STEP_GUARD, STALE_TAIL, ZERO_RECYCLED]


def send(rid, step, length, *, group=None, plen=0, seed=0, mt=16, adapter=None):
    return SendEvent(request_id=rid, at=At(step=step), max_tokens=mt, adapter=adapter,
                     prompt=GenPrompt(length=length, prefix_group=group, prefix_len=plen, seed=seed))


# -- registry (no engine) ----------------------------------------------------------------------


@pytest.mark.engine  # reads or patches the installed vLLM
def test_registry_has_every_named_toggle_with_metadata():
    assert set(ALL) <= set(reg.names())
    for t, problem in reg.status():
        assert problem is None, f"{t.name} refuses on the installed vLLM: {problem}"
        assert t.kind in ("fix", "fault") and t.models and t.target and t.versions and t.description
        assert t.process in ("engine-core", "worker", "api-server")
        assert set(t.backends) <= {"cpu", "cuda"} and t.backends
    kinds = reg.kinds()
    assert [n for n in ALL if kinds[n] == "fix"] == [EMPTY_TOPK, EXPAND_FILLS, LORA_BATCH_IDS, LORA_CPU_MASK,
                                                     LORA_IDENTITY, MASKED_ROW_RECOVERED, MIN_TOKENS_ROWS, PENALTY_IDS,
                                                     SAME_STEP_GUARD, ZERO_RECYCLED]
    # What changes outputs on CPU, and the clean arm there.
    assert reg.output_changing("cpu") == sorted([CANCEL_FREES_SHARED, CPU_KERNELS_UNBOUND, CROSS_GROUP_ONE_PHASE,
                                                 EARLY_HIT, EMPTY_TOPK, EXPAND_FILLS, EXPAND_UNWRITTEN, LORA_BATCH_IDS,
                                                 LORA_CPU_MASK,
                                                 LORA_IDENTITY, LORA_NS, MASKED_ROW_RECOVERED, MIN_TOKENS_ROWS,
                                                 PENALTY_IDS, PREEMPT_STALE, ROW_STATE])
    assert reg.clean_set("cpu") == sorted([EMPTY_TOPK, EXPAND_FILLS, LORA_BATCH_IDS, LORA_CPU_MASK, LORA_IDENTITY,
                                           MASKED_ROW_RECOVERED, MIN_TOKENS_ROWS, PENALTY_IDS])
    assert set(reg.clean_set("cuda")) == {EMPTY_TOPK, LORA_BATCH_IDS, LORA_IDENTITY, MIN_TOKENS_ROWS, PENALTY_IDS,
                                          SAME_STEP_GUARD, ZERO_RECYCLED}


def _copy(name: str) -> str:
    """Register an uninstalled copy of a toggle (same self-check) under a test name."""
    copy = dataclasses.replace(reg.get(name), name=f"test-copy-{name}", installed=False)
    reg.REGISTRY[copy.name] = copy
    return copy.name


@pytest.fixture
def copies():
    made = []
    yield lambda n: made.append(_copy(n)) or made[-1]
    for n in made:
        reg.REGISTRY.pop(n, None)


@pytest.mark.engine  # reads or patches the installed vLLM
def test_self_check_refuses_changed_signature(monkeypatch, copies):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    name = copies(CANCEL_FREES_SHARED)
    monkeypatch.setattr(KVCacheManager, "free", lambda self, request_id, finished: None)
    with pytest.raises(reg.ToggleError) as e:
        reg.install([name])
    msg = str(e.value)
    assert e.value.code == 2 and name in msg and "KVCacheManager.free" in msg and "signature" in msg
    assert not reg.get(name).installed


@pytest.mark.engine  # reads or patches the installed vLLM
def test_self_check_refuses_changed_source(monkeypatch, copies):
    from vllm.v1.worker.block_table import BlockTable

    name = copies(STALE_TAIL)

    def clear_row(self, row_idx):  # same signature, body no longer what the patch reverts
        self.num_blocks_per_row[row_idx] = -1

    monkeypatch.setattr(BlockTable, "clear_row", clear_row)
    with pytest.raises(reg.ToggleError, match="BlockTable.clear_row no longer contains"):
        reg.install([name])
    # The listing reports the same problem instead of raising.
    assert dict((t.name, p) for t, p in reg.status())[name]


def test_unknown_toggle_is_bad_input():
    from kvfuzz.traces.errors import BadInput

    with pytest.raises(BadInput, match="unknown toggle 'nope'"):
        reg.install(["nope"])


@pytest.mark.engine  # reads or patches the installed vLLM
def test_plugin_is_inert_without_env_and_applies_named_toggles(monkeypatch):
    from kvfuzz.harness.toggles import plugin

    monkeypatch.delenv(reg.ENV_VAR, raising=False)
    before = reg.active()
    plugin.register()
    assert reg.active() == before
    monkeypatch.setenv(reg.ENV_VAR, f"{LORA_NS}, {SAME_STEP_GUARD}")
    try:
        plugin.register()
        assert reg.active() == {LORA_NS, SAME_STEP_GUARD}
        assert reg.get(LORA_NS).installed and reg.get(SAME_STEP_GUARD).installed
    finally:
        reg.registry.set_active([])


@pytest.mark.engine  # reads or patches the installed vLLM
def test_activate_is_scoped_and_resets_fault_state():
    from kvfuzz.harness.toggles import cancel

    cancel._lost[(1, "x", 2)] = 1
    with reg.activate([CANCEL_FREES_SHARED]):
        assert reg.is_active(CANCEL_FREES_SHARED) and not cancel._lost
        cancel._lost[(1, "y", 3)] = 1
    assert not reg.is_active(CANCEL_FREES_SHARED) and not cancel._lost


# -- on the real engine ------------------------------------------------------------------------

def _verdicts(checked):
    return {(d.arm, d.request_id): d.class_ for d in checked.verdicts}


def _cancel_trace(cfg):
    # A and B share 8 full blocks; A is cancelled while B still decodes; C then allocates.
    return Trace(engine=cfg, events=[
        send("A", 0, 300, group="p", plen=256, seed=1, mt=32),
        send("B", 2, 290, group="p", plen=256, seed=2, mt=24),
        CancelEvent(request_id="A", at=At(step=4)),
        send("C", 6, 200, seed=3, mt=8),
    ])


def _early_hit_trace(cfg):
    # A's 3000-token prompt is chunked (2048-token budget) and A is cancelled after its first
    # chunk; B shares 2950 tokens with it and arrives later.
    return Trace(engine=cfg, events=[
        send("A", 0, 3000, group="q", plen=3000, seed=1, mt=8),
        CancelEvent(request_id="A", at=At(after_tokens=0)),
        send("B", 3, 3100, group="q", plen=2950, seed=2, mt=16),
    ])


def _alias_trace(cfg):
    return Trace(engine=cfg, events=[
        send("A", 0, 140, group="shared", plen=128, seed=1, mt=4, adapter="a"),
        send("B", 12, 150, group="shared", plen=128, seed=2, mt=8, adapter="b"),
    ])


def _mixed_lora_trace(cfg):
    # Both adapter slots filled: the base request gets the last one's adapter (index -1).
    return Trace(engine=cfg, events=[send("la", 0, 40, seed=1, mt=8, adapter="a"),
                                     send("lb", 0, 40, seed=3, mt=8, adapter="b"), send("base", 0, 40, seed=2, mt=8)])


OUTPUT_CHANGING = [
    # toggle, trace, victim, arm where the victim is correct, arm where it diverges
    pytest.param(CANCEL_FREES_SHARED, _cancel_trace, "B", [LORA_CPU_MASK], [LORA_CPU_MASK, CANCEL_FREES_SHARED],
                 id="cancel-frees-shared"),
    pytest.param(EARLY_HIT, _early_hit_trace, "B", [LORA_CPU_MASK], [LORA_CPU_MASK, EARLY_HIT], id="prefix-hit-before-write"),
    pytest.param(LORA_NS, _alias_trace, "B", [LORA_CPU_MASK], [LORA_CPU_MASK, LORA_NS], id="lora-namespace"),
    # A fix: unmodified vLLM (fix off) is the arm that diverges.
    pytest.param(LORA_CPU_MASK, _mixed_lora_trace, "base", [LORA_CPU_MASK], [], id="lora-cpu-fix"),
]


@pytest.mark.engine
@pytest.mark.parametrize("toggle,make,victim,good,bad", OUTPUT_CHANGING)
def test_output_changing_toggle(session, lora_engine_config, toggle, make, victim, good, bad):
    t = make(lora_engine_config)
    c = session.check(t, runs=1, arms={"good": good, "bad": bad})
    v = _verdicts(c)
    assert all(cls in ("ok", "truncation") for (arm, _), cls in v.items() if arm == "good"), v
    assert v[("bad", victim)] == "corruption", v
    others = {r: cls for (arm, r), cls in v.items() if arm == "bad" and r != victim}
    assert all(cls in ("ok", "truncation") for cls in others.values()), others


@pytest.mark.engine
def test_lora_slots_do_not_leak_between_runs(session, lora_engine_config):
    """The clean slate zeroes adapter slots: with only adapter a loaded, the CPU LoRA bug's
    'last slot' is empty whatever an earlier run loaded there, so vanilla is correct here."""
    from kvfuzz.traces.history import step_view

    only_a = Trace(engine=lora_engine_config, events=[send("la", 0, 40, seed=1, mt=8, adapter="a"),
                                                       send("base", 0, 40, seed=2, mt=8)])
    eng = session.engine_for(lora_engine_config)
    first = eng.replay(only_a, toggles=[])
    eng.replay(_mixed_lora_trace(lora_engine_config), toggles=[])  # loads a and b
    again = eng.replay(only_a, toggles=[])
    assert step_view(first) == step_view(again)
    assert session.check(only_a, runs=1, arms={"vanilla": []}).finding is None


@pytest.mark.engine
def test_installed_toggles_are_inert_when_off(session, lora_engine_config):
    """Installing every patch and activating none changes nothing: same schedule, same tokens."""
    from kvfuzz.fuzzer import GenOptions, generate
    from kvfuzz.traces.history import step_view

    t = generate(5, lora_engine_config, GenOptions(adapters=["a", "b"], p_cancel=0.5, p_long=0.0))
    eng = session.engine_for(t.engine)
    before = eng.replay(t, toggles=[LORA_CPU_MASK])
    reg.install(ALL)
    after = eng.replay(t, toggles=[LORA_CPU_MASK])
    assert step_view(before) == step_view(after)
    # And each trigger trace is clean with everything installed but off.
    for make in (_cancel_trace, _early_hit_trace, _alias_trace):
        c = session.check(make(lora_engine_config), runs=1, arms={"off": [LORA_CPU_MASK]})
        assert c.finding is None, [d for d in c.verdicts if d.class_ not in ("ok", "truncation")]


@pytest.mark.engine
def test_same_step_guard_defers_the_hit_without_changing_outputs(session, lora_engine_config):
    # B shares A's 4 full blocks and is sent in the same step: without the guard it hits the
    # blocks A registers in that step; with it, it is scheduled one step later.
    t = Trace(engine=lora_engine_config, events=[send("A", 0, 150, group="g", plen=128, seed=1, mt=6),
                                                  send("B", 0, 140, group="g", plen=128, seed=2, mt=6)])
    c = session.check(t, runs=1, arms={"off": [LORA_CPU_MASK], "on": [LORA_CPU_MASK, SAME_STEP_GUARD]})
    assert all(cls == "ok" for cls in _verdicts(c).values())
    first = {h.arm: min(s.step for s in h.steps if "B" in s.scheduled) for h in c.recording.histories}
    hit = {h.arm: h.requests["B"].num_cached_tokens for h in c.recording.histories}
    assert first == {"off": 0, "on": 1}
    assert hit == {"off": 128, "on": 128}


def _worker(engine, fn):
    return engine._llm.collective_rpc(fn)[0]


@pytest.mark.engine
def test_stale_tail_fault_leaves_block_ids_in_rows(session, lora_engine_config):
    # Requests of different lengths leave the batch at different times (rows cleared, moved).
    t = Trace(engine=lora_engine_config, events=[
        send("long", 0, 900, seed=1, mt=12), send("mid", 0, 300, seed=2, mt=4),
        send("short", 1, 40, seed=3, mt=2), send("late", 6, 100, seed=4, mt=3),
    ])
    eng = session.engine_for(t.engine)

    def stale_ids(worker):
        bt = worker.model_runner.input_batch.block_table.block_tables[0]
        import numpy as np

        n = bt.num_blocks_per_row
        cols = np.arange(bt.block_table.np.shape[1])[None, :]
        return int(np.count_nonzero(bt.block_table.np * (cols >= n[:, None])))

    arms = {"off": [LORA_CPU_MASK], "on": [LORA_CPU_MASK, STALE_TAIL]}
    # GPU-only in effect: the CPU kernel never reads past a row's end, outputs stay correct.
    assert session.check(t, runs=1, arms=arms).finding is None
    stale = {}
    for arm, toggles in arms.items():
        eng.replay(t, toggles=toggles)  # inspect this run's table (no reference run after it)
        stale[arm] = _worker(eng, stale_ids)
    assert stale["off"] == 0
    assert stale["on"] > 0, "the fault did not leave stale block ids past the rows' logical ends"


@pytest.mark.engine
def test_zero_recycled_blocks_fix_zeroes_reused_block_tails(session, lora_engine_config):
    # A writes 103 token slots (blocks 1-4, block 4 holding 7). When it ends, its unhashed
    # partial block 4 is reused first (LIFO) by B, whose 5 tokens fill only its first slots:
    # without the fix block 4 still holds A's KV after B's; with it, the tail is zero.
    t = Trace(engine=lora_engine_config, events=[send("A", 0, 100, seed=1, mt=4), send("B", 8, 5, seed=2, mt=1)])
    eng = session.engine_for(t.engine)
    zeroed: list[int] = []

    def spy(worker):
        runner = worker.model_runner
        original = type(runner)._zero_block_ids
        if not hasattr(runner, "_kvfuzz_spy"):
            def zero(ids, _orig=original, _r=runner):
                zeroed.extend(ids)
                return _orig(_r, ids)

            runner._zero_block_ids = zero
            runner._kvfuzz_spy = True
        return True

    def nonzero_in_block(worker, block=4):
        return int(sum(int(kv[block].count_nonzero()) for kv in worker.model_runner.kv_caches))

    def unspy(worker):
        worker.model_runner.__dict__.pop("_zero_block_ids", None)
        worker.model_runner.__dict__.pop("_kvfuzz_spy", None)
        return True

    arms = {"off": [LORA_CPU_MASK], "on": [LORA_CPU_MASK, ZERO_RECYCLED]}
    c = session.check(t, runs=1, arms=arms)
    assert c.finding is None  # GPU-only in effect: outputs identical
    _worker(eng, spy)
    counts = {}
    try:
        for arm, toggles in arms.items():
            zeroed.clear()
            eng.replay(t, toggles=toggles)  # (no reference run afterwards: the KV is this run's)
            counts[arm] = (_worker(eng, nonzero_in_block), sorted(set(zeroed)))
    finally:
        _worker(eng, unspy)
    (off_nz, off_zeroed), (on_nz, on_zeroed) = counts["off"], counts["on"]
    assert off_zeroed == [] and 4 in on_zeroed
    per_token = on_nz // 5
    assert on_nz == 5 * per_token > 0  # B's 5 slots
    assert off_nz == 7 * per_token  # B's 5 plus A's 2 stale ones


@pytest.mark.engine
def test_bench_finds_a_fault_and_reports_the_control(session, lora_engine_config, tmp_path):
    """The detection benchmark end to end, in process. A 2048-token context keeps its traces
    short (the default 16384 lets 6000-token prompts in: 100 s of CI instead of 7)."""
    import json

    from kvfuzz.bench.bench import run_bench
    from kvfuzz.cli.commands.bench import markdown

    # The trace cap bounds the test; the time budget is generous because the machine may be loaded.
    report = run_bench(toggles=[LORA_NS, STALE_TAIL], seeds=[0], budget=3600, max_traces=8, control_budget=0.1,
                       runs=1, out=tmp_path, device="cpu", lora="auto", kv_cache_mb=24, max_model_len=2048,
                       progress=lambda m: None, session=session)
    json.dumps(report)  # the report is plain JSON data
    (r,) = report["toggles"]
    assert r["found"] == "1/1", report
    assert r["name"] == LORA_NS and r["arm"] == f"with:{LORA_NS}" and r["profile"] == "lora"
    assert r["found"] == "1/1" and 1 <= r["median_traces"] <= 8
    seed = r["seeds"][0]
    assert seed["detected"] and seed["victims"] and (tmp_path / seed["finding"]).exists()
    assert report["skipped"] == [{"name": STALE_TAIL, "reason": "cannot change outputs on cpu (changes them on: cuda)"}]
    c = report["control"]
    assert c["arm"] == "clean" and c["traces"] >= 1 and c["corruption"] == 0, c
    md = markdown(report)
    assert f"`{LORA_NS}`" in md and "clean control" in md


# Preemption needs a small KV cache: its own engine configuration (one restart), run last.
# Admission without the full-prompt reservation (vLLM's scheduler_reserve_full_isl=False)
# lets more requests in, so random traces reach preemption too.
SMALL = EngineConfig(kv_cache_bytes=3 * 2**20, max_model_len=3000, extra_args={"scheduler_reserve_full_isl": False})


@pytest.mark.engine
def test_preempt_resume_stale_blocks_fault(session):
    # X and Y outgrow the 95-block cache; Y (admitted last) is preempted and X's growth takes
    # Y's freed blocks before Y resumes.
    t = Trace(engine=SMALL, events=[send("X", 0, 1000, seed=1, mt=160), send("Y", 1, 1900, seed=2, mt=100)])
    c = session.check(t, runs=1, arms={"off": [], "on": [PREEMPT_STALE]})
    v = _verdicts(c)
    assert all(h.requests["Y"].num_preemptions >= 1 for h in c.recording.histories)  # in both arms
    assert v[("off", "X")] == v[("off", "Y")] == "ok", v
    assert v[("on", "Y")] == "corruption" and v[("on", "X")] == "ok", v


@pytest.mark.engine
def test_allocator_faults_keep_the_allocator_books_balanced(session):
    """The faults corrupt KV, not the allocator's bookkeeping: with all three on, random traces
    full of cancels, shared prefixes and preemption neither crash vLLM nor leak a block."""
    from kvfuzz.fuzzer import GenOptions, generate

    faults = [CANCEL_FREES_SHARED, PREEMPT_STALE, EARLY_HIT]
    preempted = 0
    for seed in range(4):
        # Plain requests (no early EOS finishes): the pressure these faults need.
        t = generate(100 + seed, SMALL, GenOptions(min_requests=8, p_cancel=0.5, p_prefix=0.9, p_long=0.0, max_tokens=(48, 128),
                                                   gaps=(0, 0, 1), request_state=0.0, p_priority=0.0, p_embeds=0.0, p_spec=0.0, p_reset=0.0))
        eng = session.engine_for(t.engine)  # the scheduling policy is drawn per trace
        pool = eng._core().scheduler.kv_cache_manager.block_pool
        h = eng.replay(t, toggles=faults)
        assert not h.crashed, h.crash_detail
        preempted += sum(len(s.preempted) for s in h.steps)
        leaked = [(b.block_id, b.ref_cnt) for b in pool.blocks if b.ref_cnt and not b.is_null]
        assert not leaked and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, leaked
    assert preempted > 0, "no preemption: the test no longer exercises the preemption fault"
