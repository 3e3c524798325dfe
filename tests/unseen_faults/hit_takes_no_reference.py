"""Fault U (a prefix hit's reference count).

A request admitted with a prefix-cache hit takes a reference on each hit block
(``SingleTypeKVCacheManager.add_local_computed_blocks`` -> ``BlockPool.touch``), so a block
stays allocated while any request reads it. With this fault, when the hit's last block is in use
by another running request, the new request takes no reference on it: once that other request
ends, the block goes back to the free queue while the new one still reads it, and when the free
queue comes round to it the allocator hands it to another request, whose KV overwrites the
reader's prefix. The reader's own free of that block is skipped (its reference was never
taken), so the pool's accounting balances once every holder has left and nothing crashes. It
needs prefix caching, a hit on a block in use (concurrent requests) and block reuse (KV
pressure).
"""

from __future__ import annotations

import threading
from collections import Counter

from . import wrap

_TAG = "unseen-fault-hit-takes-no-reference"
_CALL = threading.local()
# (id(manager), request_id, block_id) -> references the fault did not take.
_MISSING: Counter[tuple[int, str, int]] = Counter()


def _make_admit(admit):
    def add_local_computed_blocks(self, request_id, *args, **kwargs):
        _CALL.who = (id(self), request_id)
        try:
            return admit(self, request_id, *args, **kwargs)
        finally:
            _CALL.who = None

    return add_local_computed_blocks


def _make_touch(touch):
    def touch_(self, blocks):
        who = getattr(_CALL, "who", None)
        blocks = list(blocks)
        if who is not None and blocks and blocks[-1].ref_cnt > 0 and not blocks[-1].is_null:
            _MISSING[(*who, blocks[-1].block_id)] += 1  # the bug: the last hit block, in use, is not referenced
            blocks = blocks[:-1]
        return touch(self, blocks)

    return touch_


def _make_free(original):  # replaced, not called
    def free(self, request_id):
        kept = []
        for b in self.pop_blocks_for_free(request_id):
            key = (id(self), request_id, b.block_id)
            if _MISSING[key] > 0:
                _MISSING[key] -= 1
                continue
            kept.append(b)
        self.block_pool.free_blocks(reversed(kept))

    return free


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    wrap(SingleTypeKVCacheManager, "add_local_computed_blocks", _TAG, _make_admit)
    wrap(BlockPool, "touch", _TAG, _make_touch)
    wrap(SingleTypeKVCacheManager, "free", _TAG, _make_free)


def reset() -> None:
    """Forget the references not taken (``faults_on``, as the fault goes off): keyed by a
    manager's id, an entry left behind could match a later engine's manager."""
    _MISSING.clear()
    _CALL.who = None
