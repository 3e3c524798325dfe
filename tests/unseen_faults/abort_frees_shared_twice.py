"""Fault U (freeing on abort): written after bucket rule 5 was committed (000a882), for the
acceptance runs of issue 30; the rule was not changed for it.

When a request is aborted (a cancelled stream: ``Scheduler.finish_requests`` with
``FINISHED_ABORTED``), ``BlockPool.free_blocks`` drops one reference from each of its blocks.
With this fault a block the aborted request shares with exactly one other request (a
prefix-cache hit, ``ref_cnt`` 2) loses both references: it goes back to the free queue while the
other request still reads it, the allocator hands it to the next request that needs a block,
and that request's KV overwrites the sharer's prefix. A use-after-free of the kind behind
"retries after cancels diverge": it needs a cancel while a prefix is shared, prefix caching,
and a later allocation (concurrency). The sharer's own later free of that block is skipped
(the reference it drops was already taken), so the pool's accounting balances once every holder
has left: nothing crashes and the engine's prefix cache still resets between traces; outputs
are silently wrong.
"""

from __future__ import annotations

import threading

_TAG = "unseen-fault-abort-frees-shared-twice"
_ABORTING = threading.local()


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    if getattr(BlockPool.free_blocks, "__unseen_tag__", None) == _TAG:
        return
    finish, free = Scheduler.finish_requests, BlockPool.free_blocks

    def finish_requests(self, request_ids, finished_status):
        _ABORTING.on = finished_status == RequestStatus.FINISHED_ABORTED
        try:
            return finish(self, request_ids, finished_status)
        finally:
            _ABORTING.on = False

    def free_blocks(self, ordered_blocks):
        early = self.__dict__.setdefault("_unseen_released_early", set())
        blocks = []
        for b in ordered_blocks:
            if b.block_id in early and not getattr(_ABORTING, "on", False):
                early.discard(b.block_id)  # its reference went with the aborted request's
                continue
            if getattr(_ABORTING, "on", False) and b.ref_cnt == 2 and not b.is_null:
                b.ref_cnt -= 1  # the bug: the shared block's other reference goes too
                early.add(b.block_id)
            blocks.append(b)
        return free(self, blocks)

    for fn, orig in ((finish_requests, finish), (free_blocks, free)):
        fn.__unseen_tag__ = _TAG  # type: ignore[attr-defined]
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
    Scheduler.finish_requests = finish_requests
    BlockPool.free_blocks = free_blocks
