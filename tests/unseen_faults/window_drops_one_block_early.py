"""Fault AD (the sliding window's block release). Only the hybrid model
(``--model embedded:tiny-hybrid``: a full-attention layer and a sliding-window layer) has a
sliding-window KV cache group.

``SlidingWindowManager.get_num_skipped_tokens`` says how many of a request's first tokens no
longer fall in its window; ``remove_skipped_blocks`` frees the blocks they fill and puts the
null block in their place. With this fault, once the window has started to slide, it counts one
block more: the oldest block still inside the window is freed while the next tokens still
attend to it. The worker's row keeps the block's id, so the attention reads it; once the pool
hands the block to another request, that request's KV is read in its place. The scheduler's
records agree with each other. A request alone rarely sees it (its own freed block comes round
in the free queue only after every other one), so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-window-drops-one-block-early"


def install() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    def make(original):
        def get_num_skipped_tokens(self, num_computed_tokens):
            n = original(self, num_computed_tokens)
            return n + self.block_size if n > 0 else n  # the bug: one block too many

        return get_num_skipped_tokens

    wrap(SlidingWindowManager, "get_num_skipped_tokens", _TAG, make)
