"""The post-conditions on the real CPU engine: faults kvfuzz has never seen break the
post-condition of the operation they corrupt (harness/postconditions.py). Four faults on at once
(tests/unseen_faults/, ``faults_on``: in this process, on an engine started under them and
closed with them, never one of the test run's shared engines): P (an eviction that leaves the
prefix-cache entry), T (a persistent-batch row move that drops a block id) and U (a prefix hit
that takes no reference on a block in use), each named on its own victims, and V (an append to
a non-empty row that repeats its first id), in a reference run. The clean side (no break on
unmodified vLLM) is tests/test_engine.py, and, after a fault went off, the shared engine of the
same configuration here (test_a_fault_is_off_again_once_its_context_exits)."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import pytest
import unseen_faults
from unseen_faults import faults_on

from kvfuzz.fuzzer.generate import GenOptions, default_engine, generate
from kvfuzz.harness.inprocess import STALL_STEPS
from kvfuzz.traces import At, GenPrompt, SendEvent, Trace, load_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # each test starts an engine of its own, under its faults

TESTS = Path(__file__).parent


def judged(eng, sends, victim):
    """A witness run against its victim alone: the run's breaks, whether the victim diverged from
    its reference (alone), and what that reference run broke."""
    h = eng.replay(Trace(engine=eng.config, events=sends))
    alone = eng.run_alone(next(x for x in sends if x.request_id == victim))
    return {"breaks": [[b.name, b.request, b.detail] for b in h.breaks],
            "diverged": alone.token_ids != h.requests[victim].token_ids,
            "ref_breaks": [b.name for b in alone.breaks]}


def _four_faults_run():
    with faults_on("evict_keeps_hash", "row_move_drops_last_block", "hit_takes_no_reference",
                   "append_repeats_first_block") as on:
        eng = on.engine(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000))
        cfg = eng.config
        # The KV schedules these seeds draw (random-v2: no per-request state, one engine).
        plain = GenOptions(request_state=0.0, p_priority=0.0, p_embeds=0.0, p_spec=0.0, p_reset=0.0)
        runs = []
        for seed in (1, 4):
            h = eng.replay(generate(seed, cfg, plain))
            runs.append([b.model_dump(mode="json") for b in h.breaks])
        # V: a prompt one token budget plus two blocks long is prefilled in two chunks when it
        # runs alone, and the second chunk appends two blocks to a non-empty row: the reference
        # breaks.
        n = cfg.max_num_batched_tokens + 2 * cfg.block_size
        ref = eng.run_alone(SendEvent(request_id="long", at=At(step=0), max_tokens=2,
                                      prompt=GenPrompt(length=n, seed=3)))
        return runs, [b.model_dump(mode="json") for b in ref.breaks]


def test_four_unseen_faults_each_break_their_own_post_condition():
    runs, ref = _four_faults_run()
    names = {b["name"] for run in runs for b in run}
    # T: a moved row is not the scheduler's; P: the allocator's map keeps an entry of a reused
    # block; U: a block is held by more requests than reference it.
    assert {"worker-row", "map-entry-orphaned", "held-block-undercounted"} <= names, names
    # Nothing else is broken by these faults: no stolen entries.
    assert names <= {"worker-row", "map-entry-orphaned", "held-block-undercounted", "held-block-foreign",
                     "held-block-repeated", "held-block-unwritten", "held-block-derived", "held-block-token",
                     "map-entry-unbacked"}, names
    # A row that sends a token's KV into another block (T, V) leaves there another position's
    # token: its block, cached, and who counts that slot, are named by the row's break (or by the
    # block's own latent break, on a hit).
    for run in runs:
        for b in run:
            if b["name"] in ("held-block-token", "map-entry-unbacked"):
                rows_before = [x for x in run if x["name"] == "worker-row" and x["step"] <= b["step"]]
                assert b["root"] in ("map-entry-orphaned", "held-block-undercounted") or (
                    b["root"] == "worker-row" and rows_before), (b, run)
    # A later holder of a block a victim computed after its break reads KV derived from it
    # (held-block-derived), named by that victim's break.
    derived = [b for run in runs for b in run if b["name"] == "held-block-derived"]
    assert all(b["root"] in ("worker-row", "map-entry-orphaned", "held-block-undercounted") for b in derived), derived
    # A slot left unwritten here is a consequence: T's, read a step after its row broke (the
    # worker wrote the dropped block's tokens elsewhere; the row stays the request's name), or
    # a block handed out afresh while its reader held it (U's short count, P's stale entry),
    # named by that latent break like a foreign block.
    # (Another reader of such a block is named by the writer's row break.)
    for run in runs:
        for b in run:
            if b["name"] == "held-block-unwritten":
                rows_before = [x for x in run if x["name"] == "worker-row" and x["step"] <= b["step"]]
                assert b["root"] in ("map-entry-orphaned", "held-block-undercounted") or (
                    b["root"] == "worker-row" and rows_before) or any(
                    x["request"] == b["request"] and x["step"] < b["step"] for x in rows_before), (b, run)
    # A victim that read a block of other content is traced back to the latent break of that
    # block (P's orphaned entry, U's short count), never to T (a row, not a block record).
    foreign = [b for run in runs for b in run if b["name"] == "held-block-foreign"]
    assert all(b["root"] in ("map-entry-orphaned", "held-block-undercounted") for b in foreign), foreign
    assert {b["root"] for run in runs for b in run if b["request"] and b["name"] not in (
        "held-block-derived", "held-block-unwritten", "held-block-token")} <= {None, "map-entry-orphaned",
                                                                               "held-block-undercounted"}
    # V: a reference run records the breaks on its own request.
    # (Its row's repeated id sent the new block's tokens elsewhere: over the first new block's,
    # whose slot then holds another token's KV as the step ends, and read unwritten a step later.)
    assert [(b["name"], b["request"]) for b in ref if b["name"] not in ("held-block-unwritten", "held-block-token")] \
        == [("worker-row", "long")], ref
    assert all(b["request"] == "long" and (b["step"] > ref[0]["step"] or b["name"] == "held-block-token")
               and b["root"] in (None, "worker-row") for b in ref[1:]), ref


def _wz_witnesses():
    with faults_on("new_block_slot_in_previous", "chunk_start_slot_before") as on:
        eng = on.engine(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000))
        out = {}
        for name, sends in {
            # W: two short prompts decode together and open new blocks at position 32.
            "decode": [SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=40,
                                 prompt=GenPrompt(length=20 + 7 * i, seed=i)) for i in range(2)],
            # Z: a long prompt prefilled in chunks beside a decode; its second chunk starts past 0.
            "chunk": [SendEvent(request_id="r0", at=At(step=0), max_tokens=40, prompt=GenPrompt(length=30, seed=0)),
                      SendEvent(request_id="r1", at=At(step=2), max_tokens=20,
                                prompt=GenPrompt(length=3000, seed=1))]}.items():
            h = eng.replay(Trace(engine=eng.config, events=sends))
            alone = {s.request_id: eng.run_alone(s) for s in sends}
            out[name] = {"breaks": [[b.name, b.request, b.detail, b.step] for b in h.breaks],
                         "diverged": sorted(r for r in alone if alone[r].token_ids != h.requests[r].token_ids),
                         "ref_breaks": sorted(b.name for r in alone.values() for b in r.breaks)}
        return out


def test_a_token_written_to_another_slot_breaks_worker_slot_on_its_request():
    """Faults W and Z (the worker's slot mapping) leave every record of vLLM's in agreement; only
    where a token's KV was written is wrong. W: a decode token that opens a new block goes to
    offset 0 of the block before; Z: a continuing chunk's first token goes to the slot before it.
    Both victims of each trace break ``worker-slot`` at that token, and the references (each
    request alone: not hit) break nothing. The clean side (no break on unmodified vLLM) is
    tests/test_engine.py."""
    got = _wz_witnesses()
    for trace in got.values():
        assert trace["diverged"] == ["r0", "r1"] and trace["ref_breaks"] == [], got
        slot = sorted((r, step) for name, r, _, step in trace["breaks"] if name == "worker-slot")
        assert [r for r, _ in slot] == ["r0", "r1"], got
        # Each writer left its row's slot unwritten and reads it at a later step: a consequence,
        # after its slot break, which stays its name.
        assert all(name == "worker-slot" or (name == "held-block-unwritten" and step > dict(slot)[r])
                   for name, r, _, step in trace["breaks"]), got
    decode = dict((r, d) for name, r, d, _ in got["decode"]["breaks"] if name == "worker-slot")
    assert all("position 32 written to slot" in d and "offset 0); its row's slot" in d for d in decode.values()), decode
    chunk = next(d for name, r, d, _ in got["chunk"]["breaks"] if r == "r1" and name == "worker-slot")  # Z: the slot just before
    m = re.search(r"written to slot (\d+) .*its row's slot is (\d+)", chunk)
    assert m and int(m[1]) == int(m[2]) - 1, chunk


def test_a_hit_that_counts_a_block_it_does_not_hold_breaks_held_block_unwritten():
    """Fault AC: a prefix hit of two blocks or more counts one block more, whose KV no step
    computes. No record of vLLM's disagrees; the request reads a slot nothing wrote since its
    block was handed out. Its reference (alone: no hit) breaks nothing. The clean side is
    tests/test_engine.py."""
    with faults_on("hit_counts_one_block_more") as on:
        eng = on.engine(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000))
        bs = eng.config.block_size
        # r0 fills three blocks of a shared prefix; r1 then hits them and its count claims a fourth.
        sends = [SendEvent(request_id=f"r{i}", at=At(step=20 * i), max_tokens=8,
                           prompt=GenPrompt(length=6 * bs + 5, prefix_group="p", prefix_len=3 * bs + 3, seed=i))
                 for i in range(2)]
        got = judged(eng, sends, "r1")
    assert [(name, r) for name, r, _ in got["breaks"]] == [("held-block-unwritten", "r1")], got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "position 96 (block" in got["breaks"][0][2] and "offset 0) counts as computed" in got["breaks"][0][2], got


def test_a_window_block_released_early_and_handed_to_another_breaks_held_block_released():
    """Fault AD: the sliding window releases its oldest block one block early. The scheduler's
    records agree; the worker's row still lists the block, and once another request holds it the
    window reads that request's KV. The reference (alone: the block stays unused) breaks nothing."""
    regression = TESTS.parent / "traces" / "regressions" / "vllm-44409-cross-group-external.json"
    with faults_on("window_drops_one_block_early") as on:
        eng = on.engine(load_trace(regression).engine)  # the hybrid model's configuration (127 blocks)
        # x.r6 decodes past its window (128) while four prompts arrive and take the free blocks:
        # a minimized campaign witness of AD (found in bfloat16, run in float32 here).
        spec = [("x.r6", 0, 384, 141975695, 17), ("r0", 7, 410, 324464274, 8), ("r1", 7, 477, 269801985, 8),
                ("r3", 7, 342, 453936934, 1), ("r2", 9, 446, 41130535, 6)]
        sends = [SendEvent(request_id=r, at=At(step=s), max_tokens=m, prompt=GenPrompt(length=n, seed=seed))
                 for r, s, n, seed, m in spec]
        # r1_retry's prompt is r1's and one token more; its hit (the external KV r1 stored) skips
        # the blocks outside the window, and AD one block inside it: a minimized campaign witness
        # of AD's second path (found in bfloat16, run in float32 here).
        hit = [SendEvent(request_id=r, at=At(step=0), max_tokens=m,
                         prompt=GenPrompt(length=n, prefix_group="g2227455224-0", prefix_len=127, seed=260254882))
               for r, n, m in (("r1", 160, 1), ("r1_retry", 161, 3))]
        both = {"window": judged(eng, sends, "x.r6"), "hit": judged(eng, hit, "r1_retry")}
    got = both["window"]
    assert ("held-block-released", "x.r6") in [(name, r) for name, r, _ in got["breaks"]], got
    assert {name for name, _, _ in got["breaks"]} == {"held-block-released"}, got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "(window 128), but the scheduler released that block" in got["breaks"][0][2], got
    # A hit whose blocks AD skips one too many: the null block read inside the window.
    hit = both["hit"]
    assert [(name, r) for name, r, _ in hit["breaks"]] == [("held-block-released", "r1_retry")], hit
    assert hit["diverged"] and hit["ref_breaks"] == [], hit
    assert "the scheduler gave the request the null block there" in hit["breaks"][0][2], hit


def _lora_engine_config():
    base = default_engine(kv_cache_bytes=24 * 2**20)
    return type(base).model_validate({**base.model_dump(), "lora": {
        "enabled": True, "adapters": {"a": "embedded:a", "b": "embedded:b"}, "max_loras": 1}})


def test_a_moved_row_that_loses_its_adapter_breaks_worker_adapter():
    """Fault AE: a row moved by ``condense`` loses its LoRA adapter, so the moved request's next
    token comes from the base model. Every block record agrees; the worker's LoRA mapping of the
    row is not the request's adapter. The reference (alone: never moved) breaks nothing."""
    with faults_on("moved_row_drops_adapter", "prefill_first_token_neighbours_adapter") as on:
        eng = on.engine(_lora_engine_config())
        # r0 ends at step 4 and leaves row 0; r6 (adapter a) is moved there by condense. A
        # minimized campaign witness of AE.
        sends = [SendEvent(request_id="r0", at=At(step=0), max_tokens=5, prompt=GenPrompt(length=1, seed=369101016)),
                 SendEvent(request_id="r6", at=At(step=4), max_tokens=2, prompt=GenPrompt(length=1, seed=730724908),
                           adapter="a")]
        # Fault AM's witness (beside AE, which moves r1's row, but r1 has no adapter to drop):
        # r1's prompt is prefilled in row 1 while r0 (adapter a) decodes in row 0, so its first
        # token runs through adapter a. A minimized campaign witness of AM.
        am = [SendEvent(request_id="r0", at=At(step=2), max_tokens=17, adapter="a",
                        prompt=GenPrompt(length=63, prefix_group="g0", prefix_len=32, seed=783703631)),
              SendEvent(request_id="r1", at=At(step=5), max_tokens=18,
                        prompt=GenPrompt(length=255, prefix_group="g0", prefix_len=65, seed=591025858))]
        got = {**judged(eng, sends, "r6"), "am": judged(eng, am, "r1")}
    assert [(name, r) for name, r, _ in got["breaks"]] == [("worker-adapter", "r6")], got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "the worker's LoRA mapping is adapter 0, the request's is" in got["breaks"][0][2], got
    # Fault AM (on beside AE, which has no adapter to drop here) breaks nothing: its
    # victim diverges unnamed, apart from AE's worker-adapter victims.
    assert got["am"]["breaks"] == [] and got["am"]["diverged"], got


def test_a_request_the_engine_schedules_forever_is_a_hang_after_stall_steps_not_the_step_budget():
    """Fault AF: a row moved by ``condense`` gets its computed-token count one short for a step;
    the moved request then never produces another token, and without a stall check every such
    trace runs to its step budget (tens of thousands of steps). The replay calls it a hang after
    ``STALL_STEPS`` steps in a row that scheduled nothing or decodes only and produced no token.
    The engine answered every step, so ``recover`` keeps it."""
    with faults_on("moved_row_count_one_short") as on:
        eng = on.engine(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000))
        cfg = eng.config
        # r0 ends after 3 tokens and leaves row 0; r1 is moved there, one token short: it never
        # produces another token.
        sends = [SendEvent(request_id="r0", at=At(step=0), max_tokens=3, prompt=GenPrompt(length=20, seed=1)),
                 SendEvent(request_id="r1", at=At(step=0), max_tokens=40, prompt=GenPrompt(length=20, seed=2))]
        h = eng.replay(Trace(engine=cfg, events=sends))
        # The engine answered every step: it is kept, and runs the next trace as a fresh one would.
        kept = eng.recover()
        one = SendEvent(request_id="r2", at=At(step=0), max_tokens=6, prompt=GenPrompt(length=20, seed=3))
        after = eng.replay(Trace(engine=cfg, events=[one]))
        got = {"crash": [h.crashed, h.crash_kind, h.crash_detail], "steps": len(h.steps), "stall": STALL_STEPS,
               "kept": kept, "after": [after.crashed, [b.name for b in after.breaks]],
               "right": after.requests["r2"].token_ids == eng.run_alone(one).token_ids, "again": eng.recover()}
    assert got["crash"][:2] == [True, "hang"], got
    assert f"hang: {got['stall']} engine steps in a row" in got["crash"][2], got
    assert got["steps"] < got["stall"] + 20, got
    # Kept in place (no close and start per hang), and clean: the next trace runs right. A
    # second recovery without a hang since is refused.
    assert got["kept"] is True and got["after"] == [False, []] and got["right"], got
    assert got["again"] is False, got


def test_a_kernel_told_one_position_short_breaks_worker_seq_len():
    """Fault AH: in a batch that mixes a prefill with decodes, each decode's kernel is handed a
    sequence length one short. No block record or slot changes; the kernel's length for the
    decode's row is not the request's computed plus scheduled tokens. The reference (alone: never
    beside a prefill) breaks nothing."""
    with faults_on("mixed_decode_misses_own_key") as on:
        eng = on.engine(default_engine(kv_cache_bytes=24 * 2**20))
        # r0 decodes its second token while r1's prompt is prefilled beside it: a minimized
        # campaign witness of AH.
        sends = [SendEvent(request_id="r0", at=At(step=0), max_tokens=2,
                           prompt=GenPrompt(length=63, prefix_group="g287602570-0", prefix_len=32, seed=783703631)),
                 SendEvent(request_id="r1", at=At(step=1), max_tokens=1, prompt=GenPrompt(length=3, seed=591025858))]
        got = judged(eng, sends, "r0")
    assert [(name, r) for name, r, _ in got["breaks"]] == [("worker-seq-len", "r0")], got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "the attention kernel is told" in got["breaks"][0][2], got


@pytest.mark.parametrize("engine", ["ids", "embeds"])
def test_a_request_added_back_with_stale_token_ids_breaks_worker_token(engine):
    """Fault AL: a request added back to the persistent batch keeps its row's stale token ids
    where its output tokens belong. Every record, slot, length and position agrees; the model is
    handed another token than the request's own. The reference (alone: never preempted) breaks
    nothing. An engine that takes prompt embeddings embeds its token-id positions from the same
    ids: the check reads those."""
    with faults_on("readded_row_keeps_stale_tokens") as on:
        eng = on.engine(default_engine(kv_cache_bytes=2**20, max_model_len=960,  # 31 blocks of 32 tokens
                                       enable_prompt_embeds=engine == "embeds"))
        # h and v decode together until the cache is full: v (the latest) is preempted, and
        # resumes in h's row once h is done, with its output tokens to recompute over h's stale ones.
        sends = [SendEvent(request_id="h", at=At(step=0), max_tokens=450, prompt=GenPrompt(length=300, seed=1)),
                 SendEvent(request_id="v", at=At(step=2), max_tokens=250, prompt=GenPrompt(length=300, seed=2))]
        got = judged(eng, sends, "v")
    assert [(name, r) for name, r, _ in got["breaks"]] == [("worker-token", "v")], got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "row 0: the model is handed token" in got["breaks"][0][2] and "at position 300;" in got["breaks"][0][2], got


@pytest.fixture(scope="module")
def ai_and_ak() -> dict:
    """One engine with faults AI and AK on: AK's witness, then (AK off) AI's."""
    with faults_on("continuing_prefill_positions_early", "prefill_samples_neighbours_row") as on:
        eng = on.engine(default_engine(kv_cache_bytes=24 * 2**20))
        # AK (on beside AI; AI leaves it alone: no prefill here starts past position 0): r0
        # decodes in row 0 while r1's whole prompt is prefilled in row 1, so r1's first token is
        # sampled from r0's row. Then AK goes off in this engine (it would fire on AI's witnesses).
        ak = [SendEvent(request_id="r0", at=At(step=0), max_tokens=4, prompt=GenPrompt(length=40, seed=783703631)),
              SendEvent(request_id="r1", at=At(step=1), max_tokens=3, prompt=GenPrompt(length=20, seed=591025858))]
        out = {"ak": judged(eng, ak, "r1")}
        on.off("prefill_samples_neighbours_row")
        # AI's two minimized campaign witnesses: a prompt's second chunk (r5, 2,062 tokens at a
        # 2,048-token budget) and a prompt's rest after a prefix hit (r1). One engine replays all
        # three (its start is most of the fixture's time).
        g = "g287602570-0"
        witnesses = {
            "chunk": ([SendEvent(request_id="r5", at=At(step=0), max_tokens=1,
                                 prompt=GenPrompt(length=2062, seed=366583219)),
                       SendEvent(request_id="r6", at=At(step=0), max_tokens=1,
                                 prompt=GenPrompt(length=1, seed=306567052))],
                      "r5"),
            "hit": ([SendEvent(request_id="r0", at=At(step=0), max_tokens=2,
                               prompt=GenPrompt(length=32, prefix_group=g, prefix_len=32, seed=783703631)),
                     SendEvent(request_id="r1", at=At(step=0), max_tokens=3,
                               prompt=GenPrompt(length=34, prefix_group=g, prefix_len=32, seed=591025858))],
                    "r1"),
        }
        out.update({path: judged(eng, sends, victim) for path, (sends, victim) in witnesses.items()})
        return out


def test_a_prefill_handed_positions_one_early_breaks_worker_position(ai_and_ak):
    """Fault AI: a prefill that starts past position 0 is handed positions one early after its
    slots were computed. Its two kinds of witness (a later chunk; the rest after a prefix hit)
    both break ``worker-position``; the reference (alone) breaks nothing."""
    for path, victim in (("chunk", "r5"), ("hit", "r1")):
        got = ai_and_ak[path]
        assert [(name, r) for name, r, _ in got["breaks"]] == [("worker-position", victim)], (path, got)
        assert got["diverged"] and got["ref_breaks"] == [], (path, got)
        assert "the model is handed position" in got["breaks"][0][2], (path, got)


def test_a_prefill_sampled_from_the_row_above_breaks_worker_sample_row(ai_and_ak):
    """Fault AK: a prefill that ends below the batch's first row samples its first token from the
    row above's hidden state. Its blocks, slots, lengths and positions are right; only the
    sampled row is not its own. The reference (alone) breaks nothing."""
    got = ai_and_ak["ak"]
    assert [(name, r) for name, r, _ in got["breaks"]] == [("worker-sample-row", "r1")], got
    assert got["diverged"] and got["ref_breaks"] == [], got
    assert "row 1: its next token is sampled from hidden state 0 (a token of row 0)" in got["breaks"][0][2], got


def test_a_rejected_draft_kept_counted_breaks_held_block_token_and_map_entry_unbacked():
    """Fault AV: the scheduler takes a request's rejected drafts back one short, so the first
    rejected draft's KV stays counted as the KV of the token sampled in its place. Every record
    agrees; the request breaks ``held-block-token`` as that step's output is taken in, its block
    breaks ``map-entry-unbacked`` once full and registered (rooted in that count), and a later
    request whose prefix hit reads the block breaks ``held-block-token``, named by the same
    root. The clean side (drafts accepted and rejected, no break) is test_speculative_engine.py."""
    from kvfuzz.traces import Sampling, Speculative, TokenPrompt

    with faults_on("rejected_draft_stays_counted") as on:
        eng = on.engine(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096).model_copy(
            update={"speculative": Speculative(num_speculative_tokens=3, prompt_lookup_max=3)}))
        cfg = eng.config
        # Two allowed tokens, both in the prompt: a drafts from its first token on, and some
        # drafts are rejected. b, sent once a is done, is a's prompt and output: its prefix hit
        # reads a's blocks.
        a = SendEvent(request_id="a", at=At(step=0), max_tokens=48, sampling=Sampling(allowed_token_ids=[5, 9]),
                      prompt=TokenPrompt(token_ids=[(7 * i + 3) % 500 + 1 for i in range(38)] + [5, 9]))
        alone_h = eng.replay(Trace(engine=cfg, events=[a]))
        r = alone_h.requests["a"]
        b = SendEvent(request_id="b", at=At(step=r.finished_step + 1), max_tokens=4,
                      prompt=TokenPrompt(token_ids=a.prompt.token_ids + r.token_ids[:40]))
        both_h = eng.replay(Trace(engine=cfg, events=[a, b]))
        got = {"runs": [[[x.name, x.request, x.block, x.root, x.step, x.detail] for x in h.breaks]
                        for h in (alone_h, both_h)],
               "rejected": sum(s.draft_tokens - s.accepted_tokens for s in alone_h.steps),
               "same": both_h.requests["a"].token_ids == r.token_ids,
               "b": [both_h.requests["b"].num_cached_tokens, min(s.step for s in both_h.steps if "b" in s.scheduled)]}
    alone, both = got["runs"]
    assert got["rejected"] > 0 and got["same"], got
    assert [(name, req, root) for name, req, _, root, _, _ in alone] == [
        ("held-block-token", "a", None), ("map-entry-unbacked", None, "held-block-token")], alone
    assert "counts as computed after the step, but its slot's last write is the KV of token" in alone[0][5], alone
    assert alone[1][2] == alone[0][2] and alone[1][4] > alone[0][4], alone  # a's block, registered later
    assert both[:2] == alone, both
    # b reads the draft's KV at its first step, and the KV a computed after it (held-block-derived):
    # both on a's block, both named by a's count.
    cached, first = got["b"]
    hit = {name: (block, root, step, detail) for name, req, block, root, step, detail in both if req == "b"}
    assert cached >= 64 and set(hit) == {"held-block-token", "held-block-derived"}, both
    assert all(x[:3] == (alone[0][2], "held-block-token", first) for x in hit.values()), hit
    assert "(block %d written by a, after its own held-block-token at step" % alone[0][2] in hit["held-block-token"][3]


# -- faults on and off in this process (tests/unseen_faults/, ``faults_on``) --------------------


def _decode_pair(max_tokens=40):
    """Two short prompts that decode together and open new blocks at position 32 (W's witness)."""
    return [SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=max_tokens,
                      prompt=GenPrompt(length=20 + 7 * i, seed=i)) for i in range(2)]


def test_a_fault_is_off_again_once_its_context_exits(session):
    """Fault W on, in this process, on an engine of its own; once its context exits, the test
    run's shared engine of the same configuration (started before, set aside meanwhile) replays
    the same witness with no break, every request as its reference. With the fault left on, the
    shared engine would break ``worker-slot`` on both requests, as the faulted one does."""
    from vllm.v1.worker.block_table import BlockTable

    from kvfuzz.harness.inprocess import engine_pool

    cfg = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000)
    trace = Trace(engine=cfg, events=_decode_pair())
    shared = session.engine_for(cfg)
    vllm_own = vars(BlockTable)["compute_slot_mapping"]
    with faults_on("new_block_slot_in_previous") as on:
        eng = on.engine(cfg)
        # Under the fault the pool hands out only the fault's engine, and the shared one, started
        # before, may not run (it would carry the fault's state back into the pool).
        assert eng is not shared and engine_pool().acquire(cfg, device="cpu", log_file=None,
                                                           trace_deadline_s=None) is eng
        with pytest.raises(RuntimeError, match="started before the faults"):
            shared.replay(trace)
        faulted = eng.replay(trace)
        assert sorted(b.request for b in faulted.breaks if b.name == "worker-slot") == ["r0", "r1"], faulted.breaks
    assert eng._llm is None  # closed with the fault, never pooled
    assert vars(BlockTable)["compute_slot_mapping"] is vllm_own
    assert session.engine_for(cfg) is shared  # the pool kept it
    h = shared.replay(trace)
    assert h.breaks == [], h.breaks
    assert {r: h.requests[r].token_ids for r in ("r0", "r1")} == {
        s.request_id: shared.run_alone(s).token_ids for s in trace.events}
    assert all(h.requests[r].token_ids != faulted.requests[r].token_ids for r in ("r0", "r1"))


def _fault_names():
    return sorted(m.name for m in pkgutil.iter_modules(unseen_faults.__path__))


def test_every_unseen_fault_goes_off_exactly():
    """Each fault of tests/unseen_faults/ switched on in this process patches something, and when
    its context exits every attribute it patched is again the owner's own entry of before (or
    none, where it was inherited), and the engine guard is gone: nothing is left on."""
    from kvfuzz.harness.inprocess import EnginePool, InProcessEngine, engine_pool

    engine_own = dict(vars(InProcessEngine))
    pool = engine_pool()
    pool_own = dict(vars(pool)) if pool is not None else None
    names = _fault_names()
    assert {"evict_keeps_hash", "hash_covers_half_block", "hit_takes_no_reference"} <= set(names), names
    for name in names:
        with faults_on(name) as on:
            patched = on.patches(name)
            assert patched, name
            for p in patched:
                assert vars(p.owner)[p.name] is p.replacement and p.replacement.__unseen_tag__, (name, p)
            assert vars(InProcessEngine)["replay"] is not engine_own["replay"]
            with faults_on(name) as again:  # already on: nothing more to patch, nothing to undo
                assert again.patches(name) == []
            assert all(vars(p.owner)[p.name] is p.replacement for p in patched), name
        for p in patched:
            assert vars(p.owner).get(p.name, "absent") is (p.before if p.before is not unseen_faults._ABSENT
                                                            else "absent"), (name, p)
            assert not hasattr(getattr(p.owner, p.name), "__unseen_tag__"), (name, p)
        assert dict(vars(InProcessEngine)) == engine_own, name
        assert pool is None or dict(vars(pool)) == pool_own, name
    assert pool is None or isinstance(pool, EnginePool)


def test_a_fault_patched_over_while_on_fails_its_exit_loudly():
    """A patch made over a fault's while it is on (a toggle installed meanwhile) cannot be undone
    exactly: the exit says so and leaves that attribute as it is, rather than drop the other
    patch or leave the fault on silently. Another fault goes off alone, mid-context."""
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_move, vllm_prepare = vars(BlockTable)["move_row"], vars(GPUModelRunner)["_prepare_inputs"]
    with pytest.raises(RuntimeError, match=r"BlockTable.move_row was replaced again while the fault was on"):
        with faults_on("row_move_drops_last_block", "prefill_samples_neighbours_row") as on:
            on.off("prefill_samples_neighbours_row")
            assert vars(GPUModelRunner)["_prepare_inputs"] is vllm_prepare
            faulted = vars(BlockTable)["move_row"]
            over = lambda self, src, tgt: faulted(self, src, tgt)  # noqa: E731
            BlockTable.move_row = over
    try:
        assert vars(BlockTable)["move_row"] is over
    finally:
        BlockTable.move_row = vllm_move
