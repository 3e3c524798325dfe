"""Fault S (prefix-cache registration).

``BlockPool.cache_full_blocks`` registers a request's newly full blocks under their hashes, in
prompt order. With this fault, a block whose hash's first byte is a multiple of 4 also
overwrites the map entry of the block registered just before it in the same call, so that
hash now finds this block: a later request whose prefix reaches it is given a block holding
other tokens' KV. Blocks' own records and reference counts are untouched (the overwritten
entry is only in the map; evicting the real block finds the entry is not its own and leaves
it), so nothing crashes. It needs prefix caching and a request that fills two blocks in one
step. Deterministic: it depends on the tokens and the schedule only. A fault that fires
differently in each arm (a process-wide counter, say) is "explained" by whichever fix's arm it
missed (docs/oracle.md "Buckets", known limits).
"""

from __future__ import annotations

import threading

from . import wrap

_TAG = "unseen-fault-register-overwrites"
_CALL = threading.local()


def _make_cache(cache):
    def cache_full_blocks(self, *args, **kwargs):
        _CALL.prev = None
        try:
            return cache(self, *args, **kwargs)
        finally:
            _CALL.prev = None

    return cache_full_blocks


def _make_insert(insert):
    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        insert(self, block_hash_with_group_id, block, num_tokens)
        prev = getattr(_CALL, "prev", None)
        _CALL.prev = block_hash_with_group_id
        if prev is not None and block_hash_with_group_id[0] % 4 == 0 and prev in self.cached_block_hash_to_block._cache:
            self.cached_block_hash_to_block._cache[prev] = block  # the bug: the older key now finds this block

    return _insert_block_hash


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool

    wrap(BlockPool, "_insert_block_hash", _TAG, _make_insert)
    wrap(BlockPool, "cache_full_blocks", _TAG, _make_cache)
