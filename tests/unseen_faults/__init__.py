"""Faults kvfuzz has never seen: vLLM patches that no built-in toggle implements, installed in
every vLLM process through ``KVFUZZ_PLUGIN_MODULES`` (harness/toggles/plugin.py). Once installed
a fault is always on: to kvfuzz it is a vLLM bug that no toggle explains, as a user's own bug
would be. They try the oracle, the post-conditions and the bucket rule on corruption those were
not written for. Run one, or several separated by commas::

    PYTHONPATH=tests KVFUZZ_PLUGIN_MODULES=unseen_faults.evict_keeps_hash kvfuzz run ...

(docs/benchmarks.md, "Buckets on faults kvfuzz has never seen": the full command and each
fault's buckets). One entry per module: its letter, the vLLM component it breaks and how, and
the post-condition (harness/postconditions.py) that names its victims; a fault that breaks none
is keyed by the ablation's verdict. Each leaves a request alone unhit (most fire only in a
batch of two requests or more), so its reference, the same request alone, stays right.

- P ``evict_keeps_hash`` (the allocator): reusing a free block drops its hash metadata but leaves
  the prefix-cache map pointing at it. Names its victims: ``map-entry-orphaned``.
- Q ``short_hash_lookup`` (the prefix-cache lookup): a lookup miss falls back to a cached block
  whose hash agrees in its first 8 bits. ``held-block-foreign``.
- R ``hit_last_block_repeated`` (the prefix-cache hit's block list): a hit of two blocks or more
  lists its second-to-last block twice, its last never. ``held-block-foreign``.
- S ``register_overwrites`` (prefix-cache registration): a block registered right after another
  in one request's registration also takes over the earlier block's hash (when its own hash's
  first byte is a multiple of 4). ``map-entry-stolen``.
- T ``row_move_drops_last_block`` (the worker's persistent-batch block table): a row moved by
  ``InputBatch.condense`` keeps its length but loses its last block id. ``worker-row``.
- U ``hit_takes_no_reference`` (a prefix hit's reference count): a request whose hit ends on a
  block another running request holds takes no reference on it; the block is freed under it and
  handed to another request while it still reads it. ``held-block-undercounted`` (it needs KV
  pressure: a small KV cache).
- V ``append_repeats_first_block`` (the persistent batch's block table on append): two or more
  block ids appended to a non-empty row are written with the first one twice. ``worker-row``.
- W ``new_block_slot_in_previous`` (the worker's slot mapping): in a batch of two requests or
  more, a decode token that opens a new block is written to offset 0 of the request's previous
  block. ``worker-slot``.
- X ``decode_reads_past_row_end`` (the CPU attention metadata): in a batch of two requests or
  more, a decode whose context fills its last block exactly attends one block past its row's end
  (a stale block-table entry). ``worker-seq-len``; it may flip no token (its drift is measured:
  tests/test_explain_engine.py).
- Y ``decode_reads_neighbours_last_block`` (the CPU attention metadata's block table): in a batch
  of two or more, a decode whose last block is full reads that block from the row above (another
  request's KV). None.
- Z ``chunk_start_slot_before`` (the worker's slot mapping for prefills): in a batch of two or
  more, a prefill that starts past position 0 (a continuing chunk, or after a prefix-cache hit)
  writes its first token's KV into the slot before it. ``worker-slot``.
- AA ``moved_row_keeps_stale_last_token`` (the persistent batch's token ids): a row moved by
  ``InputBatch.condense`` is copied one token short, so its next decode feeds the model the
  departed request's token: wrong KV content in correctly recorded blocks. None in
  docs/benchmarks.md's runs; the token it feeds is the shape ``worker-token`` checks.
- AB ``hash_covers_half_block`` (the prefix cache's block hash): a full block's hash covers only
  the first half of its tokens, so prompts that agree up to a block's middle share the block.
  Requests' and blocks' hashes agree (both wrong alike). None.
- AC ``hit_counts_one_block_more`` (the prefix-cache hit's token count): a hit of two blocks or
  more reports one block more computed tokens than its blocks hold; that block's KV is never
  computed, and it is registered in the prefix cache for later hits. ``held-block-unwritten``.
- AD ``window_drops_one_block_early`` (the sliding window's block release; the hybrid model
  only): once the window slides, the oldest block still inside it is freed too, while the
  request's next tokens attend to it through the worker's row. ``held-block-released``.
- AE ``moved_row_drops_adapter`` (the persistent batch's LoRA mapping; LoRA campaigns only): a
  row moved by ``InputBatch.condense`` loses its adapter, so the moved request's remaining
  tokens run through the base model. Every block record agrees. ``worker-adapter``.
- AF ``moved_row_count_one_short`` (the persistent batch's computed-token count): a row moved by
  ``InputBatch.condense`` gets its count one short for the step after the move, so that step
  computes the moved request's token at the position before its own. ``worker-slot``; its
  findings are ``engine-crash`` hangs.
- AG ``abort_caches_partial_block`` (prefix-cache registration on abort): a request aborted in
  the middle of its prompt registers every block it was given, its partly computed last block
  too, so a retry of its prefix reads that block's unwritten tail. ``held-block-unwritten``.
- AH ``mixed_decode_misses_own_key`` (the CPU attention metadata): in a batch that mixes a
  prefill with decodes, each decode's sequence length is one short, so its query leaves out its
  own newest key. ``worker-seq-len``.
- AI ``continuing_prefill_positions_early`` (the model's positions; the default model only): in
  a batch of two or more, a prefill that starts past position 0 is handed positions one early
  after its slots were computed, so its KV lands in the right slots, rotated wrong.
  ``worker-position``.
- AJ ``write_drops_batch_last_token`` (the KV cache write): in a batch of two or more, the cache
  write covers one token fewer than the batch holds, so the batch's last token keeps its slot's
  old content. Every record and every kernel input agrees. None.
- AK ``prefill_samples_neighbours_row`` (the sampler's row index): in a batch of two or more, a
  request whose prompt ends in this step, below the first row, samples its first token from the
  row above's hidden state. No KV, record or kernel input is wrong. ``worker-sample-row``.
- AL ``readded_row_keeps_stale_tokens`` (the persistent batch's token ids): a request added back
  to the batch with output tokens (resumed after a preemption, or left out of a step) keeps its
  row's previous content where those tokens belong, so it recomputes or continues from another
  request's tokens. ``worker-token``.
- AM ``prefill_first_token_neighbours_adapter`` (the LoRA token mapping; LoRA campaigns only):
  in a batch of two or more, the first token of a multi-token row below the first runs through
  the row above's adapter, so its KV is computed with other weights. The row's adapter and every
  record agree: no post-condition checks the per-token mapping. None.
- AO ``mixed_batch_loses_causal_mask`` (the attention kernel's causal flag): a batch whose first
  row is a decode and another row computes several tokens runs without the causal mask, so those
  tokens attend to the rest of their own chunk. Every record and kernel input but the flag
  agrees. None.
- AP ``block_opening_decode_takes_neighbours_token`` (the model's input token ids): in a batch of
  two or more, a decode below the first row whose token opens a new KV block is handed the row
  above's last token. ``worker-token``, through another path than AL's.
- AQ ``returning_adapter_skips_its_weights`` (the LoRA slots' weights; LoRA campaigns with more
  adapters than slots): an adapter activated into the slot its weights were last copied to skips
  the copy, though another adapter has used the slot since, so its requests run through that
  adapter's weights. The slot table, every row's adapter and every record agree. None.
- AR ``preempting_step_drops_first_write`` (the KV cache write under KV pressure): in a step whose
  scheduling preempted a request, the cache write skips the first row's last token, so its slot
  keeps its old content. Every record and every kernel input agrees. None.
- AS ``finished_output_swaps_with_next`` (the output processor): when a request finishes in a
  step, its output and the next one carrying tokens trade them, so each request is handed the
  other's token; the engine's own state is right. None.
- AT ``batched_rows_lose_precision`` (the attention kernel's precision): in a batch of two or
  more, every row below the first has its attention output rounded to a coarser precision than
  the dtype's. Systematic drift far past the noise; nothing recorded is wrong. None.
- AU ``newest_running_left_out`` (the scheduler's running queue): while two or more requests
  run, the newest is left out of every step (its blocks kept): no token changes, the request
  just starves while the others are served. None; the liveness check names it ``stall``.
- AV ``rejected_draft_stays_counted`` (speculative decoding's rollback; speculative traces only):
  the scheduler takes a request's rejected drafts back one short, so the first rejected draft's
  KV stays counted in the slot of the token sampled in its place, and is cached under that
  token's hash once its block fills. ``held-block-token`` (its request, and a later prefix hit
  on the block), ``map-entry-unbacked`` (the block).

There is no AN: a fault in the copy of block ids to the device block table cannot fire on CPU,
where the runner's "device" buffers are its host buffers (``CPUModelRunner`` sets each ``.gpu``
to ``.cpu``).
"""

from collections.abc import Callable
from typing import Any


def wrap(owner: Any, attr: str, tag: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace ``owner.attr`` by ``make(original)`` once per process (``install`` runs in every
    vLLM process and may run twice); the original stays reachable as ``__wrapped__`` (the engine
    tests undo a fault in the same engine)."""
    original = getattr(owner, attr)
    if getattr(original, "__unseen_tag__", None) == tag:
        return
    patched = make(original)
    patched.__unseen_tag__ = tag  # type: ignore[attr-defined]
    patched.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, attr, patched)


def attention_metadata(layer: Any) -> Any:
    """The attention metadata of ``layer`` in the step being run (faults AJ and AR, inside a
    cache write); None on paths that are not the CPU one (micro-batches)."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: not the CPU path
        return None
    return meta.get(layer.layer_name) if isinstance(meta, dict) else meta


def wrap_slot_mapping(tag: str, edit: Callable[[Any, int, int, int, Any], None]) -> None:
    """A fault in the worker's slot mapping (``BlockTable.compute_slot_mapping``, where each
    scheduled token's KV is written): after vLLM computes it, in a batch of two requests or
    more, ``edit(table, row, start, end, positions)`` may rewrite the slots of each request's
    tokens ``start:end``. A request alone is never hit, so its reference stays right."""
    from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def compute_slot_mapping(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
            original(self, num_reqs, query_start_loc, positions)
            if num_reqs < 2 or self.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                return
            starts = query_start_loc[: num_reqs + 1].tolist()
            for r in range(num_reqs):
                edit(self, r, starts[r], starts[r + 1], positions)

        return compute_slot_mapping

    wrap(BlockTable, "compute_slot_mapping", tag, make)


def wrap_attention_metadata(tag: str, edit: Callable[[Any, Any], Any]) -> None:
    """A fault in what the CPU attention kernel is told (``CPUAttentionMetadataBuilder.build``):
    in a decoder batch of two requests or more, ``edit(builder, common_attn_metadata)`` returns
    the metadata the builder is given instead. A request alone is never hit, so its reference
    stays right."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
            m = common_attn_metadata
            if m.num_reqs >= 2 and not self.is_encoder_only_attention and not self.is_cross_attention:
                m = edit(self, m)
            return original(self, common_prefix_len, m, fast_build)

        return build

    wrap(CPUAttentionMetadataBuilder, "build", tag, make)


def wrap_condense(tag: str, moved: Callable[[Any, str, int], None]) -> None:
    """Install a fault on ``InputBatch.condense``: after the original, ``moved(batch, request,
    row)`` runs for each request it moved into a hole (faults AE and AF)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def condense(self: Any) -> None:
            where = dict(self.req_id_to_index)
            original(self)
            for rid, i in list(self.req_id_to_index.items()):
                if i != where.get(rid):
                    moved(self, rid, i)

        return condense

    wrap(InputBatch, "condense", tag, make)
