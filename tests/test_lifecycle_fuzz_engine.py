"""The lifecycle generator on the real vLLM CPU engine, in-process: a generated trace of adapter
churn applies every lifecycle event kind through vLLM's own API, replays step-exactly, and the
LoRA manager's work shows in the history and in the coverage signature."""

import pytest

from kvfuzz.fuzzer import GenOptions, default_engine, generate
from kvfuzz.fuzzer.feedback import signature
from kvfuzz.traces.history import step_view

pytestmark = pytest.mark.engine

# A seed whose trace loads, unloads and reloads (checked below, so a generator change that
# loses that fails here rather than silently testing less).
SEED = 23


def test_a_generated_lifecycle_trace_replays_step_exactly(session):
    from kvfuzz.driver.arms import clean_toggles

    t = generate(SEED, default_engine(lora=True), GenOptions(lifecycle=True))
    assert {e.kind for e in t.lifecycle} == {"load-adapter", "unload-adapter", "reload-adapter"}
    eng = session.engine_for(t.engine)
    h1 = eng.replay(t, toggles=clean_toggles())
    h2 = eng.replay(t, toggles=clean_toggles())
    assert not h1.crashed, h1.crash_detail
    assert step_view(h1) == step_view(h2)
    applied = [e for e in h1.events if e.kind != "send"]
    assert {e.kind for e in applied} == {"load-adapter", "unload-adapter", "reload-adapter"}
    assert all(e.error is None for e in applied)
    assert all(len(r.token_ids) == r.max_tokens for r in h1.requests.values() if not r.cancelled)
    total = {k: sum(getattr(s, k) for s in h1.steps) for k in ("lora_loads", "lora_slot_changes", "lora_reloads")}
    assert all(total.values()), total
    sig = signature(h1, t)
    assert "lora-loads:0" not in sig and "lora-slot-changes:0" not in sig and "lora-reloads:0" not in sig
    assert any(b.startswith("life:after-") for b in sig), sorted(sig)
