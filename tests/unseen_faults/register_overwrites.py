"""Fault S (prefix-cache registration): written after the bucket rule's second change
(8641580), so neither freeze was tuned on it (issue 30).

``BlockPool._insert_block_hash`` registers a newly full block under its hash. With this fault
every fourth registration also overwrites the map entry of the hash registered just before it,
so that hash now finds the new block: a later request whose prefix reaches that hash is given a
block holding other tokens' KV. Blocks' own records and reference counts are untouched (the
overwritten entry is only in the map; eviction of the real block finds the entry is not its
own and leaves it), so nothing crashes. It needs prefix caching, and a prefix that reaches a
block registered right before another one.
"""

from __future__ import annotations

_TAG = "unseen-fault-register-overwrites"
EVERY = 4


def install() -> None:
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool._insert_block_hash
    if getattr(original, "__unseen_tag__", None) == _TAG:
        return
    state = {"n": 0, "prev": None}

    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        original(self, block_hash_with_group_id, block, num_tokens)
        state["n"] += 1
        prev, state["prev"] = state["prev"], block_hash_with_group_id
        if state["n"] % EVERY == 0 and prev is not None and prev != block_hash_with_group_id \
                and prev in self.cached_block_hash_to_block._cache:
            self.cached_block_hash_to_block._cache[prev] = block  # the bug: the older key now finds this block

    _insert_block_hash.__unseen_tag__ = _TAG  # type: ignore[attr-defined]
    _insert_block_hash.__wrapped__ = original  # type: ignore[attr-defined]
    BlockPool._insert_block_hash = _insert_block_hash
