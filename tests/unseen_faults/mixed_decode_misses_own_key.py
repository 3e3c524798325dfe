"""Fault AH (the attention kernel's sequence lengths).

Each step the CPU attention backend builds its metadata from the batch's sequence lengths
(``CPUAttentionMetadataBuilder.build``). With this fault, in a batch that mixes a prefill (a
request scheduled for more than one token) with decodes, each decode is given a sequence length
one short: its query attends to every key but its own newest one, whose KV was written where it
belongs. The kind of off-by-one between computed tokens and sequence lengths reported for mixed
prefill/decode batches. No record of the scheduler, the allocator or the persistent batch
changes and every KV lands in its slot; the sequence length the kernel is handed breaks
``worker-seq-len``. A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

import dataclasses

from . import wrap_attention_metadata

_TAG = "unseen-fault-mixed-decode-misses-own-key"


def _edit(builder, m):
    starts = m.query_start_loc_cpu[: m.num_reqs + 1]
    counts = starts[1:] - starts[:-1]
    decode = counts == 1
    seq = m.seq_lens[: m.num_reqs]
    hit = decode & (seq > 1)
    if not bool((counts > 1).any()) or not bool(hit.any()):
        return m
    lens = m.seq_lens.clone()
    lens[: m.num_reqs] -= hit.to(lens.dtype)  # the bug: the decode's own key is left out
    return dataclasses.replace(m, seq_lens=lens)


def install() -> None:
    wrap_attention_metadata(_TAG, _edit)
