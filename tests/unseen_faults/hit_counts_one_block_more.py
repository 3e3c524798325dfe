"""Fault AC (the prefix-cache hit's token count).

``KVCacheManager.get_computed_blocks`` returns the blocks a request's prompt hits and how many
of its tokens they hold. With this fault a hit of two blocks or more reports one block more
tokens than its blocks hold, when the prompt goes on for at least two blocks past the hit (the
count stays below vLLM's ``num_tokens - 1`` cap). The scheduler takes those tokens as computed:
it allocates a block for them and never computes their KV, so the request reads whatever that
block last held (another prompt's KV, or nothing). After the step the block is registered in the
prefix cache under its tokens' hash, so a later request that hits it reads the same wrong KV:
one cause, two ways to see it. The symptom of the external-KV reports (a connector claims more
tokens than it loaded). Its readers break ``held-block-unwritten``. A request alone on a clean
cache hits nothing, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-hit-counts-one-block-more"


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def make(original):
        def get_computed_blocks(self, request):
            blocks, n, boundary = original(self, request)
            groups = blocks.blocks
            if n == 0 or not groups or any(len(g) < 2 for g in groups):
                return blocks, n, boundary
            bs = n // len(groups[0])  # the block size: a hit is whole blocks
            if n + 2 * bs > request.num_tokens - 1:
                return blocks, n, boundary
            return blocks, n + bs, boundary  # the bug: one block more than the blocks hold

        return get_computed_blocks

    wrap(KVCacheManager, "get_computed_blocks", _TAG, make)
