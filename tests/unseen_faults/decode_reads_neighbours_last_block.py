"""Fault Y (the attention kernel's block table).

Each step the CPU attention backend hands its kernel the batch's block table
(``CPUAttentionMetadataBuilder.build``). With this fault, in a batch of two requests or more, a
decode whose context fills its last block exactly reads that block from the row above it: the
block-table entry at the same index of the previous request's row, when that row has one.
That request reads another request's KV for one block — the symptom of the reports this
project exists for — while every record of the scheduler, the allocator and the persistent
batch is right, and every KV write lands in its own slot (the slot mapping is computed
before). No post-condition kvfuzz checks breaks. A request alone is never hit, so its
reference is right.
"""

from __future__ import annotations

import dataclasses

from . import wrap_attention_metadata

_TAG = "unseen-fault-decode-reads-neighbours-last-block"


def _edit(builder, m):
    starts = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
    seq = m.seq_lens[: m.num_reqs].tolist()
    bs = builder.block_size
    table = None
    for r in range(1, m.num_reqs):
        n = seq[r]
        if starts[r + 1] - starts[r] != 1 or n <= 0 or n % bs:
            continue  # decodes whose last block is full only
        last = n // bs - 1
        if seq[r - 1] > last * bs:  # the row above has a block at that index
            if table is None:
                table = m.block_table_tensor.clone()
            table[r, last] = m.block_table_tensor[r - 1, last]  # the bug: the neighbour's block
    return m if table is None else dataclasses.replace(m, block_table_tensor=table)


def install() -> None:
    wrap_attention_metadata(_TAG, _edit)
