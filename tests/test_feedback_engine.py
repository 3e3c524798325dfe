"""Coverage buckets from real scheduler state (in-process vLLM CPU engine): the operators
reach the states they aim at, and the signature sees them."""

import random

import pytest

from kvfuzz.fuzzer import generate
from kvfuzz.fuzzer.feedback import signature
from kvfuzz.fuzzer.mutate import apply
from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK
from kvfuzz.traces import At, CancelEvent, GenPrompt, SendEvent, Trace

pytestmark = pytest.mark.engine


def test_long_pressure_reaches_preemption(session, lora_engine_config):
    base = generate(2, lora_engine_config)
    plain = session.engine_for(lora_engine_config).replay(base)
    assert "preempt:0" in signature(plain, base)
    t = apply(base, ["long_pressure"], random.Random(2))
    h = session.engine_for(t.engine).replay(t, toggles=[LORA_CPU_MASK])
    sig = signature(h, t)
    assert "preempt:0" not in sig and "req-preempted-n:0" not in sig, sorted(sig)
    assert any(b.startswith("req-preempted:") and b.endswith("+done") for b in sig)  # resumed and finished
    assert "kv-max:100" in sig
    # Filling the cache reuses blocks the earlier requests left cached: prefix-cache evictions.
    assert "evict:0" not in sig and sum(st.evictions for st in h.steps) > 0


def test_cancel_phases_chunking_and_lora_swaps_are_seen(session, lora_engine_config):
    cfg = lora_engine_config
    mps = cfg.ms_per_step
    ev = [SendEvent(request_id="pre", at=At(step=0, offset_ms=0), max_tokens=8, prompt=GenPrompt(length=5000, seed=9)),
          CancelEvent(request_id="pre", at=At(after_tokens=0)),
          SendEvent(request_id="one", at=At(step=1, offset_ms=mps), max_tokens=8, prompt=GenPrompt(length=50, seed=10)),
          CancelEvent(request_id="one", at=At(after_tokens=1))]
    ev += [SendEvent(request_id=f"l{i}", at=At(step=2 + i, offset_ms=(2 + i) * mps), adapter="abc"[i % 3],
                     max_tokens=6, prompt=GenPrompt(length=80, prefix_group="g", prefix_len=64, seed=i))
           for i in range(6)]
    t = Trace(engine=cfg, events=ev)
    h = session.engine_for(cfg).replay(t, toggles=[LORA_CPU_MASK])
    sig = signature(h, t)
    assert {"cancel:prefill", "cancel:first-token", "cached:lora", "lora-resident:2"} <= sig
    assert "chunked:0" not in sig and "lora-swaps:0" not in sig


def test_block_edges_come_from_the_real_block_pool(session, lora_engine_config):
    """b hits a's cached prefix blocks while a still runs (share), then a is cancelled while
    b holds them (leave-shared:cancel): read from vLLM's own per-request block lists."""
    cfg = lora_engine_config
    mps = cfg.ms_per_step
    shared = dict(prefix_group="g", prefix_len=4 * cfg.block_size)
    ev = [SendEvent(request_id="a", at=At(step=0, offset_ms=0), max_tokens=16,
                    prompt=GenPrompt(length=200, seed=1, **shared)),
          SendEvent(request_id="b", at=At(step=2, offset_ms=2 * mps), max_tokens=16,
                    prompt=GenPrompt(length=200, seed=2, **shared)),
          CancelEvent(request_id="a", at=At(after_tokens=6))]
    t = Trace(engine=cfg, events=ev)
    h = session.engine_for(cfg).replay(t)
    edges = [e for s in h.steps for e in s.block_edges]
    assert edges.count("share") == 4, edges  # exactly the 4 prefix blocks
    assert "leave-shared:cancel" in edges, edges
    sig = signature(h, t)
    assert "edge:share:4-7" in sig and "edge:leave-shared:cancel:1" in sig
