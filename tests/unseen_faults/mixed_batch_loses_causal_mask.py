"""Fault AO (the attention kernel's causal mask).

Each step the CPU attention backend builds its metadata (``CPUAttentionMetadataBuilder.build``)
with one causal flag for the whole batch. With this fault the flag is decided from the batch's
first row: when that row is a decode (one query token, for which the mask changes nothing) and
another row computes several tokens (a prompt, or a chunk of one), the batch runs without the
causal mask, so each of those tokens also attends to the tokens after it in its own chunk. Its
hidden states, and the KV of every layer past the first, are computed from its future: wrong
KV in the right slots. Every record, slot, length, position, token and sampled row agrees, so
it breaks no post-condition kvfuzz checks.

Upstream's kind: a batch-level attention flag or plan decided from one request of a mixed
prefill/decode batch (vLLM's attention backends split such batches for this reason,
``reorder_batch_to_split_decodes_and_prefills``). A request alone is never hit, so its
reference is right.
"""

from __future__ import annotations

import dataclasses

from . import wrap_attention_metadata

_TAG = "unseen-fault-mixed-batch-loses-causal-mask"


def _edit(builder, m):
    if not isinstance(m.causal, bool) or not m.causal:
        return m
    starts = m.query_start_loc_cpu[: m.num_reqs + 1]
    counts = starts[1:] - starts[:-1]
    if int(counts[0]) != 1 or not bool((counts[1:] > 1).any()):
        return m
    return dataclasses.replace(m, causal=False)  # the bug: row 0's "no mask needed" for all


def install() -> None:
    wrap_attention_metadata(_TAG, _edit)
