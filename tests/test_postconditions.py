"""The post-conditions of vLLM's KV bookkeeping, checked after every step
(harness/postconditions.py), the name the oracle gives a victim (oracle/postconditions.py), and
the bucket key that holds it. Fakes with vLLM's attribute names: the engine tier checks the real
thing (test_engine.py: none break on clean runs; test_postconditions_engine.py: faults break
theirs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from test_buckets import unexplained

from kvfuzz.harness.postconditions import MAX_MAP_BREAKS, Monitor
from kvfuzz.oracle import buckets as rule
from kvfuzz.oracle.postconditions import origin
from kvfuzz.traces.buckets import BucketKey
from kvfuzz.traces.history import Break


def H(n: int) -> bytes:  # a block hash, and the same with vLLM's group-id suffix
    return bytes([n]) * 8


def G(n: int, g: int = 0) -> bytes:
    return H(n) + g.to_bytes(4, "big")


@dataclass(eq=False)
class Block:
    block_id: int
    block_hash: bytes | None = None
    ref_cnt: int = 1
    is_null: bool = False


class Map:
    def __init__(self, entries):
        self._cache = entries


@dataclass
class Pool:
    blocks: list
    entries: dict
    enable_caching: bool = True
    hash_block_size: int = 16
    cached_block_hashes_by_block: dict = field(default_factory=dict)

    def __post_init__(self):
        self.cached_block_hash_to_block = Map(self.entries)
        # As in vLLM: ``blocks[i].block_id == i``, block 0 the null block.
        self.null_block = Block(0, is_null=True, ref_cnt=0)
        by_id = {b.block_id: b for b in self.blocks}
        self.blocks = [self.null_block] + [by_id.get(i) or Block(i, ref_cnt=0) for i in range(1, max(by_id, default=0) + 1)]


@dataclass
class Req:
    block_hashes: list
    num_computed_tokens: int = 0
    all_token_ids: list = field(default_factory=list)  # none: the token check skips the request


class Scheduler:
    def __init__(self, pool, held: dict, hashes: dict):
        mgr = type("M", (), {"req_to_blocks": held, "block_size": 16})()
        coord = type("C", (), {"single_type_managers": [mgr]})()
        self.kv_cache_manager = type("K", (), {"block_pool": pool, "coordinator": coord})()
        self.requests = {r: Req(h) for r, h in hashes.items()}


def batch(rows: dict[str, list[int]]):
    table = np.zeros((4, 8), dtype=np.int32)
    counts = np.zeros(4, dtype=np.int32)
    for i, ids in enumerate(rows.values()):
        table[i, :len(ids)] = ids
        counts[i] = len(ids)
    bt = type("BT", (), {"block_table": type("B", (), {"np": table})(), "num_blocks_per_row": counts})()
    return type("IB", (), {"req_id_to_index": {r: i for i, r in enumerate(rows)},
                           "block_table": type("MG", (), {"block_tables": [bt]})()})()


def slot_batch(rows: dict[str, list[int]], slots: list[int], bs: int = 4):
    """A batch as the worker ran it: rows in order, the step's slot mapping (vLLM's names)."""
    ib = batch(rows)
    (bt,) = ib.block_table.block_tables
    bt.block_size = bs
    bt.slot_mapping = type("S", (), {"gpu": torch.tensor(slots + [-1] * 4, dtype=torch.int64)})()
    ib.req_ids, ib.num_reqs = list(rows), len(rows)
    return ib


def stepped(pool, held, hashes, spans, rows, slots, step=0, m=None, manager=None, kernels=(), positions=None,
            sampled=None, tokens=None, input_ids=None, drafts=None, after=None, bs=4):
    """One step: ``spans`` = request -> (first position, tokens) scheduled; ``manager``: the
    group's KV cache manager instead of the default fake; ``kernels``: the attention metadata
    the step's builders returned; ``positions``: the model runner's positions buffer;
    ``sampled``: its sampled rows; ``tokens``: request -> its token ids (prompt and output);
    ``input_ids``: the token ids the model was handed; ``drafts``: request -> the draft tokens
    scheduled past its own; ``after``: request -> (computed tokens, token ids) once the step's
    output is in (``update_from_output``: sampled tokens appended, rejected drafts taken back)."""
    m = m or Monitor()
    sched = Scheduler(pool, held, hashes)
    if manager is not None:
        sched.kv_cache_manager.coordinator.single_type_managers = [manager]
    for r, (start, n) in spans.items():
        sched.requests[r].num_computed_tokens = start + n  # after schedule(), as in vLLM
    for r, toks in (tokens or {}).items():
        sched.requests[r].all_token_ids = toks

    def update():
        for r, (count, toks) in (after or {}).items():
            sched.requests[r].num_computed_tokens, sched.requests[r].all_token_ids = count, toks

    m.check(step, sched, slot_batch(rows, slots, bs), {r: n for r, (_, n) in spans.items()}, kernels=kernels,
            positions=positions, sampled=sampled, input_ids=input_ids, drafts=drafts, update=update)
    return m


def monitor(pool, held, hashes, rows=None, step=0, m=None):
    m = m or Monitor()
    m.check(step, Scheduler(pool, held, hashes), batch(rows) if rows is not None else None)
    return m


def test_a_consistent_state_breaks_nothing():
    a, b = Block(1, G(1)), Block(2, G(2))
    pool = Pool([a, b], {G(1): a, G(2): {2: b}})
    m = monitor(pool, {"r": [a, b]}, {"r": [H(1), H(2)]}, rows={"r": [1, 2]})
    assert m.breaks == [] and not m.disabled


def test_an_entry_left_on_a_reused_block_is_orphaned_and_its_reader_points_back_to_it():
    """Fault P's shape: eviction reset the block and refilled it, the map still finds it under
    the old hash. The request that hits the old hash holds a block carrying another hash."""
    b = Block(2, G(9), ref_cnt=2)  # refilled by its new owner with hash 9; the victim holds it too
    pool = Pool([b], {G(1): b, G(9): b})
    m = monitor(pool, {"owner": [b]}, {"owner": [H(9)]})
    assert [(x.name, x.block) for x in m.breaks] == [("map-entry-orphaned", 2)]
    m = monitor(pool, {"owner": [b], "victim": [b]}, {"owner": [H(9)], "victim": [H(1)]}, step=1, m=m)
    victim = [x for x in m.breaks if x.request == "victim"]
    assert [(x.name, x.root) for x in victim] == [("held-block-foreign", "map-entry-orphaned")]
    assert origin(m.breaks, "victim") == "map-entry-orphaned" and origin(m.breaks, "owner") is None


def test_an_entry_taken_from_a_block_that_still_carries_its_hash_is_stolen():
    """Fault S's shape (the same broken map entry as P, told apart by the robbed block)."""
    a, b = Block(1, G(1)), Block(2, G(2))
    pool = Pool([a, b], {G(1): b, G(2): b})
    m = monitor(pool, {"v": [b]}, {"v": [H(1)]})
    assert [x.name for x in m.breaks if x.request is None] == ["map-entry-stolen"]
    assert origin(m.breaks, "v") == "map-entry-stolen"


def test_extra_hashes_of_a_block_are_its_own():
    b = Block(2, G(2))
    pool = Pool([b], {G(1): b, G(2): b}, cached_block_hashes_by_block={2: {G(1)}})
    assert monitor(pool, {"r": [b]}, {"r": [H(2)]}).breaks == []


def test_a_request_holding_one_block_twice_or_undercounted_or_a_wrong_worker_row():
    a, b = Block(1, G(1), ref_cnt=2), Block(2, G(2), ref_cnt=1)  # a: held twice, counted twice
    pool = Pool([a, b], {G(1): a, G(2): b})
    m = monitor(pool, {"r": [a, a], "s": [b], "t": [b]}, {"r": [H(1), H(2)], "s": [H(2)], "t": [H(2)]},
                rows={"r": [1, 1], "s": [2], "t": [0]})
    got = {(x.request, x.name) for x in m.breaks}
    assert {("r", "held-block-repeated"), ("r", "held-block-foreign"), ("s", "held-block-undercounted"),
            ("t", "held-block-undercounted"), ("t", "worker-row")} == got
    # One name per victim, by precedence: the worker's row before the count, foreign before repeated.
    assert origin(m.breaks, "t") == "worker-row" and origin(m.breaks, "r") == "held-block-foreign"


def test_each_break_is_recorded_once_and_map_breaks_cannot_crowd_out_a_victims():
    blocks = [Block(i, G(100 + i)) for i in range(1, 40)]
    pool = Pool(blocks, {G(i): b for i, b in enumerate(blocks, 1)})  # every entry orphaned
    m = monitor(pool, {"v": [blocks[-1]]}, {"v": [H(39)]})
    for s in range(1, 4):
        monitor(pool, {"v": [blocks[-1]]}, {"v": [H(39)]}, step=s, m=m)
    assert sum(x.request is None for x in m.breaks) == MAX_MAP_BREAKS
    assert [(x.step, x.root) for x in m.breaks if x.request == "v"] == [(0, "map-entry-orphaned")]


def test_another_layout_records_nothing_rather_than_a_wrong_break():
    m = Monitor()
    m.check(0, object(), None)
    assert m.disabled and m.breaks == []


def test_no_break_on_the_victim_means_no_origin_even_if_the_run_broke_elsewhere():
    breaks = [Break(step=3, name="worker-row", request="other", block=5)]
    assert origin(breaks, "victim") is None and origin([], "victim") is None


# -- the key ----------------------------------------------------------------------------------------
def k(v=None, broke=None, explained_by=None):
    return BucketKey(cls="corruption", verdicts=v or {}, broke=broke, explained_by=explained_by)


def test_the_post_condition_is_part_of_the_key():
    """One break, one key, whatever the witnesses' schedules needed; two breaks, two keys."""
    assert k(broke="worker-row") == k(broke="worker-row") != k(broke="worker-token")
    assert k(broke="map-entry-orphaned") != k(broke="map-entry-stolen") != k()
    assert k(broke="worker-row").digest() != k().digest() and "broke worker-row" in k(broke="worker-row").label()


def test_a_finding_has_one_key_per_post_condition_its_victims_broke():
    f = unexplained()
    d = f.divergences[0]
    second = d.model_copy(update={"request_id": "other", "broke": "map-entry-stolen"})
    third = d.model_copy(update={"request_id": "third", "broke": None})
    f.divergences = [d.model_copy(update={"broke": "worker-row"}), second, third]
    assert [x.broke for x in rule.keys_of(f)] == ["map-entry-stolen", "worker-row"]
    f.divergences = [third]
    assert [x.broke for x in rule.keys_of(f)] == [None]


def test_a_victim_that_broke_nothing_beside_self_only_names_keys_on_its_own():
    """A self-only name's cause harmed only the requests that broke it, so an unnamed victim
    beside them is another cause's and adds its own key. Beside a name whose wrong KV another
    request can read, it adds none (a victim that read a reused block before its new owner
    registered it breaks nothing itself)."""
    f = unexplained()
    d = f.divergences[0]
    quiet = d.model_copy(update={"request_id": "quiet", "broke": None})
    for name, want in (("worker-sample-row", ["worker-sample-row", None]), ("worker-seq-len", ["worker-seq-len", None]),
                       ("worker-position", ["worker-position"]), ("map-entry-orphaned", ["map-entry-orphaned"])):
        f.divergences = [quiet, d.model_copy(update={"broke": name})]
        keys = rule.keys_of(f)
        assert [x.broke for x in keys] == want, name
        if len(keys) == 2:
            assert rule.victim_of(f, keys[1]) == "quiet" and rule.victim_of(f, keys[0]) == d.request_id
    f.divergences = [d.model_copy(update={"broke": "worker-sample-row"}),
                     quiet.model_copy(update={"broke": "worker-position"})]
    assert [x.broke for x in rule.keys_of(f)] == ["worker-position", "worker-sample-row"]


def with_broke(f, name):
    f.divergences = [d.model_copy(update={"broke": name}) for d in f.divergences]
    return f


def test_the_report_says_which_post_condition_broke_on_the_victim():
    from test_report import finding

    from kvfuzz.present.report import markdown

    f = finding()
    d = f.divergences[0]
    br = Break(step=7, name="worker-row", request=d.request_id, block=69,
               detail="group 0 row 2: position 18 is block 0, the scheduler's is 69 (19 vs 19 blocks)")
    f.runs = [h.model_copy(update={"breaks": [br]}) if h.arm == d.arm else h for h in f.runs]
    md = markdown(f, source="f.json")
    assert "engine step `7`: `worker-row` — group 0 row 2: position 18 is block 0" in md


def test_the_campaign_summary_names_the_post_conditions_broken_and_each_buckets():
    from kvfuzz.present.buckets import broken_line, rows
    from kvfuzz.traces.buckets import Bucket

    assert broken_line({"prefix-hit": 9, "broke:held-block-undercounted": 55, "broke:worker-row": 2}) == (
        "vLLM post-conditions broken in fuzzed runs (its KV bookkeeping disagreed with itself, even where no output "
        "differed; docs/oracle.md \"Broken post-conditions\"): held-block-undercounted in 55 trace(s), worker-row in 2 "
        "trace(s)")
    assert broken_line({"prefix-hit": 9}) is None
    (r,) = rows({"b1": Bucket(id="b1", key=k(broke="worker-row"), count=3, first_index=0)})
    assert r.explanation == "unexplained: candidate vLLM bug; broke worker-row"


def test_a_row_is_checked_against_the_blocks_its_step_was_scheduled_with():
    """Fault T's shape on a row moved in the step its request finishes in: by the step's end the
    scheduler has freed the blocks, so a check against the live blocks would see nothing."""
    a, b = Block(1, G(1)), Block(2, G(2))
    pool = Pool([a, b], {G(1): a, G(2): b})
    live = Scheduler(pool, {"v": [a, b]}, {"v": [H(1), H(2)]})
    m = Monitor()
    m.after_schedule(live)
    live.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks = {}  # finished and freed
    m.after_step(batch({"v": [1, 0]}))  # its row, moved one block short, was read this step
    assert [(x.name, x.request) for x in m.breaks] == [("worker-row", "v")]


def test_a_block_the_scheduler_dropped_to_null_may_keep_its_old_id_in_the_worker_row():
    """A sliding-window group (the hybrid model) drops blocks that left the window to the null
    block; the worker's row keeps their old ids, which no kernel reads. Judged, they would break
    worker-row on every trace of a clean hybrid campaign."""
    a, b = Block(1, G(1)), Block(2, G(2))
    pool = Pool([a, b], {G(1): a, G(2): b})
    held = {"v": [pool.null_block, b]}
    assert monitor(pool, held, {"v": [H(2)]}, rows={"v": [7, 2]}).breaks == []
    m = monitor(pool, held, {"v": [H(2)]}, rows={"v": [7, 1]})  # a real block still must match
    assert [(x.name, x.request, x.block) for x in m.breaks] == [("worker-row", "v", 2)]


def test_a_short_count_is_latent_until_its_block_is_handed_out_again():
    """Fault U's shape: a hit takes no reference on a block in use. The short count names nothing
    alone; once the block is reallocated under the reader, the reader holds a block another
    request writes, and the count is the root of that."""
    b = Block(2, G(2), ref_cnt=1)
    pool = Pool([b], {G(2): b})
    m = monitor(pool, {"a": [b], "v": [b]}, {"a": [H(2)], "v": [H(2)]})
    assert {x.name for x in m.breaks} == {"held-block-undercounted"} and origin(m.breaks, "v") is None
    b.block_hash = None  # a finished, its last reference went; c was handed the block (evicted)
    pool.entries.clear()
    monitor(pool, {"v": [b], "c": [b]}, {"v": [H(2)], "c": [H(7)]}, step=5, m=m)
    (w,) = [x for x in m.breaks if x.request == "v" and x.name == "held-block-foreign"]
    assert w.step == 5 and w.root == "held-block-undercounted" and "also held by c" in w.detail
    assert origin(m.breaks, "v") == "held-block-undercounted"


def test_a_latent_break_of_one_cause_never_claims_the_victim_of_another():
    """T and U on at once: a victim whose count U broke first (latent: nothing wrong read yet)
    and whose row T broke later is T's, whose break is the one that made it read wrong KV."""
    breaks = [Break(step=2, name="held-block-undercounted", request="v", block=3),
              Break(step=9, name="worker-row", request="v", block=8)]
    assert origin(breaks, "v") == "worker-row"


def test_a_flipped_near_tie_on_a_request_whose_own_state_broke_is_corruption():
    """16-bit noise flips near ties; a request that holds a block of other content read wrong
    KV however small its margin, so its flip is corruption, not a near tie."""
    from test_oracle import FP32, REF, hist, rec, verdict

    near = rec("r0", [1, 7, 3, 4], margins=[1, 0.0003, 1, 1])
    assert verdict([hist([near])]).class_ == "numeric-near-tie"
    broke = Break(step=1, name="held-block-foreign", request="r0", block=3, root="held-block-undercounted")
    v = verdict([hist([near], breaks=[broke])], REF, FP32)
    assert v.class_ == "corruption" and v.evidence == ["postcondition:held-block-undercounted"]
    assert v.broke == "held-block-undercounted" and "read KV that is not its own" in v.detail
    # A latent break alone (a short count, nothing read yet) escalates nothing.
    latent = Break(step=1, name="held-block-undercounted", request="r0", block=3)
    assert verdict([hist([near], breaks=[latent])]).class_ == "numeric-near-tie"


def test_a_break_in_the_reference_run_names_the_divergence_and_the_report_says_so():
    """A fault may hit only the reference: fault V fires when a long prompt is chunked, i.e. when
    the request runs alone (its reference), not in the trace where a prefix hit spared the chunk:
    the run is right and the reference is wrong. The reference's own break names the divergence;
    a run's own break still comes first."""
    from test_oracle import hist, rec, verdict
    from test_report import finding

    from kvfuzz.present.report import markdown

    row = Break(step=1, name="worker-row", request="r0", block=65, detail="group 0 row 0: position 65 is block 65")
    ref = rec("r0", [1, 2, 3, 4]).model_copy(update={"breaks": [row]})
    v = verdict([hist([rec("r0", [1, 9, 9, 9])])], ref)
    assert v.class_ == "corruption" and v.broke == "worker-row"
    assert verdict([hist([rec("r0", [1, 9, 9, 9])])]).broke is None  # the same run, a clean reference
    own = Break(step=3, name="held-block-foreign", request="r0", block=2)
    assert verdict([hist([rec("r0", [1, 9, 9, 9])], breaks=[own])], ref).broke == "held-block-foreign"
    f = finding()
    d = f.divergences[0]
    f.references = {**f.references, d.request_id: f.references[d.request_id].model_copy(
        update={"breaks": [row.model_copy(update={"request": d.request_id})]})}
    md = markdown(f, source="f.json")
    assert "engine step `1` of its reference run (the request alone): the reference is the corrupted side" in md


def test_a_break_is_a_coverage_feature_named_by_its_root_and_a_disabled_monitor_checks_nothing():
    from kvfuzz.fuzzer.feedback import signature
    from kvfuzz.traces import History

    h = History(trace_id="t", engine="inprocess", breaks=[
        Break(step=1, name="map-entry-orphaned", block=3),
        Break(step=2, name="held-block-foreign", request="v", block=3, root="map-entry-orphaned"),
        Break(step=2, name="worker-row", request="w", block=4)])
    assert {x for x in signature(h) if x.startswith("broke:")} == {"broke:map-entry-orphaned", "broke:worker-row"}
    b = Block(2, G(9))
    pool = Pool([b], {G(1): b})
    m = Monitor(enabled=False)
    m.check(0, Scheduler(pool, {"v": [b]}, {"v": [H(1)]}), None)
    assert m.breaks == [] and monitor(pool, {"v": [b]}, {"v": [H(1)]}).breaks != []


# -- the slot mapping (worker-slot) ---------------------------------------------------------------
def test_each_token_is_written_where_its_row_says_or_its_request_and_blocks_readers_break():
    """Faults W and Z's shape: vLLM's records all agree, but a token's KV went to another slot.
    Block size 4: r (blocks 1, 2) computes positions 4..5, s (block 3) decodes position 2."""
    a, b, c = Block(1, G(1)), Block(2), Block(3)
    pool = Pool([a, b, c], {G(1): a})
    held, hashes, rows = {"r": [a, b], "s": [c]}, {"r": [H(1)], "s": []}, {"r": [1, 2], "s": [3]}
    spans = {"r": (4, 2), "s": (2, 1)}
    assert stepped(pool, held, hashes, spans, rows, [8, 9, 14]).breaks == []  # right: no break
    # r's first token (position 4, slot 8) written to slot 7: block 1's last slot, cached.
    m = stepped(pool, held, hashes, spans, rows, [7, 9, 14])
    (w,) = m.breaks
    assert (w.name, w.request, w.block) == ("worker-slot", "r", 2) and origin(m.breaks, "r") == "worker-slot"
    assert "position 4 written to slot 7 (block 1 offset 3); its row's slot is 8 (block 2 offset 0)" in w.detail
    # Later v hits block 1 in the prefix cache: it reads the KV r wrote there.
    a.ref_cnt, d = 2, Block(4)
    pool.blocks.append(d)
    stepped(pool, {"r": [a, b], "v": [a, d]}, {"r": [H(1)], "v": [H(1)]}, {"r": (6, 1), "v": (4, 1)},
            {"r": [1, 2], "v": [1, 4]}, [10, 16], step=1, m=m)
    v = [x for x in m.breaks if x.request == "v"]
    assert [(x.name, x.block) for x in v] == [("worker-slot", 1)] and "r wrote to the wrong slot at step 0" in v[0].detail
    assert origin(m.breaks, "v") == "worker-slot" and origin(m.breaks, "s") is None


def test_a_tainted_block_whose_content_was_replaced_names_no_later_holder():
    """Evicted (its hash changed) or handed out afresh (hashless, to another): its next holder
    writes it itself and reads nothing wrong."""
    a, b = Block(1, G(1)), Block(2)
    pool = Pool([a, b], {G(1): a})
    rows = {"r": [1, 2]}
    m = stepped(pool, {"r": [a, b]}, {"r": [H(1)]}, {"r": (4, 2)}, rows, [7, 9])  # taints blocks 1 and 2
    assert [x.request for x in m.breaks] == ["r"]
    a.block_hash, b.block_hash = G(5), None  # r finished; a evicted and refilled, b handed out afresh
    pool.entries.clear()
    pool.entries[G(5)] = a
    stepped(pool, {"x": [a], "y": [b]}, {"x": [H(5)], "y": []}, {"x": (0, 1), "y": (0, 1)},
            {"x": [1], "y": [2]}, [4, 8], step=3, m=m)
    assert [x.request for x in m.breaks] == ["r"]


def test_a_batch_without_a_slot_mapping_still_checks_rows_and_breaks_no_slot():
    a = Block(1, G(1))
    pool = Pool([a], {G(1): a})
    m = Monitor()
    sched = Scheduler(pool, {"t": [a]}, {"t": [H(1)]})
    sched.requests["t"].num_computed_tokens = 1
    m.check(0, sched, batch({"t": [0]}), {"t": 1})  # no slot_mapping, no req_ids: another layout
    assert [(x.name, x.request) for x in m.breaks] == [("worker-row", "t")] and not m.disabled


# -- reads of slots nothing wrote (held-block-unwritten) -----------------------------------------
def test_a_position_counted_as_computed_whose_slot_nothing_wrote_breaks_on_each_reader():
    """Fault AC's shape: a prefix hit's count claims one block more than its blocks hold, so the
    request reads a block handed out afresh that no step wrote, and so does a later hit on it.
    Block size 4: r writes its own 6 positions and reads them back (no break); s claims 0..3 on a
    block handed out to it and computes 4..5; v later hits that block."""
    a, b, c, d, e = Block(1), Block(2), Block(3, G(3)), Block(4), Block(5)
    pool = Pool([a, b, c, d, e], {G(3): c})
    m = Monitor()
    m.handed_out([a, b, c, d])
    stepped(pool, {"r": [a, b]}, {"r": []}, {"r": (0, 6)}, {"r": [1, 2]}, [4, 5, 6, 7, 8, 9], m=m)
    stepped(pool, {"r": [a, b]}, {"r": []}, {"r": (6, 1)}, {"r": [1, 2]}, [10], step=1, m=m)
    assert m.breaks == []
    stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": [H(3)]}, {"r": (7, 1), "s": (4, 2)},
            {"r": [1, 2], "s": [3, 4]}, [11, 16, 17], step=2, m=m)
    (w,) = m.breaks
    assert (w.name, w.request, w.block, w.step) == ("held-block-unwritten", "s", 3, 2), w
    assert "position 0 (block 3 offset 0) counts as computed, but nothing wrote that slot since block 3 " \
           "was handed out at step 0" in w.detail
    assert origin(m.breaks, "s") == "held-block-unwritten" and origin(m.breaks, "r") is None
    # v hits block 3 in the prefix cache (its hash is v's own): it reads the same unwritten KV.
    c.ref_cnt = 2
    m.handed_out([e])
    stepped(pool, {"s": [c, d], "v": [c, e]}, {"s": [H(3)], "v": [H(3)]}, {"s": (6, 1), "v": (4, 1)},
            {"s": [3, 4], "v": [3, 5]}, [18, 20], step=3, m=m)
    assert [(x.name, x.request, x.block) for x in m.breaks[1:]] == [("held-block-unwritten", "v", 3)]


def test_a_read_of_a_slot_its_writer_never_wrote_after_its_own_break_is_named_by_that_break():
    """w's worker row lists another block where the scheduler gave it block 2 (``worker-row``):
    its tokens never reach block 2. v, later holding block 2 (a sibling or a prefix hit), reads
    those slots unwritten: the loss is w's, so v's break is rooted in w's and names it, as a
    block computed after a writer's break does (``held-block-derived``). A reader whose block's
    writer broke nothing keeps the plain name (the test above)."""
    a, b, c = Block(1), Block(2), Block(3)
    pool = Pool([a, b, c], {})
    m = Monitor()
    m.handed_out([a, b])
    stepped(pool, {"w": [a, b]}, {"w": []}, {"w": (0, 6)}, {"w": [1, 3]}, [4, 5, 6, 7, 12, 13], m=m)
    assert [(x.name, x.request) for x in m.breaks] == [("worker-row", "w")]
    m.handed_out([c])
    stepped(pool, {"v": [b, c]}, {"v": []}, {"v": (4, 1)}, {"v": [2, 3]}, [12], step=1, m=m)
    v = next(x for x in m.breaks if x.request == "v")
    assert (v.name, v.block, v.root) == ("held-block-unwritten", 2, "worker-row"), v
    assert "to w, after its own worker-row at step 0" in v.detail
    assert origin(m.breaks, "v") == "worker-row"


def test_a_block_not_handed_out_in_the_run_or_dropped_to_null_is_not_judged_and_a_connector_turns_it_off():
    a, b = Block(1), Block(2)
    pool = Pool([a, b], {})
    # Block 1 was never seen handed out (no evidence); block 2 was, and its slots were written.
    m = Monitor()
    m.handed_out([b])
    stepped(pool, {"r": [a, b]}, {"r": []}, {"r": (4, 2)}, {"r": [1, 2]}, [8, 9], m=m)
    assert m.breaks == []
    # A sliding window dropped block 1 to the null block: its positions are not read.
    m = Monitor()
    m.handed_out([a, b])
    stepped(pool, {"r": [pool.null_block, b]}, {"r": []}, {"r": (4, 2)}, {"r": [1, 2]}, [8, 9], m=m)
    assert [x.name for x in m.breaks] == []
    # The same claim on a block handed out and never written breaks, unless a KV connector (which
    # writes outside the slot mapping) turned the check off.
    for writes, want in ((True, ["held-block-unwritten"]), (False, [])):
        m = Monitor(writes=writes)
        m.handed_out([a, b])
        stepped(pool, {"r": [a, b]}, {"r": []}, {"r": (4, 2)}, {"r": [1, 2]}, [8, 9], m=m)
        assert [x.name for x in m.breaks] == want


def test_a_block_handed_out_again_is_read_afresh_even_at_the_same_position_of_the_same_request():
    """A preempted request may be handed its own old block again at the same position (a long
    prompt preempted and resumed on its own prefix hits). What it found written before that no
    longer counts."""
    a, b, c = Block(1), Block(2), Block(3)
    pool = Pool([a, b, c], {})
    m = Monitor()
    m.handed_out([a, b])
    stepped(pool, {"r": [a, b]}, {"r": []}, {"r": (0, 8)}, {"r": [1, 2]}, list(range(4, 12)), m=m)
    m.handed_out([c])
    stepped(pool, {"r": [a, b, c]}, {"r": []}, {"r": (8, 1)}, {"r": [1, 2, 3]}, [12], step=1, m=m)
    assert m.breaks == []  # r read blocks 1 and 2 whole
    m.step = 2
    m.handed_out([b, c])  # r preempted, resumed: its count claims block 2 again, handed out afresh
    stepped(pool, {"r": [a, b, c]}, {"r": []}, {"r": (8, 1)}, {"r": [1, 2, 3]}, [12], step=2, m=m)
    assert [(x.name, x.request, x.block) for x in m.breaks] == [("held-block-unwritten", "r", 2)]


# -- rejected drafts: the token a slot was written with (held-block-token, map-entry-unbacked) ----
def spec_manager(held):
    """A full-attention group whose block size is the hash's (4): its blocks' hashes are judged."""
    return type("M", (), {"req_to_blocks": held, "block_size": 4})()


def drafted(kept: bool):
    """r (block size 4) prefills [1, 2, 3], samples 7, then computes 7 with drafts [8, 9, 10]:
    the model keeps 8 and samples 11 where 9 was. vLLM takes 9 and 10 back (``kept``: the fault
    keeps 9 counted, so its KV stays in the slot of 11, which no step computes). r goes on to 14;
    block 2 (positions 4..7) fills and is registered. The monitor, and r's blocks."""
    a, b, c = Block(1), Block(2), Block(3)
    pool = Pool([a, b, c], {}, hash_block_size=4)
    m = Monitor()
    m.handed_out([a, b])

    def step(n, held, hashes, spans, slots, tokens, drafts=None, after=None):
        stepped(pool, held, hashes, spans, {r: [x.block_id for x in bl] for r, bl in held.items() if r in spans},
                slots, step=n, m=m, manager=spec_manager(held), tokens=tokens, drafts=drafts, after=after)

    step(0, {"r": [a, b]}, {"r": []}, {"r": (0, 3)}, [4, 5, 6], {"r": [1, 2, 3]}, after={"r": (3, [1, 2, 3, 7])})
    a.block_hash = G(1)  # full once 7 is scheduled: registered by this step's schedule
    pool.entries[G(1)] = a
    seven = [1, 2, 3, 7, 8, 11]
    step(1, {"r": [a, b]}, {"r": [H(1)]}, {"r": (3, 4)}, [7, 8, 9, 10], {"r": [1, 2, 3, 7]}, drafts={"r": [8, 9, 10]},
         after={"r": (6 if kept else 5, seven)})
    if kept:  # its count is its tokens: only its next drafts are scheduled, at 6..7
        step(2, {"r": [a, b]}, {"r": [H(1)]}, {"r": (6, 2)}, [10, 11], {"r": seven}, drafts={"r": [12, 13]},
             after={"r": (8, seven + [12, 13, 14])})
    else:  # 11 computed at 5, over 9's KV
        step(2, {"r": [a, b]}, {"r": [H(1)]}, {"r": (5, 3)}, [9, 10, 11], {"r": seven}, drafts={"r": [12, 13]},
             after={"r": (8, seven + [12, 13, 14])})
    b.block_hash = G(2)  # [8, 11, 12, 13]: full, registered as 14 is scheduled
    pool.entries[G(2)] = b
    m.handed_out([c])
    step(3, {"r": [a, b, c]}, {"r": [H(1), H(2)]}, {"r": (8, 1)}, [12], {"r": seven + [12, 13, 14]})
    return m, pool, (a, b, c)


def test_a_rejected_draft_kept_counted_breaks_held_block_token_and_its_cached_block_and_a_later_hit():
    """A count that keeps a rejected draft claims the draft's KV as the KV of the token sampled
    in its place: the request breaks ``held-block-token`` as the step's output is taken in. The
    block, registered once full under the hash of the request's tokens, holds that KV
    (``map-entry-unbacked``, rooted in the writer's count), and a later prefix hit on it reads
    it (``held-block-token``, named by the same root). vLLM's own rollback breaks nothing."""
    m, _, _ = drafted(kept=False)
    assert m.breaks == []
    m, pool, (a, b, _) = drafted(kept=True)
    assert [(x.name, x.request, x.block, x.step, x.root) for x in m.breaks] == [
        ("held-block-token", "r", 2, 1, None), ("map-entry-unbacked", None, 2, 3, "held-block-token")]
    assert ("position 5 (block 2 offset 1) counts as computed after the step, but its slot's last write is the KV "
            "of token 9; the request's token there is token 11") in m.breaks[0].detail
    assert "finds block 2, whose offset 1 holds the KV of token 9; the hash covers token 11 there" in m.breaks[1].detail
    d = Block(4)
    pool.blocks.append(d)
    m.handed_out([d])
    v = [1, 2, 3, 7, 8, 11, 12, 13, 20]  # r's tokens, then its own: it hits blocks 1 and 2
    stepped(pool, {"v": [a, b, d]}, {"v": [H(1), H(2)]}, {"v": (8, 1)}, {"v": [1, 2, 4]}, [16], step=4, m=m,
            manager=spec_manager({"v": [a, b, d]}), tokens={"v": v})
    w = m.breaks[-1]
    assert (w.name, w.request, w.block, w.root) == ("held-block-token", "v", 2, "held-block-token"), w
    assert "(block 2 written by r, after its own held-block-token at step 1)" in w.detail
    assert origin(m.breaks, "v") == origin(m.breaks, "r") == "held-block-token"


def test_a_block_registered_before_its_rejected_draft_is_overwritten_breaks_map_entry_unbacked():
    """r computes 7 with drafts [8, 9]; the model keeps none and samples 11 where 8 was, which
    fills block 1 (positions 0..3). vLLM registers it as the step that computes 11 is scheduled,
    so 11's KV is in before any hit reads it; registered right away (before r's next step) it
    holds 8's KV under the hash of [1, 2, 7, 11]. r's count is right (it reads nothing wrong);
    v, whose hit on it is taken in a step r is not scheduled, reads 8's KV, named by the entry."""
    a, b, c = Block(1), Block(2), Block(3)
    pool = Pool([a, b, c], {}, hash_block_size=4)
    m = Monitor()
    m.handed_out([a, b])
    for n, spans, slots, toks, drafts, after in (
            (0, {"r": (0, 2)}, [4, 5], [1, 2], None, (2, [1, 2, 7])),
            (1, {"r": (2, 3)}, [6, 7, 8], [1, 2, 7], {"r": [8, 9]}, (3, [1, 2, 7, 11]))):
        stepped(pool, {"r": [a, b]}, {"r": []}, spans, {"r": [1, 2]}, slots, step=n, m=m,
                manager=spec_manager({"r": [a, b]}), tokens={"r": toks}, drafts=drafts, after={"r": after})
    assert m.breaks == []
    a.block_hash, a.ref_cnt = G(1), 2
    pool.entries[G(1)] = a
    m.handed_out([c])
    held = {"r": [a, b], "v": [a, c]}
    sched_tokens = {"r": [1, 2, 7, 11], "v": [1, 2, 7, 11, 20]}
    stepped(pool, held, {"r": [H(1)], "v": [H(1)]}, {"v": (4, 1)}, {"v": [1, 3]}, [12], step=2, m=m,
            manager=spec_manager(held), tokens=sched_tokens)
    assert [(x.name, x.request, x.block, x.root) for x in m.breaks] == [
        ("map-entry-unbacked", None, 1, None), ("held-block-token", "v", 1, "map-entry-unbacked")]
    assert "whose offset 3 holds the KV of token 8; the hash covers token 11 there" in m.breaks[0].detail
    assert origin(m.breaks, "v") == "map-entry-unbacked" and origin(m.breaks, "r") is None


# -- blocks read that the scheduler released (held-block-released) -------------------------------
def windowed(pool, held, spans, rows, slots, *, kind="SlidingWindowManager", window=8, step=0, m=None):
    """One step of a group of vLLM's kind ``kind`` (block size 4; hashes not checked)."""
    mgr = type(kind, (), {"req_to_blocks": held, "block_size": 4, "sliding_window": window})()
    return stepped(pool, held, {r: [] for r in held}, spans, rows, slots, step=step, m=m, manager=mgr)


def test_a_position_in_the_window_whose_block_the_scheduler_released_breaks_held_block_released():
    """Fault AD's shape: a sliding-window group releases (null in the scheduler's row) the oldest
    block still inside the window; the worker's row keeps its id and the attention reads it,
    harmlessly until another request holds it. Window 8, block size 4: the token at position 12
    attends to positions 5..12 (blocks at indices 1..3)."""
    bs = [Block(i) for i in range(1, 6)]
    pool = Pool(bs, {})
    null, rows = pool.null_block, {"r": [1, 2, 3, 4], "s": [5]}
    # Index 0 (positions 0..3) left the window: released, as vLLM does. Index 1 (positions 4..7)
    # released too early, but no one else holds block 2 yet: its content is still r's.
    for early in (False, True):
        held = {"r": [null, null if early else bs[1], bs[2], bs[3]], "s": [bs[4]]}
        assert windowed(pool, held, {"r": (12, 1), "s": (0, 1)}, rows, [16, 20]).breaks == []
    # Block 2 handed to s: r reads s's KV at positions 5..7.
    m = windowed(pool, {"r": [null, null, bs[2], bs[3]], "s": [bs[4], bs[1]]}, {"r": (12, 1), "s": (4, 1)},
                 {"r": [1, 2, 3, 4], "s": [5, 2]}, [16, 8])
    (w,) = m.breaks
    assert (w.name, w.request, w.block) == ("held-block-released", "r", 2)
    assert origin(m.breaks, "r") == "held-block-released"
    assert "position 5 (block 2) is read by the step's tokens 12..12 (window 8), but the scheduler released " \
           "that block from the request's row, and another request holds it now" in w.detail
    # A prefix hit (or external KV) skips the blocks outside the window for the hit's length: the
    # null block in both rows. One more (index 1, positions 4..7, inside the window of position
    # 12) is read as the null block's content (fault AD's shape on a prefix hit).
    for worker_row, want in (([0, 2, 3, 4], []), ([0, 0, 3, 4], [("held-block-released", "r", 0)])):
        held = {"r": [null, null if worker_row[1] == 0 else bs[1], bs[2], bs[3]]}
        m = windowed(pool, held, {"r": (12, 1)}, {"r": worker_row}, [16])
        assert [(x.name, x.request, x.block) for x in m.breaks] == want, worker_row
    assert "the scheduler gave the request the null block there (skipped as outside the window)" in m.breaks[0].detail
    # Full attention reads every earlier position; a kind of attention the check does not know
    # (chunked local, Mamba, ...) is not judged.
    held, spans, slots = {"r": [null] + bs[1:4], "s": [bs[4], bs[0]]}, {"r": (12, 1), "s": (4, 1)}, [16, 4]
    for kind, want in (("FullAttentionManager", ["held-block-released"]), ("ChunkedLocalAttentionManager", [])):
        m = windowed(pool, held, spans, {"r": [1, 2, 3, 4], "s": [5, 1]}, slots, kind=kind)
        assert [x.name for x in m.breaks] == want, kind


# -- KV computed after a request's own break (held-block-derived) --------------------------------
def test_a_block_computed_after_its_writers_break_breaks_held_block_derived_on_a_later_holder():
    """Fault AD's shape on a retry: r reads a released block another request holds
    (held-block-released), and the KV r computes from then on is wrong past the first layer. A
    retry whose prefix hit holds a block r wrote after that reads it, and is named by r's break;
    a block whose hash changed since holds new content."""
    bs = [Block(i) for i in range(1, 7)]
    pool = Pool(bs, {})
    null = pool.null_block
    # Step 0: r (window 8) reads block 2, which s holds now, and writes position 12 to block 4.
    m = windowed(pool, {"r": [null, null, bs[2], bs[3]], "s": [bs[4], bs[1]]}, {"r": (12, 1), "s": (4, 1)},
                 {"r": [1, 2, 3, 4], "s": [5, 2]}, [16, 8])
    assert [(x.name, x.request) for x in m.breaks] == [("held-block-released", "r")]
    # Step 1: block 4 filled and registered while r holds it; r's next token is block 4's too.
    bs[3].block_hash = G(9)
    windowed(pool, {"r": [null, null, bs[2], bs[3]]}, {"r": (13, 1)}, {"r": [1, 2, 3, 4]}, [17], step=1, m=m)
    assert [x.request for x in m.breaks] == ["r"]  # r itself reads its own KV: nothing new
    # Step 2: r finished; its retry v hits block 4 (and block 3, written before r broke anything).
    bs[2].block_hash = G(8)
    windowed(pool, {"v": [bs[2], bs[3], bs[5]]}, {"v": (8, 1)}, {"v": [3, 4, 6]}, [24], step=2, m=m)
    (w,) = [x for x in m.breaks if x.request == "v"]
    assert (w.name, w.block, w.root) == ("held-block-derived", 4, "held-block-released")
    assert origin(m.breaks, "v") == "held-block-released"
    assert "block 4 holds KV r computed at step 0, after its own held-block-released at step 0" in w.detail
    # Evicted and refilled (another hash): its next holder reads new content.
    bs[3].block_hash = G(7)
    windowed(pool, {"x": [bs[2], bs[3], bs[5]]}, {"x": (8, 1)}, {"x": [3, 4, 6]}, [24], step=3, m=m)
    assert not [x for x in m.breaks if x.request == "x"]


def test_a_wrong_sampled_row_derives_nothing():
    """held-block-derived's exception: a token sampled from another row is its request's alone;
    the KV it computes after it is right for the tokens it follows, so a later holder breaks
    nothing."""
    a, b, c, d = Block(1), Block(2), Block(3, G(3)), Block(4)
    pool = Pool([a, b, c, d], {})  # s's prompt goes to block 3, registered
    m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, {"r": (5, 1), "s": (0, 3)},
                {"r": [1, 2], "s": [3, 4]}, [9, 12, 13, 14], positions=torch.tensor([5, 0, 1, 2]),
                sampled=torch.tensor([0, 0]))
    assert [(x.name, x.request) for x in m.breaks] == [("worker-sample-row", "s")]
    stepped(pool, {"v": [c, d]}, {"v": []}, {"v": (4, 1)}, {"v": [3, 4]}, [16], step=1, m=m)  # v hits it
    assert [x.request for x in m.breaks] == ["s"]


# -- the token ids the model is handed (worker-token) -------------------------------------------
def test_a_token_handed_to_the_model_that_is_not_the_requests_own_breaks_worker_token():
    """Fault AL's shape (and AA's): a request added back to the batch (resumed, or left out of a
    step) keeps its row's stale token ids. Rows, slots, lengths and positions agree; the model is
    handed another token than the request's at that position. Its KV is wrong from there on, so
    a later holder of a block it wrote breaks held-block-derived, named by it."""
    a, b, c, d = Block(1), Block(2), Block(3, G(3)), Block(4)
    pool = Pool([a, b, c, d], {})
    spans = {"r": (5, 1), "s": (0, 3)}  # r decodes position 5; s's prompt, positions 0..2
    tokens = {"r": [10, 11, 12, 13, 14, 15], "s": [20, 21, 22]}
    for got, want in (([15, 20, 21, 22], []), ([15, 20, 99, 22], [("worker-token", "s")]), (None, [])):
        m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3, 4]},
                    [9, 12, 13, 14], tokens=tokens, input_ids=None if got is None else torch.tensor(got))
        assert [(x.name, x.request) for x in m.breaks] == want, got
    m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3, 4]},
                [9, 12, 13, 14], tokens=tokens, input_ids=torch.tensor([15, 20, 99, 22]))
    assert "row 1: the model is handed token 99 at position 1; the request's token there is 21" in m.breaks[0].detail
    assert origin(m.breaks, "s") == "worker-token"
    # A request whose tokens the scheduler does not list that far (speculative tokens) is skipped,
    # unless its drafts are reported: a draft is its token there (a padding draft, -1, any).
    m = stepped(pool, {"s": [c, d]}, {"s": []}, {"s": (0, 3)}, {"s": [3, 4]}, [12, 13, 14],
                tokens={"s": [20, 21]}, input_ids=torch.tensor([20, 99, 22]))
    assert m.breaks == []
    for ids, drafts, want in (([20, 21, 22], [22], []), ([20, 21, 99], [22], [("worker-token", "s")]),
                              ([20, 21, 0], [-1], [])):
        m = stepped(pool, {"s": [c, d]}, {"s": []}, {"s": (0, 3)}, {"s": [3, 4]}, [12, 13, 14],
                    tokens={"s": [20, 21]}, input_ids=torch.tensor(ids), drafts={"s": drafts})
        assert [(x.name, x.request) for x in m.breaks] == want, (ids, drafts)
    # s's block 3 (registered) holds KV computed from the wrong token: v's prefix hit reads it.
    m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3, 4]},
                [9, 12, 13, 14], tokens=tokens, input_ids=torch.tensor([15, 20, 99, 22]))
    stepped(pool, {"v": [c, d]}, {"v": []}, {"v": (4, 1)}, {"v": [3, 4]}, [16], step=1, m=m)
    (w,) = [x for x in m.breaks if x.request == "v"]
    assert (w.name, w.root) == ("held-block-derived", "worker-token") and origin(m.breaks, "v") == "worker-token"


# -- the worker's LoRA mapping (worker-adapter) ---------------------------------------------------
def test_a_row_whose_lora_mapping_is_not_its_requests_adapter_breaks_worker_adapter():
    """Fault AE's shape: a row moved by ``condense`` serves the base model. The blocks all agree;
    the worker's ``request_lora_mapping`` of the row is not the request's ``lora_int_id``."""
    a, b = Block(1), Block(2)
    pool = Pool([a, b], {})
    for got, want in (([3, 0], []), ([0, 0], [("worker-adapter", "r")])):
        sched = Scheduler(pool, {"r": [a], "s": [b]}, {"r": [], "s": []})
        sched.requests["r"].lora_request = type("L", (), {"lora_int_id": 3})()  # s: no adapter
        for r in ("r", "s"):
            sched.requests[r].num_computed_tokens = 1
        ib = batch({"r": [1], "s": [2]})
        ib.request_lora_mapping = np.array(got + [0, 0])
        m = Monitor()
        m.check(0, sched, ib, {"r": 1, "s": 1})
        assert [(x.name, x.request) for x in m.breaks] == want, got
    assert "row 0: the worker's LoRA mapping is adapter 0, the request's is 3" in m.breaks[0].detail
    assert origin(m.breaks, "r") == "worker-adapter"


# -- the kernel's sequence lengths (worker-seq-len) ------------------------------------------------
def test_a_kernel_handed_another_sequence_length_than_the_requests_breaks_worker_seq_len():
    """Fault AH's shape (one short: the decode's own newest key left out) and X's (a block more:
    past the row's end). Every block record and slot agrees; the sequence length the attention
    kernel is handed for the row is not the request's computed plus scheduled tokens."""
    a, b, c = Block(1), Block(2), Block(3)
    pool = Pool([a, b, c], {})
    spans = {"r": (5, 1), "s": (0, 3)}  # r decodes at position 5, s prefills 3 tokens
    for lens, want in (([6, 3], []), ([5, 3], [("worker-seq-len", "r")]), ([6, 7], [("worker-seq-len", "s")])):
        kernels = [type("Meta", (), {"seq_lens": np.array(lens + [0, 0])})(),  # rows past num_reqs: padding
                   type("Mamba", (), {})()]  # no seq_lens: nothing to judge
        m = stepped(pool, {"r": [a, b], "s": [c]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3]},
                    [9, 12, 13, 14], kernels=kernels)
        assert [(x.name, x.request) for x in m.breaks] == want, lens
    assert "row 1: the attention kernel is told 7 positions; the request has 3" in m.breaks[0].detail
    assert origin(m.breaks, "s") == "worker-seq-len"


# -- the model's positions (worker-position) -------------------------------------------------------
def test_a_token_handed_to_the_model_at_another_position_breaks_worker_position():
    """Fault AI's shape: a prefill that starts past position 0 is handed positions one early
    after its slots were computed. Slots, rows and lengths all agree; the positions the model
    rotates by are not the request's."""
    a, b, c, d = Block(1), Block(2), Block(3), Block(4)
    pool = Pool([a, b, c, d], {})
    spans = {"r": (5, 1), "s": (4, 3)}  # r decodes at 5; s continues its prompt at 4..6
    for got, want in (([5, 4, 5, 6], []), ([5, 3, 4, 5], [("worker-position", "s")])):
        m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3, 4]},
                    [9, 16, 17, 18], positions=torch.tensor(got + [0, 0]))
        assert [(x.name, x.request) for x in m.breaks] == want, got
    assert "row 1: the model is handed position 3 for the token at position 4" in m.breaks[-1].detail
    assert origin(m.breaks, "s") == "worker-position"


# -- the sampled row (worker-sample-row) -----------------------------------------------------------
def test_a_token_sampled_from_another_rows_hidden_state_breaks_worker_sample_row():
    """Fault AK's shape: a prefill that ends below the batch's first row is sampled from the row
    above's last token. Slots, rows, lengths and positions all agree; the hidden state its next
    token comes from is not its own last scheduled token's. No sampled rows reported
    (speculative decoding, another layout): nothing is checked."""
    a, b, c, d = Block(1), Block(2), Block(3), Block(4)
    pool = Pool([a, b, c, d], {})
    spans = {"r": (5, 1), "s": (0, 3)}  # r decodes at 5 (hidden state 0); s's prompt (1..3)
    for got, want in (([0, 3], []), ([0, 0], [("worker-sample-row", "s")]), (None, []), ([0, 3, 3], [])):
        m = stepped(pool, {"r": [a, b], "s": [c, d]}, {"r": [], "s": []}, spans, {"r": [1, 2], "s": [3, 4]},
                    [9, 12, 13, 14], positions=torch.tensor([5, 0, 1, 2]),
                    sampled=None if got is None else torch.tensor(got))
        assert [(x.name, x.request) for x in m.breaks] == want, got
        if want:
            assert ("row 1: its next token is sampled from hidden state 0 (a token of row 0); its last scheduled "
                    "token's is 3") in m.breaks[0].detail
            assert origin(m.breaks, "s") == "worker-sample-row"
    # Self-only: the wrong token is its request's alone, and the KV computed after it is right for
    # the tokens it follows, so a victim beside it that broke nothing is another cause's key.
    from kvfuzz.traces.history import SELF_ONLY_BREAKS

    assert "worker-sample-row" in SELF_ONLY_BREAKS


def test_one_table_says_what_each_break_can_harm():
    from typing import get_args

    from kvfuzz.oracle.postconditions import HARMFUL
    from kvfuzz.traces.history import BREAKS, SELF_ONLY_BREAKS, BreakName

    assert set(BREAKS) == set(get_args(BreakName))
    assert HARMFUL[:4] == ("worker-row", "worker-adapter", "worker-slot", "worker-seq-len")
    assert set(SELF_ONLY_BREAKS) == {"worker-seq-len", "worker-sample-row", "worker-sampling"}
    assert "held-block-undercounted" not in HARMFUL and "map-entry-stolen" not in HARMFUL
    # Rejected drafts: the reader's break is harmful, the cached block's latent on the map.
    assert BREAKS["held-block-token"].harm == "others" and BREAKS["map-entry-unbacked"] == ("latent", "map", False)


def test_a_finding_written_with_a_divergence_s_later_break_and_repair_still_loads():
    """Findings of an older kvfuzz kept, on a divergence, its later break and the replay that
    enforced its first one: both are read and dropped; any other unknown field is refused."""
    import json

    import pytest
    from pydantic import ValidationError

    from kvfuzz.traces import Divergence, parse_finding

    f = unexplained()
    data = json.loads(f.model_dump_json(by_alias=True))
    data["divergences"][0].update({"broke": "worker-token", "later": "worker-position",
                                   "repair": {"name": "worker-token", "outcome": "persists",
                                              "broke": "worker-position", "victim_class": "corruption"}})
    got = parse_finding(data).divergences[0]
    assert got.broke == "worker-token" and "later" not in got.model_dump() and "repair" not in got.model_dump()
    with pytest.raises(ValidationError):
        Divergence.model_validate({**data["divergences"][0], "unknown": 1})
