"""Mutation operators (pure: no engine). Each operator must produce a valid trace with both
clocks consistent and the shape it promises."""

import random

import pytest

from kvfuzz.fuzzer import GenOptions, default_engine, generate
from kvfuzz.fuzzer.mutate import OPERATORS, apply, clocks_consistent, kv_capacity_tokens, min_kv_bytes, mutate
from kvfuzz.fuzzer.generate import GENERATOR
from kvfuzz.traces import At, CancelEvent, GenPrompt, SendEvent, Trace, expand, parse_trace

LORA = default_engine(lora=True)
BASE = default_engine()


def parents(engine=LORA, n=30, opts=None):
    return [generate(seed, engine, opts) for seed in range(n)]


def one(name, trace, seed=0):
    return apply(trace, [name], random.Random(seed))


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_every_operator_gives_valid_traces_with_both_clocks(name):
    applied = 0
    # Lifecycle operators are tried on lifecycle traces (test_mutate_lifecycle.py has more);
    # flip_same_path needs a reload to flip.
    ps = parents(opts=GenOptions(lifecycle=True) if OPERATORS[name].lifecycle else None)
    need = 25 if name != "flip_same_path" else sum(1 for t in ps if any(e.kind == "reload-adapter" for e in t.events))
    for i, t in enumerate(ps):
        m = one(name, t, i)
        if m is None:
            continue
        applied += 1
        assert parse_trace(m.model_dump(mode="json")) == m
        assert clocks_consistent(m), name
        assert m.trace_id() != t.trace_id()
        assert len({s.request_id for s in m.sends}) == len(m.sends)
    assert applied >= need, f"{name} applied to only {applied}/30 traces"


def test_split_sends_the_head_first_and_the_full_request_reuses_it():
    for i, t in enumerate(parents()):
        m = one("split", t, i)
        heads = [s for s in m.sends if s.request_id.endswith("_head")]
        assert len(heads) == 1
        head = heads[0]
        full = m.send(head.request_id[: -len("_head")])
        h, f = expand(head.prompt), expand(full.prompt)
        assert 0 < len(h) < len(f) and f[: len(h)] == h
        assert head.at.step <= full.at.step and head.adapter == full.adapter


def test_burst_clones_a_request_at_small_spacing():
    for i, t in enumerate(parents()):
        m = one("burst", t, i)
        clones = [s for s in m.sends if "_b" in s.request_id and s.request_id not in {x.request_id for x in t.sends}]
        assert len(clones) >= 2
        src = t.send(clones[0].request_id.split("_b")[0])
        steps = sorted([src.at.step] + [c.at.step for c in clones])
        assert all(c.prompt == src.prompt and c.adapter == src.adapter for c in clones)
        assert all(0 <= b - a <= 2 for a, b in zip(steps, steps[1:]))


def test_cancel_retry_cancels_then_resends_under_a_new_id():
    kinds = set()
    for i, t in enumerate(parents(n=60)):
        m = one("cancel_retry", t, i)
        new = [s for s in m.sends if s.request_id not in {x.request_id for x in t.sends}]
        (retry,) = new
        assert "_retry" in retry.request_id
        orig = m.send(retry.request_id.rsplit("_retry", 1)[0])
        (cancel,) = [c for c in m.cancels if c.request_id == orig.request_id]
        assert retry.adapter == orig.adapter
        budget = m.engine.max_num_batched_tokens
        if orig.prompt.length > budget and (cancel.at.after_tokens == 0 or
                                            cancel.at.step < orig.at.step + -(-orig.prompt.length // budget)):
            # Mid-prefill: a chunked prompt cancelled after its first chunk or inside its
            # prefill; the follower shares all of it but (at most) its tail.
            kinds.add("prefill")
            assert retry.prompt.prefix_group == orig.prompt.prefix_group
            assert expand(retry.prompt)[:orig.prompt.length - 40] == expand(orig.prompt)[:orig.prompt.length - 40]
            assert retry.at.step >= orig.at.step + 1
        else:
            kinds.add("decode")
            assert cancel.at.step is not None and cancel.at.step > orig.at.step  # after prefill started
            assert retry.prompt == orig.prompt
        if cancel.at.step is not None:
            assert retry.at.step >= cancel.at.step
            if retry.at.step == cancel.at.step:  # same step: the cancel is applied first
                assert m.events.index(cancel) < m.events.index(retry)
    assert kinds == {"prefill", "decode"}, kinds


def test_adapter_thrash_alternates_adapters_over_one_shared_prefix():
    assert one("adapter_thrash", generate(1, BASE)) is None  # no LoRA, no thrash
    saw_base = False
    for i, t in enumerate(parents()):
        m = one("adapter_thrash", t, i)
        new = [s for s in m.sends if s.request_id not in {x.request_id for x in t.sends}]
        assert len(new) >= 4
        groups = {(s.prompt.prefix_group, s.prompt.prefix_len) for s in new}
        assert len(groups) == 1 and next(iter(groups))[1] >= 4 * LORA.block_size
        seq = [s.adapter for s in new if s.adapter]
        assert len(set(seq)) >= 2 and all(a != b for a, b in zip(seq, seq[1:]))
        saw_base |= any(s.adapter is None for s in new)
    assert saw_base, "base-model requests are never interleaved"


def test_block_boundary_aligns_a_shared_prefix():
    bs = LORA.block_size
    for i, t in enumerate(parents()):
        m = one("block_boundary", t, i)
        changed = [s for s in m.sends if s.request_id in {x.request_id for x in t.sends}
                   and s.prompt != t.send(s.request_id).prompt or s.request_id.endswith("_sib")]
        assert changed
        s = changed[0]
        assert s.prompt.prefix_len % bs in (0, 1, bs - 1)
        sharers = [x for x in m.sends if x.prompt.prefix_group == s.prompt.prefix_group]
        assert len(sharers) >= 2


def test_long_pressure_adds_a_late_request_near_max_length_over_full_kv():
    cap = kv_capacity_tokens(LORA)
    assert cap == LORA.kv_cache_bytes // 1024
    for i, t in enumerate(parents()):
        m = one("long_pressure", t, i)
        added = [s for s in m.sends if s.request_id not in {x.request_id for x in t.sends}]
        (long,) = [s for s in added if s.request_id.startswith("long")]
        holders = [s for s in added if s.request_id.startswith("hold")]
        assert holders and len(added) == len(holders) + 1
        assert long.prompt.length >= (LORA.max_model_len - long.max_tokens) // 2
        assert long.at.step >= max(s.at.step for s in t.sends) - 4
        assert all(h.at.step < long.at.step for h in holders)  # late: after the holders
        assert sum(s.prompt.length + s.max_tokens for s in holders + [long]) > cap


def test_small_kv_still_holds_one_max_length_request():
    floor = min_kv_bytes(LORA)
    assert floor >= LORA.max_model_len * 1024  # ~1 KiB per token on the embedded model
    assert floor < LORA.kv_cache_bytes
    m = one("small_kv", generate(0, LORA))
    assert floor <= m.engine.kv_cache_bytes < LORA.kv_cache_bytes
    assert m.events == generate(0, LORA).events


def test_cancel_timing_is_relative_to_the_request_life():
    phases = set()
    for i, t in enumerate(parents(n=60)):
        m = one("cancel_timing", t, i)
        changed = [s for s in m.sends if [c for c in m.cancels if c.request_id == s.request_id and c.at.after_tokens is not None]]
        for s in changed:
            cs = [c for c in m.cancels if c.request_id == s.request_id]
            if len(cs) == 1 and cs[0].at.step is None:
                k = cs[0].at.after_tokens
                phases.add(0 if k == 0 else 1 if k == 1 else 2)
                if k == 0 and s.prompt.length > t.send(s.request_id).prompt.length:
                    assert s.prompt.length > LORA.max_num_batched_tokens  # chunked: cancel lands mid-prefill
    assert phases == {0, 1, 2}


def test_shift_moves_events_in_both_clocks():
    t = generate(3, LORA)
    for seed in range(20):
        m = one("shift", t, seed)
        moved = [(a, b) for a, b in zip(t.events, m.events) if a.at != b.at]
        assert moved or [e.at for e in m.events] != [e.at for e in t.events]
        assert clocks_consistent(m)


def test_max_tokens_and_drop():
    t = generate(4, LORA)
    m = one("max_tokens", t, 1)
    assert [s.max_tokens for s in m.sends] != [s.max_tokens for s in t.sends]
    for seed in range(20):
        d = one("drop", t, seed)
        assert len(d.events) < len(t.events)
        ids = {s.request_id for s in d.sends}
        assert all(c.request_id in ids for c in d.cancels)


def test_operators_mutate_server_traces_given_in_offsets_only():
    eng = LORA
    t = Trace(engine=eng, events=[
        SendEvent(request_id="a", at=At(offset_ms=0), prompt=GenPrompt(length=100, seed=1), max_tokens=8),
        SendEvent(request_id="b", at=At(offset_ms=35.0), prompt=GenPrompt(length=300, seed=2), max_tokens=8),
        CancelEvent(request_id="b", at=At(offset_ms=80.0)),
    ])
    for name in OPERATORS:
        for seed in range(5):
            m = one(name, t, seed)
            if m is None:
                continue
            assert clocks_consistent(m), name
            for e in m.events:
                if e.at.offset_ms is not None:
                    assert e.at.step == int(e.at.offset_ms // eng.ms_per_step)


def test_mutate_records_lineage_and_is_deterministic():
    t = generate(5, LORA)
    a, b = mutate(t, random.Random(9)), mutate(t, random.Random(9))
    assert a == b
    assert a.lineage.parent == t.trace_id()
    assert a.lineage.operators and all(o in OPERATORS for o in a.lineage.operators)
    assert a.lineage.generator == GENERATOR and a.lineage.seed == 5
    grand = mutate(a, random.Random(1))
    assert grand.lineage.parent == a.trace_id()
    # Without permission no operator changes the engine (a restart per trace would be slow).
    assert all(mutate(t, random.Random(s)).engine == t.engine for s in range(50))


def test_every_operator_is_documented_with_its_mechanism():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "fuzzer.md").read_text()
    for name, op in OPERATORS.items():
        assert f"| `{name}` |" in doc, f"{name} missing from docs/fuzzer.md"
        assert op.mechanism and len(op.mechanism) > 60


def test_graft_adds_a_time_window_of_the_donor_renamed_and_shifted_together():
    from kvfuzz.fuzzer.mutate import MAX_EVENTS, graft, mutate_into

    base, donor = generate(1, LORA), mutate(generate(2, LORA), random.Random(0))
    for seed in range(40):
        g = graft(base, donor, random.Random(seed), max_sends=4)
        assert [e for e in g.events if not e.request_id.startswith("x.")] == base.events
        extra = [e for e in g.events if e.request_id.startswith("x.")]
        sends = [e for e in extra if isinstance(e, SendEvent)]
        assert 1 <= len(sends) <= 4
        by_id = {s.request_id: s for s in donor.sends}
        # The window is consecutive in the donor's time order, with every cancel of its sends.
        order = [s.request_id for s in sorted(donor.sends, key=lambda s: s.at.step)]
        idx = sorted(order.index(e.request_id[2:]) for e in sends)
        assert idx == list(range(idx[0], idx[0] + len(idx)))
        kept = {e.request_id[2:] for e in sends}
        assert sum(1 for e in extra if isinstance(e, CancelEvent)) == sum(
            1 for c in donor.cancels if c.request_id in kept)
        # One shift for the whole window: the donor's relative timing is kept.
        shifts = {e.at.step - by_id[e.request_id[2:]].at.step for e in sends}
        assert len(shifts) == 1
        assert all(e.prompt == by_id[e.request_id[2:]].prompt for e in sends)
        assert clocks_consistent(g)
        assert g.lineage.seed == 1 and g.lineage.operators == [*donor.lineage.operators, "graft"]
        assert g.lineage.parent == donor.lineage.parent
    # A graft of a graft of a graft stays bounded (the window, not the whole donor, goes in).
    t = base
    for seed in range(30):
        t = mutate_into(generate(100 + seed, LORA), t, random.Random(seed))
        assert len(t.events) <= MAX_EVENTS and len(t.sends) <= len(generate(100 + seed, LORA).sends) + 8


# -- adapter lifecycle operators ---------------------------------------------------------------

LIFECYCLE_OPS = sorted(n for n, o in OPERATORS.items() if o.lifecycle)


def lc_parents(n=60):
    return parents(n=n, opts=GenOptions(lifecycle=True))


def test_lifecycle_operators_are_registered_and_drawn_only_when_asked():
    assert set(LIFECYCLE_OPS) == {"rebind", "lifecycle_shift", "flip_same_path", "swap_variant", "cache_salt",
                                  "retarget"}
    from kvfuzz.fuzzer.mutate import choose_operators

    plain = {n for s in range(400) for n in choose_operators(random.Random(s))}
    assert not plain & set(LIFECYCLE_OPS)
    lc = {n for s in range(400) for n in choose_operators(random.Random(s), lifecycle=True)}
    assert set(LIFECYCLE_OPS) <= lc
    assert choose_operators(random.Random(0), allowed=["rebind"]) [0] == "rebind"  # named: allowed
    t = lc_parents(1)[0]
    m = mutate(t, random.Random(3), lifecycle=True, allowed=["rebind", "cache_salt"])
    assert m.lineage.operators and set(m.lineage.operators) <= {"rebind", "cache_salt"}
    assert m.lineage.parent == t.trace_id() and m.lineage.generator == "lifecycle-v1"


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_no_operator_makes_an_invalid_lifecycle_trace(name):
    """Every operator, old or new, on lifecycle traces: a valid trace (validator, JSON round
    trip, both clocks) or None, and lifecycle operators never a load over the files of a request
    still in flight."""
    from kvfuzz.fuzzer import lifecycle

    for i, t in enumerate(lc_parents(80)):
        for k in range(3):
            m = one(name, t, 10 * i + k)
            if m is None:
                continue
            assert parse_trace(m.model_dump(mode="json")) == m, name
            assert clocks_consistent(m), name
            if OPERATORS[name].lifecycle:
                assert m.trace_id() != t.trace_id(), name
                assert not lifecycle.overwrites_in_flight(m), name


def test_rebind_puts_a_rebinding_between_two_requests_sharing_a_prefix():
    from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

    kinds = set()
    for i, t in enumerate(lc_parents() + parents()):
        m = one("rebind", t, i)
        if m is None:
            continue
        old = list(t.lifecycle)
        new = [e for e in m.lifecycle if e not in old or old.remove(e)]  # the added events (a multiset difference)
        assert new and len({e.name for e in new}) == 1
        name = new[0].name
        if isinstance(new[0], ReloadAdapterEvent):
            kinds.add("in-place" if new[0].same_path else "new-path")
        else:
            assert [type(e) for e in new] == [UnloadAdapterEvent, LoadAdapterEvent]
            kinds.add("unload+load")
        order = [m.events[j] for j in m.planned_order()]
        at = order.index(new[-1])
        before = [s for s in order[:at] if s.kind == "send" and s.adapter == name]
        after = [s for s in order[at + 1:] if s.kind == "send" and s.adapter == name]
        assert before and after
        assert any(a.prompt == b.prompt or (a.prompt.prefix_group and a.prompt.prefix_group == b.prompt.prefix_group)
                   for a in before for b in after)
    assert kinds == {"in-place", "new-path", "unload+load"}


def test_the_small_lifecycle_operators_do_what_they_say():
    from kvfuzz.fuzzer import lifecycle

    for i, t in enumerate(lc_parents()):
        m = one("flip_same_path", t, i)
        if m is not None:
            diff = [(a.same_path, b.same_path) for a, b in zip(t.lifecycle, m.lifecycle) if a != b]
            assert len(diff) == 1 and diff[0][0] != diff[0][1]
        m = one("swap_variant", t, i)
        changed = [(a, b) for a, b in zip(t.lifecycle, m.lifecycle) if a != b]
        changed += [(a, b) for a, b in zip(sorted(t.engine.lora.adapters.items()),
                                           sorted(m.engine.lora.adapters.items())) if a != b]
        assert len(changed) == 1
        m = one("cache_salt", t, i)
        assert {(s.request_id, s.cache_salt) for s in m.sends} != {(s.request_id, s.cache_salt) for s in t.sends}
        assert all(s.cache_salt in (None, *lifecycle.TENANTS) for s in m.sends)
        m = one("retarget", t, i)
        if m is not None:
            moved = [(a.adapter, b.adapter) for a, b in zip(t.sends, m.sends) if a.adapter != b.adapter]
            assert len(moved) == 1 and moved[0][0] != moved[0][1]
        m = one("lifecycle_shift", t, i)
        if m is not None:
            assert sorted(e.at.step for e in m.lifecycle) != sorted(e.at.step for e in t.lifecycle)
    assert one("flip_same_path", generate(1, LORA)) is None  # no reload to flip
    assert one("rebind", generate(1, BASE)) is None  # no LoRA
