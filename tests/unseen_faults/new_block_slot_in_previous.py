"""Fault W (the worker's slot mapping, where each scheduled token's KV is written).

Each step the worker maps every scheduled token to a KV slot (block id x block size + offset,
``BlockTable.compute_slot_mapping``). With this fault, in a batch of two requests or more, a
decode token that opens a new block is written to offset 0 of the request's *previous* block:
it overwrites the KV of that block's first token and leaves its own slot unwritten. Nothing in
the scheduler's or the persistent batch's records changes (block tables, reference counts and
the prefix-cache map are all right); the slot mapping disagrees with the row, which breaks
``worker-slot``. Where the previous block is a
prefix-cache block that other requests share, their KV is overwritten too. A request alone is
never hit, so its reference is right.
"""

from __future__ import annotations

from . import wrap_slot_mapping

_TAG = "unseen-fault-new-block-slot-in-previous"


def _edit(table, r, s, e, positions):
    if e - s != 1:
        return  # decode tokens only
    bs = table.block_size
    p = int(positions[s])
    if p < bs or p % bs:
        return
    prev = int(table.block_table.np[r, p // bs - 1])
    table.slot_mapping.gpu[s] = prev * bs  # the bug: the new block's first slot is the previous block's


def install() -> None:
    wrap_slot_mapping(_TAG, _edit)
