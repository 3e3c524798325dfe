"""Fault Q (prefix-cache lookup): block hashes compared on a truncated prefix.

``BlockPool.get_cached_block`` finds a cached block by its full block hash. With this fault a
miss falls back to any cached block of the same KV cache group whose hash agrees in its first
8 bits (a lookup keyed by a truncated hash), so a request is given a block that holds other
tokens' KV. It needs prefix caching and nothing else: not KV pressure, not concurrency (a later
request can collide with an earlier one's cached block). References run alone on a reset
prefix cache, where there is nothing to collide with.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-short-hash-lookup"
BITS = 8


def _short(h: bytes) -> int:
    return int.from_bytes(h[:2], "big") >> (16 - BITS)


def _make(original):
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        found = original(self, block_hash, kv_cache_group_ids)
        if found is not None or not self.enable_caching:
            return found
        want = _short(block_hash)
        out = []
        for group_id in kv_cache_group_ids:
            hit = None
            for key in list(self.cached_block_hash_to_block._cache):
                if get_group_id(key) == group_id and _short(get_block_hash(key)) == want:
                    hit = self.cached_block_hash_to_block.get_one_block(key)
                    break
            if hit is None:
                return None
            out.append(hit)
        return out

    return get_cached_block


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool

    wrap(BlockPool, "get_cached_block", _TAG, _make)
