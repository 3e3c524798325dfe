"""Fault V (the persistent batch's block table, on append).

Each step the worker appends a running request's newly allocated block ids to its row
(``BlockTable.append_row``). With this fault, when two or more ids are appended to a row that
already has blocks (a later prefill chunk, a resumed request), the first new id is written
twice: the second new position names the first new block, so the tokens of that position are
written into, and read from, the block before them. The scheduler's records are untouched, so
nothing crashes. The request corrupts its own KV: whether its output differs from its reference
(the same request alone, on the same faulty engine) depends on how its prompt was chunked —
the schedule — so it needs chunked prefill and other requests sharing the step's token budget.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-append-repeats-first-block"


def _make(original):
    def append_row(self, block_ids, row_idx):
        if len(block_ids) >= 2 and int(self.num_blocks_per_row[row_idx]) > 0:
            block_ids = [block_ids[0], block_ids[0], *block_ids[2:]]  # the bug: the second id is lost
        return original(self, block_ids, row_idx)

    return append_row


def install() -> None:
    from vllm.v1.worker.block_table import BlockTable

    wrap(BlockTable, "append_row", _TAG, _make)
