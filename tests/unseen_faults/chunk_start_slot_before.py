"""Fault Z (the worker's slot mapping for prefill chunks).

Each step the worker maps every scheduled token to a KV slot (``BlockTable
.compute_slot_mapping``). With this fault, in a batch of two requests or more, a prefill that
starts past position 0 — a chunk continuing a prompt, or the first chunk after a prefix-cache
hit — writes its first token's KV into the slot before it (over the previous chunk's last
token, or the last token of a cached block other requests may share) and leaves its own slot
as it was. Nothing in the scheduler's or the persistent batch's records changes; the slot
mapping disagrees with the row, which breaks ``worker-slot``. A request alone is never hit, so
its reference is right.
"""

from __future__ import annotations

from . import wrap_slot_mapping

_TAG = "unseen-fault-chunk-start-slot-before"


def _edit(table, r, s, e, positions):
    if e - s < 2 or int(positions[s]) == 0:
        return  # prefills that start past position 0 only
    table.slot_mapping.gpu[s] = table.slot_mapping.gpu[s] - 1  # the bug: the slot before


def install() -> None:
    wrap_slot_mapping(_TAG, _edit)
