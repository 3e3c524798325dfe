"""Fault T (the persistent batch's block table).

When a request leaves the persistent batch, ``InputBatch.condense`` moves the request in the
last row into the hole (``BlockTable.move_row``: the row's block ids and its length). With this
fault a moved row of two blocks or more keeps its length but loses its last block id: the
target row's old entry stays there (0, the null block, after ``clear_row``), so the moved
request attends to a block that is not its own for that block's tokens, and later blocks are
appended after the hole. Nothing is freed or counted differently, so nothing crashes. It lives
in the worker's input batch, not the KV cache manager: it needs concurrent requests (one
leaving while a later-admitted one keeps decoding), and neither prefix caching, chunked
prefill nor KV pressure.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-row-move-drops-last-block"


def _make(original):
    def move_row(self, src: int, tgt: int) -> None:
        num_blocks = int(self.num_blocks_per_row[src])
        if num_blocks < 2:
            return original(self, src, tgt)
        table = self.block_table.np
        table[tgt, : num_blocks - 1] = table[src, : num_blocks - 1]  # the bug: one block short
        self.num_blocks_per_row[tgt] = num_blocks
        table[src, :num_blocks] = 0
        self.num_blocks_per_row[src] = 0

    return move_row


def install() -> None:
    from vllm.v1.worker.block_table import BlockTable

    wrap(BlockTable, "move_row", _TAG, _make)
