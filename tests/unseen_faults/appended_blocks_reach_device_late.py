"""Fault AN (the device copy of the persistent batch's block table): written after rule 5.18
(5560fff), the null-block fix of ``held-block-released`` (4bd7b74) and their review (f8306e8),
with fault AM, for the acceptance runs of issue 30; neither the bucket rule nor the attribution
nor the post-conditions were changed after it, and it was written before any run of it.

Each step the runner commits the batch's block table to the device
(``BlockTable.commit_block_table``: the host rows copied to the tensor the slot-mapping kernel
and the attention kernels read). With this fault, in a batch of two rows or more, block ids
appended this step to a row that already had blocks (a decode opening a new block, a prompt's
next chunk) reach the device one step late: for that step the device row still holds what the
entry held before (another request's block from an earlier occupant of the row, or 0). That
step's tokens in the new blocks have their KV written to, and read from, the stale block; the
next step reads the right block, which was never written. The host row, which the scheduler's
records agree with, is right.

Upstream's kind: a dirty-row copy that misses a row (vLLM PR #47936, "Only copy dirty
block-table rows to GPU in commit_block_table", tracks rows written by ``append_row`` and the
other row edits), and a block table overwritten during its asynchronous host-to-device copy
(vllm-ascend PR #12130). A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

from typing import Any

from . import wrap

_TAG = "unseen-fault-appended-blocks-reach-device-late"


def _make_append(original):
    def append_row(self: Any, block_ids: list[int], row_idx: int) -> None:
        start = int(self.num_blocks_per_row[row_idx])
        original(self, block_ids, row_idx)
        if block_ids and start > 0:  # a row that had blocks (add_row starts from 0)
            late = self.__dict__.setdefault("_unseen_late", [])
            late.append((row_idx, start, list(block_ids)))

    return append_row


def _make_commit(original):
    def commit_block_table(self: Any, num_reqs: int) -> None:
        late = self.__dict__.pop("_unseen_late", [])
        dev = self.block_table.gpu
        kept = []
        for row, start, ids in late:
            n = len(ids)
            # Still the row appended to (not moved or cleared since), and inside the batch.
            if num_reqs >= 2 and row < num_reqs and [int(x) for x in self.block_table.np[row, start:start + n]] == ids:
                kept.append((row, start, dev[row, start:start + n].clone()))
        original(self, num_reqs)
        for row, start, before in kept:
            # The bug: the appended entries are not copied this step.
            dev[row, start:start + len(before)] = before

    return commit_block_table


def install() -> None:
    from vllm.v1.worker.block_table import BlockTable

    wrap(BlockTable, "append_row", _TAG, _make_append)
    wrap(BlockTable, "commit_block_table", _TAG + "-commit", _make_commit)
