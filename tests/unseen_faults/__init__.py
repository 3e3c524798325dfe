"""Faults kvfuzz has never seen (issue 30): vLLM patches that no built-in toggle implements,
installed in every vLLM process through ``KVFUZZ_PLUGIN_MODULES`` (harness/toggles/plugin.py),
e.g. ``PYTHONPATH=tests KVFUZZ_PLUGIN_MODULES=unseen_faults.evict_keeps_hash``. Always on: to
kvfuzz they are vLLM bugs that no toggle explains, as a user's own bug would be.

- ``evict_keeps_hash`` (P, the allocator): reusing a free block drops its hash metadata but
  leaves the prefix-cache map pointing at it.
- ``short_hash_lookup`` (Q, the prefix-cache lookup): a lookup miss falls back to a cached
  block whose hash agrees in its first 8 bits.

They were written, and the bucket rule tuned on them, before fault R (recorded in an earlier
version of docs/benchmarks.md, git history, "Buckets on faults kvfuzz has never seen"):

- ``hit_last_block_repeated`` (R, the prefix-cache hit's block list, written after the rule was
  frozen): a hit of two blocks or more lists its second-to-last block twice, its last never.
- ``register_overwrites`` (S, prefix-cache registration, written after the rule's second
  change, 8641580, which fault R had shown): a block registered right after another in one
  request's registration also takes over the earlier block's hash (when its own hash's first
  byte is a multiple of 4).

And after bucket rule 4 (fc92d46; docs/oracle.md "The rule's versions"):

- ``row_move_drops_last_block`` (T, the worker's persistent-batch block table): a row moved by
  ``InputBatch.condense`` keeps its length but loses its last block id.
And after bucket rule 5 (000a882, the post-conditions of harness/postconditions.py):
- ``hit_takes_no_reference`` (U, a prefix hit's reference count): a request whose hit ends on a
  block another running request holds takes no reference on it; the block is freed under it
  and handed to another request while it still reads it.
And after rule 5.2 (653a980; U had shown that a latent break must not name a victim):
- ``append_repeats_first_block`` (V, the persistent batch's block table on append): two or more
  block ids appended to a non-empty row are written with the first one twice.
And after rule 5.3 (0da9af8; a reference run's breaks name the divergence):
- ``new_block_slot_in_previous`` (W, the worker's slot mapping): in a batch of two requests or
  more, a decode token that opens a new block is written to offset 0 of the request's previous
  block. It broke none of the post-conditions kvfuzz checked then (it breaks ``worker-slot``, the
  slot-mapping check written after Z).
And after rule 5.4 (4ffa134; W had shown that a removal may leave wrong KV that flips no token):
- ``decode_reads_past_row_end`` (X, the CPU attention metadata): in a batch of two requests or
  more, a decode whose context fills its last block exactly attends one block past its row's
  end (a stale block-table entry). It breaks no post-condition either, and its first campaigns
  flipped no token (its drift is measured: tests/test_explain_engine.py).
- ``decode_reads_neighbours_last_block`` (Y, the CPU attention metadata's block table; written
  after X, the rule unchanged): in a batch of two or more, a decode whose last block is full
  reads that block from the row above (another request's KV). No post-condition breaks.
And after rules 5.5, 5.6 and the per-key victim (f2bfa8c; Y and Y + P had shown them):
- ``chunk_start_slot_before`` (Z, the worker's slot mapping for prefills): in a batch of two or
  more, a prefill that starts past position 0 (a continuing chunk, or after a prefix-cache hit)
  writes its first token's KV into the slot before it. No post-condition broke (it breaks
  ``worker-slot``, written after it).
And after the ``worker-slot`` post-condition (d2313a7) and rule 5.7 (fee862f; Z and Y + P had
shown them):
- ``moved_row_keeps_stale_last_token`` (AA, the persistent batch's token ids): a row moved by
  ``InputBatch.condense`` is copied one token short, so its next decode feeds the model the
  departed request's token. Wrong KV content in correctly recorded blocks: no post-condition
  breaks.
And after the attribution change AA showed (2ec6e6c: toggles the engine never reaches explain
nothing):
- ``hash_covers_half_block`` (AB, the prefix cache's block hash): a full block's hash covers only
  the first half of its tokens, so prompts that agree up to a block's middle share the block.
  Requests' and blocks' hashes agree (both wrong alike): no post-condition breaks.
And after rule 5.8 (59564ec) and the review of it (dba6060), the last change to the rule:
- ``hit_counts_one_block_more`` (AC, the prefix-cache hit's token count): a hit of two blocks or
  more reports one block more computed tokens than its blocks hold; that block's KV is never
  computed, and it is registered in the prefix cache for later hits.
And after rule 5.9 (3c25a0c: ``held-block-unwritten``, which AC's split had shown):
- ``window_drops_one_block_early`` (AD, the sliding window's block release; the hybrid model
  only): once the window slides, the oldest block still inside it is freed too, while the
  request's next tokens attend to it through the worker's row.
And after rule 5.10 (05d1d43: ``held-block-released``, which AD's split had shown):
- ``moved_row_drops_adapter`` (AE, the persistent batch's LoRA mapping; LoRA campaigns only): a
  row moved by ``InputBatch.condense`` loses its adapter, so the moved request's remaining tokens
  run through the base model. Every block record agrees.
And after rule 5.11 (ab4ce78: ``worker-adapter``, which AE's split had shown) and its review
(249af04):
- ``moved_row_count_one_short`` (AF, the persistent batch's computed-token count): a row moved
  by ``InputBatch.condense`` gets its count one short for the step after the move, so that
  step computes the moved request's token at the position before its own.
And after rule 5.11's last review (475bce2), AF having broken no rule (it only hangs), both
written to try the rule on corruption it was not written for:
- ``abort_caches_partial_block`` (AG, prefix-cache registration on abort): a request aborted
  in the middle of its prompt registers every block it was given, its partly computed last block
  too, so a retry of its prefix reads that block's unwritten tail.
- ``mixed_decode_misses_own_key`` (AH, the CPU attention metadata): in a batch that mixes a
  prefill with decodes, each decode's sequence length is one short, so its query leaves out its
  own newest key. It broke no post-condition then (it breaks ``worker-seq-len``, rule 5.12,
  written after its 10-minute campaigns split: 529a71a).
And after rule 5.12 (529a71a: ``worker-seq-len``, which AH's split had shown):
- ``continuing_prefill_positions_early`` (AI, the model's positions; the default model): in a
  batch of two or more, a prefill that starts past position 0 is handed positions one early
  after its slots were computed, so its KV lands in the right slots, rotated wrong. It broke no
  post-condition then (it breaks ``worker-position``, rule 5.13, written after its first
  campaigns split: 48df392).
And after rule 5.13 (48df392: ``worker-position``, which AI's split had shown) and its review
(abf86fd):
- ``write_drops_batch_last_token`` (AJ, the KV cache write): in a batch of two or more, the
  cache write covers one token fewer than the batch holds, so the batch's last token keeps its
  slot's old content. Every record and every kernel input agrees. It held alone; on with AH it
  showed rule 5.14 (3cb85fe: a self-only name, ``worker-seq-len``, takes no unnamed victim).
And after rule 5.14 and its review (164fb54, c0b809f):
- ``prefill_samples_neighbours_row`` (AK, the sampler's row index): in a batch of two or more, a
  request whose prompt ends in this step, below the first row, samples its first token from the
  row above's hidden state. No KV, record or kernel input is wrong. It held alone; on with AJ
  and with AI it gave one bucket each, and showed rule 5.15 (``worker-sample-row``, self-only);
  with AJ again, rule 5.16 (an unnamed victim beside self-only names keys on its own).
And after rule 5.16 (3ac7fab) and its review (1c4452c):
- ``readded_row_keeps_stale_tokens`` (AL, the persistent batch's token ids): a request added
  back to the batch with output tokens (resumed after a preemption, or left out of a step) keeps
  its row's previous content where those tokens belong, so it recomputes or continues from
  another request's tokens. Two paths to a victim; every record and kernel input agrees. It
  split on Ray in bfloat16 (5 + 1) and showed rule 5.18 (``worker-token``).
And after rule 5.18 (5560fff), the null-block fix of ``held-block-released`` (4bd7b74) and their
review (f8306e8):
- ``prefill_first_token_neighbours_adapter`` (AM, the LoRA token mapping; LoRA campaigns only):
  in a batch of two or more, the first token of a multi-token row below the first runs through
  the row above's adapter, so its KV is computed with other weights. The row's adapter and every
  record agree: no post-condition checks the per-token mapping.
A first AN, written with AM (block ids appended to a non-empty row reaching the device block
table one step late, the kind of vLLM PR #47936's dirty-row copy), was withdrawn after its first
campaigns found nothing: on CPU the runner's "device" buffers are its host buffers
(``CPUModelRunner`` sets each ``.gpu`` to ``.cpu``), so there is no copy to be late.
And after rule 5.19 (2804c96: a second cause on one victim, which AL + AI had shown):
- ``mixed_batch_loses_causal_mask`` (AO, the attention kernel's causal flag): a batch whose first
  row is a decode and another row computes several tokens runs without the causal mask, so those
  tokens attend to the rest of their own chunk. Every record and kernel input but the flag agrees.
And after rule 5.20 (a08b547: a name's cause, which AM + AE had shown):
- ``block_opening_decode_takes_neighbours_token`` (AP, the model's input token ids): in a batch of
  two or more, a decode below the first row whose token opens a new KV block is handed the row
  above's last token. It breaks ``worker-token``, through another path than AL's.
And after rule 5.21 (287382b: a smaller witness before a split, which AJ in bfloat16 had shown):
- ``returning_adapter_skips_its_weights`` (AQ, the LoRA slots' weights; LoRA campaigns only): an
  adapter activated into the slot its weights were last copied to skips the copy, though another
  adapter has used the slot since, so its requests run through that adapter's weights. The slot
  table, every row's adapter and every record agree.
And after rule 5.22 (2b860da: an unsettled split near a campaign's end joins, which AQ had shown):
- ``preempting_step_drops_first_write`` (AR, the KV cache write under KV pressure): in a step
  whose scheduling preempted a request, the cache write skips the first row's last token, so its
  slot keeps its old content. Every record and every kernel input agrees.
And after rule 5.22's second part (edfe58c: a bucket's own unfinished witness minimized again)
and the numbers-first further minimization (01cfbe0), both of which AQ at 10 minutes had shown:
- ``finished_output_swaps_with_next`` (AS, the output processor): when a request finishes in a
  step, its output and the next one carrying tokens trade them, so each request is handed the
  other's token; the engine's own state is right.
And after rule 5.22's name condition (d6515d9, which Y + P had shown) and the near tie's float32
control first (e644786, which AR in bfloat16 had shown):
- ``batched_rows_lose_precision`` (AT, the attention kernel's precision): in a batch of two or
  more, every row below the first has its attention output rounded to a coarser precision than
  the dtype's. Systematic drift far past the noise; nothing recorded is wrong.
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
