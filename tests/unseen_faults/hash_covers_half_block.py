"""Fault AB (the prefix cache's block hash).

vLLM names a full block by a hash of its parent's hash and its tokens
(``kv_cache_utils.hash_block_tokens``). With this fault the hash covers only the first half of
the block's tokens, so two prompts that agree up to the middle of a block (and on every block
before it) give that block one name: the later one hits the earlier one's block and reads its
second half — another prompt's KV. The requests' own hashes and the blocks' agree (both are
computed the same wrong way), so no post-condition kvfuzz checks breaks. A request alone on a
clean cache hits nothing, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-hash-covers-half-block"


def install() -> None:
    from vllm.v1.core import kv_cache_utils

    def make(original):
        def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
            ids = list(curr_block_token_ids)
            return original(hash_function, parent_block_hash, ids[: (len(ids) + 1) // 2], extra_keys)  # the bug

        return hash_block_tokens

    wrap(kv_cache_utils, "hash_block_tokens", _TAG, make)
