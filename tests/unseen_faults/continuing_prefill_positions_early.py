"""Fault AI (the model's positions for a prefill that starts past position 0). The default model
only (one KV cache group; see below).

Each step the worker computes every scheduled token's position, then the slot mapping from
those positions (``BlockTable.compute_slot_mapping``), and the model rotates each token's query
and key by its position. With this fault, in a batch of two requests or more, a prefill that
starts past position 0 (a later chunk of a long prompt, or the rest of a prompt after a
prefix-cache hit) is handed positions one early *after* its slots were computed: its KV lands in
the right slots, rotated for the wrong positions, and its queries too. The kind of bug of a
position path computed apart from the slot mapping (M-RoPE positions under chunked prefill).
Every block record, slot and length agrees; the KV's content is wrong, and the positions the
model is handed break ``worker-position``. A request alone is never hit, so its reference is
right. (With two KV cache groups the second group's slots would be computed from the edited
positions: the hybrid model is not its target.)
"""

from __future__ import annotations

from . import wrap_slot_mapping

_TAG = "unseen-fault-continuing-prefill-positions-early"


def _edit(table, row, start, end, positions):
    if end - start > 1 and int(positions[start]) > 0:
        positions[start:end] -= 1  # the bug: the model sees positions one early


def install() -> None:
    wrap_slot_mapping(_TAG, _edit)
