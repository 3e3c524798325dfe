"""Adapter lifecycle events on the real vLLM CPU engine, in-process: each event kind applied
through vLLM's own add_lora / remove_lora, step-exact replays, the bindings each request ran
with, cache_salt isolation, and the oracle's lifecycle contract (docs/oracle.md)."""

import pytest

from kvfuzz.harness.embedded import adapter_hash, build, resolve_adapter
from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK, LORA_IDENTITY
from kvfuzz.traces import parse_trace
from kvfuzz.traces.history import step_view

pytestmark = pytest.mark.engine


def _send(rid, step, adapter=None, *, group="g", seed=0, max_tokens=6, **extra):
    e = {"kind": "send", "request_id": rid, "at": {"step": step}, "max_tokens": max_tokens,
         "prompt": {"length": 200, "prefix_group": group, "prefix_len": 160, "seed": seed}}
    if adapter is not None:
        e["adapter"] = adapter
    return {**e, **extra}


def _trace(cfg, events):
    engine = cfg.model_dump(mode="json")
    return parse_trace({"schema_version": 2, "engine": engine, "events": events})


def _hash_of(source):
    return adapter_hash(resolve_adapter(source, build()))


def test_each_event_kind_applies_and_replays_step_exactly(session, lora_engine_config):
    t = _trace(lora_engine_config, [
        _send("r1", 0, "a", seed=1),
        {"kind": "load-adapter", "name": "x", "source": "embedded:b@v2", "at": {"step": 2}},
        _send("r2", 3, "x", seed=2),
        {"kind": "unload-adapter", "name": "x", "at": {"step": 30}},
        {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2", "at": {"step": 31}},
        {"kind": "reload-adapter", "name": "b", "source": "embedded:c", "same_path": True, "at": {"step": 31}},
        _send("r3", 32, "a", seed=3),
        _send("r4", 32, "b", seed=4),
        # Same prompt, three tenants: a salt never shares blocks with another salt.
        _send("s1", 40, cache_salt="tenant-1", group="s", seed=9),
        _send("s2", 60, cache_salt="tenant-2", group="s", seed=9),
        _send("s3", 80, cache_salt="tenant-1", group="s", seed=9),
    ])
    eng = session.engine_for(t.engine)
    h1, h2 = eng.replay(t, toggles=[LORA_CPU_MASK]), eng.replay(t, toggles=[LORA_CPU_MASK])
    assert step_view(h1) == step_view(h2)
    kinds = [(e.kind, e.adapter or e.request_id) for e in h1.events]
    assert ("load-adapter", "x") in kinds and ("unload-adapter", "x") in kinds
    assert ("reload-adapter", "a") in kinds and ("reload-adapter", "b") in kinds
    assert all(e.error is None for e in h1.events)
    want = {"r1": "embedded:a", "r2": "embedded:b@v2", "r3": "embedded:a@v2", "r4": "embedded:c"}
    for rid, source in want.items():
        r = h1.requests[rid]
        assert (r.adapter_source, r.adapter_hash) == (source, _hash_of(source)), rid
        assert len(r.token_ids) == 6
    # The static plan agrees with what the harness did.
    assert {rid: b.source for rid, b in t.bindings_at_admission().items() if b} == want
    assert h1.requests["s2"].num_cached_tokens == 0  # another tenant: no shared blocks
    assert h1.requests["s3"].num_cached_tokens == 192  # the same tenant: 6 full blocks of s1
    # The LoRA manager's work is visible to feedback: disk loads, slot assignments, reloads.
    assert sum(s.lora_loads for s in h1.steps) >= 2, [(s.step, s.lora_loads, s.lora_reloads, s.lora_slot_changes) for s in h1.steps if s.lora_loads or s.lora_reloads]
    assert sum(s.lora_slot_changes for s in h1.steps) >= 3
    assert sum(s.lora_reloads for s in h1.steps) >= 1


def test_the_lifecycle_contract_on_the_real_engine(session, lora_engine_config):
    """A reload from the same path keeps vLLM's prefix-cache key (name, path): the next request
    on that name reads blocks computed with the old weights (vllm#42125) — corruption against
    its reference with the new weights, gone with the identity fix. A reload from a new path is
    clean. A request whose own adapter is reloaded while it runs is unconstrained, not judged."""
    def reload_trace(same_path):
        return _trace(lora_engine_config, [
            _send("old", 0, "a", seed=1, max_tokens=4),
            {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2", "same_path": same_path,
             "at": {"step": 30}},
            _send("new", 31, "a", seed=2, max_tokens=6),
        ])

    arms = {"vanilla": [LORA_CPU_MASK], "fixed": [LORA_CPU_MASK, LORA_IDENTITY]}
    c = session.check(reload_trace(True), runs=1, arms=arms)
    got = {(v.arm, v.request_id): v.class_ for v in c.verdicts}
    assert got == {("vanilla", "old"): "ok", ("vanilla", "new"): "corruption",
                   ("fixed", "old"): "ok", ("fixed", "new"): "ok"}
    stale = next(h for h in c.recording.histories if h.arm == "vanilla").requests["new"]
    assert stale.num_cached_tokens == 160 and stale.adapter_hash == _hash_of("embedded:a@v2")

    c = session.check(reload_trace(False), runs=1, arms={"vanilla": [LORA_CPU_MASK]})
    assert {v.class_ for v in c.verdicts} == {"ok"}

    racing = _trace(lora_engine_config, [
        _send("long", 0, "a", max_tokens=24),
        {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2", "at": {"step": 6}},
    ])
    c = session.check(racing, runs=1, arms={"vanilla": [LORA_CPU_MASK]})
    (v,) = c.verdicts
    assert v.class_ == "unconstrained" and "reloaded in place at step 6" in v.detail
    assert c.finding is None


@pytest.mark.parametrize("identity_outer", [True, False])
def test_identity_fix_adds_the_weights_and_yields_to_the_namespace_fault(monkeypatch, identity_outer):
    from types import SimpleNamespace

    import vllm.v1.core.kv_cache_utils as ku
    from vllm.lora.request import LoRARequest

    from kvfuzz.harness import toggles
    from kvfuzz.harness.toggles import lora as lora_toggles
    from kvfuzz.harness.toggles.builtin import LORA_NS
    from kvfuzz.harness.toggles.checks import unwrap

    # Both wrapping orders, on vLLM's own function (restored afterwards).
    monkeypatch.setattr(ku, "_gen_lora_extra_hash_keys", unwrap(ku._gen_lora_extra_hash_keys))
    first, second = ((lora_toggles._lora_ns_patch, lora_toggles._lora_identity_patch) if identity_outer
                     else (lora_toggles._lora_identity_patch, lora_toggles._lora_ns_patch))
    first()
    second()
    a = str(resolve_adapter("embedded:a", build()))
    req = SimpleNamespace(lora_request=LoRARequest("a", 1, a))
    with toggles.activate([]):
        plain = ku._gen_lora_extra_hash_keys(req)
    with toggles.activate([LORA_IDENTITY]):
        fixed = ku._gen_lora_extra_hash_keys(req)
    (extra,) = fixed[len(plain):]
    assert fixed[: len(plain)] == plain and extra[0] == "lora_weights"
    v2 = SimpleNamespace(lora_request=LoRARequest("a", 1, str(resolve_adapter("embedded:a@v2", build()))))
    with toggles.activate([LORA_IDENTITY]):
        assert ku._gen_lora_extra_hash_keys(v2)[-1] not in (extra, *plain)  # other weights, other key
    with toggles.activate([LORA_IDENTITY, LORA_NS]):
        assert ku._gen_lora_extra_hash_keys(req) == []
