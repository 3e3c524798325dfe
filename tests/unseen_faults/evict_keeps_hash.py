"""Fault P (allocator): a reused block keeps its prefix-cache entry.

``BlockPool.get_new_blocks`` evicts each block it takes from the free queue
(``_maybe_evict_cached_block``): the block's hash is reset *and* popped from
``cached_block_hash_to_block``. With this fault the first half happens and the second does not,
so the map keeps pointing at a block the allocator has handed to another request. A later
request whose prefix hashes to the stale entry is given that block and reads the new owner's
KV. Reference counts stay consistent (``touch`` and ``free_blocks`` see a normal block), so
nothing crashes: outputs are silently wrong. It needs block reuse (the free queue wrapping
round to cached blocks) and prefix caching.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-evict-keeps-hash"


def _make(original):  # replaced, not called
    def _maybe_evict_cached_block(self, block):
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        had = block.block_hash is not None or block.block_id in self.cached_block_hashes_by_block
        # The bug: the block's own record is cleared, the map entry (hash -> block) is not.
        self.cached_block_hashes_by_block.pop(block.block_id, None)
        block.reset_hash()
        return had

    return _maybe_evict_cached_block


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool

    wrap(BlockPool, "_maybe_evict_cached_block", _TAG, _make)
