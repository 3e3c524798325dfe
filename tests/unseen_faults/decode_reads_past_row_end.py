"""Fault X (the attention kernel's view of the KV cache).

Each step the CPU attention backend builds its metadata from the batch's sequence lengths
(``CPUAttentionMetadataBuilder.build``). With this fault, in a batch of two requests or more,
a decode whose context fills its last block exactly is given a sequence length one block
longer: its query also attends to the block of the block-table entry *past its row's end*, a
stale id left by an earlier occupant of that persistent-batch row (or the null block).
The kind of upstream bug reported for FlashInfer (block-table entries past a row's end read
as KV). No record of the scheduler, the allocator or the persistent batch changes, and no KV
is written anywhere wrong; the sequence length the kernel is handed breaks ``worker-seq-len``.
It may flip no token, only drift. A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

import dataclasses

from . import wrap_attention_metadata

_TAG = "unseen-fault-decode-reads-past-row-end"


def _edit(builder, m):
    starts = m.query_start_loc_cpu[: m.num_reqs + 1]
    decode = (starts[1:] - starts[:-1]) == 1
    seq = m.seq_lens[: m.num_reqs]
    hit = decode & (seq % builder.block_size == 0) & (seq > 0)
    if not bool(hit.any()):
        return m
    lens = m.seq_lens.clone()
    lens[: m.num_reqs] += builder.block_size * hit.to(lens.dtype)  # the bug: the block past the row's end
    return dataclasses.replace(m, seq_lens=lens, max_seq_len=max(m.max_seq_len, int(lens.max())))


def install() -> None:
    wrap_attention_metadata(_TAG, _edit)
