"""Fault R (the prefix-cache hit's block list).

``KVCacheManager.get_computed_blocks`` returns the cached blocks a request's prompt hits, in
prompt order; they become the head of its block table. With this fault a hit of two blocks or
more comes back with its last block replaced by the one before it (an off-by-one in the hit
list), so the request attends to that block's keys twice and never to the last one's. The
block is touched and freed once per listing, so reference counts stay right and nothing
crashes. (Swapping two hit blocks would not do: cached keys carry their rotary positions, and
attention over a fully cached prefix does not depend on where each block sits.) It needs
prefix caching and a hit of at least two blocks; not KV pressure, not concurrency (a later
request hitting an earlier one's blocks is enough).
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-hit-last-block-repeated"


def _make(original):
    def get_computed_blocks(self, request):
        blocks, n, boundary = original(self, request)
        groups = blocks.blocks
        if n == 0 or not groups or any(len(g) < 2 for g in groups):
            return blocks, n, boundary
        repeated = tuple([*g[:-1], g[-2]] for g in groups)
        return type(blocks)(repeated), n, boundary

    return get_computed_blocks


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    wrap(KVCacheManager, "get_computed_blocks", _TAG, _make)
