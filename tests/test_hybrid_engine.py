"""The hybrid model, the kvfuzz store connector and the #44409 regression on the real vLLM CPU
engine. Every test but the bfloat16 one shares one engine: the regression trace's own
configuration (embedded:tiny-hybrid, kvfuzz-store connector, 127 blocks)."""

from pathlib import Path

import pytest

from kvfuzz.harness import toggles
from kvfuzz.harness.toggles.builtin import CROSS_GROUP_ONE_PHASE
from kvfuzz.traces import At, SendEvent, TokenPrompt, Trace, expand, load_trace
from kvfuzz.traces.history import step_view
from kvfuzz.traces.trace import GenPrompt

pytestmark = pytest.mark.engine

REGRESSION = Path(__file__).resolve().parent.parent / "traces" / "regressions" / "vllm-44409-cross-group-external.json"
WINDOW = 128


@pytest.fixture(scope="module")
def trace():
    return load_trace(REGRESSION)


def _clean():
    return toggles.clean_set("cpu")


def test_engine_has_two_kv_cache_groups_with_the_connector_on(session, trace):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvfuzz.harness.kv_connector import HMAStoreConnector

    engine = session.engine_for(trace.engine)
    scheduler = engine._core().scheduler
    groups = scheduler.kv_cache_config.kv_cache_groups
    # From the running engine, not the config: a connector without SupportsHMA would have
    # made vLLM turn the hybrid manager off and leave one group.
    assert len(groups) >= 2
    assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, SlidingWindowSpec]
    assert groups[1].kv_cache_spec.sliding_window == WINDOW
    assert isinstance(scheduler.connector, HMAStoreConnector)
    assert scheduler.kv_cache_config.num_blocks == 127


def test_outputs_depend_on_tokens_outside_the_window(session, trace):
    # Four prompts identical in their last W+40 tokens, different before: the full-attention
    # layer must carry the difference (a window-only model would answer alike).
    shared = expand(GenPrompt(length=WINDOW + 40, prefix_group="tail", prefix_len=WINDOW + 40))
    sends = [SendEvent(request_id=f"p{i}", at=At(step=0), max_tokens=8,
                       prompt=TokenPrompt(token_ids=expand(GenPrompt(length=60, seed=i)) + shared))
             for i in range(4)]
    h = session.engine_for(trace.engine).replay(Trace(engine=trace.engine, events=sends), toggles=[])
    outs = {tuple(h.requests[s.request_id].token_ids) for s in sends}
    assert len(outs) >= 3, outs


def test_clean_runs_with_the_connector_equal_the_references(session, trace):
    c = session.check(trace, runs=2, arms={"clean": _clean()})
    assert c.finding is None, [v for v in c.verdicts if v.class_ != "ok"]
    assert all(v.class_ == "ok" for v in c.verdicts)
    h1, h2 = c.histories
    # No post-condition breaks on unmodified vLLM: the sliding-window group's rows hold the null
    # block where the window left (every clean hybrid campaign broke worker-row before).
    assert [b for h in c.histories for b in h.breaks] == []
    # External KV really served (R: 64 tokens behind its 128-token local hit) ...
    assert sum(s.external_tokens for s in h1.steps) >= 64
    assert any(len(s.group_hits) == 2 and all(s.group_hits) for s in h1.steps)
    assert not any(s.cross_group_shared for s in h1.steps)
    # ... and the store is emptied between runs: run 2 is step for step run 1 (with run 1's
    # store left over, B would start with external hits).
    assert {**step_view(h1), "run_index": 0} == {**step_view(h2), "run_index": 0}


def test_44409_regression_clean_passes_fault_corrupts(session, trace):
    clean = _clean()
    ok = session.check(trace, runs=1, arms={"clean": clean})
    assert ok.finding is None
    bad = session.check(trace, runs=1, arms={"fault": sorted({*clean, CROSS_GROUP_ONE_PHASE})})
    r = next(v for v in bad.verdicts if v.request_id == "R")
    assert r.class_ == "corruption", r
    others = [v for v in bad.verdicts if v.request_id != "R"]
    assert all(v.class_ == "ok" for v in others), others
    # The mechanism, not just the symptom: one block id in both groups' tables of R.
    assert any(s.cross_group_shared for s in bad.histories[0].steps)


def test_44409_regression_in_bfloat16(session, trace):
    # The block count is pinned (num_gpu_blocks_override), so the same trace reaches the same
    # free-queue positions with bfloat16's smaller blocks. A second engine start.
    t = trace.model_copy(update={"engine": trace.engine.model_copy(update={"dtype": "bfloat16"})})
    clean = _clean()
    assert session.check(t, runs=1, arms={"clean": clean}).finding is None
    bad = session.check(t, runs=1, arms={"fault": sorted({*clean, CROSS_GROUP_ONE_PHASE})})
    assert next(v for v in bad.verdicts if v.request_id == "R").class_ == "corruption"


def test_fault_self_check_refuses_a_coordinator_without_the_two_phases(monkeypatch):
    import dataclasses

    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    copy = dataclasses.replace(toggles.get(CROSS_GROUP_ONE_PHASE), name="test-copy-cross-group", installed=False)
    toggles.REGISTRY[copy.name] = copy
    try:
        def allocate_new_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                         num_external_computed_tokens, skip_zeroing_group_ids=()):
            return None  # same signature, no longer the code the fault reorders

        monkeypatch.setattr(KVCacheCoordinator, "allocate_new_computed_blocks", allocate_new_computed_blocks)
        with pytest.raises(toggles.ToggleError, match="allocate_new_computed_blocks no longer contains"):
            toggles.install([copy.name])
    finally:
        toggles.REGISTRY.pop(copy.name, None)
