"""Fault AM (the LoRA token mapping at a prefill's first token). LoRA campaigns only
(``--lora``; ``--arms clean`` so the real CPU LoRA bug is fixed in the runs and this fault is
the one cause left).

Each step the runner maps every scheduled token to its request's adapter
(``InputBatch.make_lora_inputs``: the row's adapter repeated once per scheduled token). With this
fault, in a batch of two rows or more, the first token of a row below the first that computes
more than one token (a prompt, or a chunk of one) keeps the row above's adapter: a segment
boundary off by one. That token's q, k and v go through the other adapter's weights (or the base
model's), so its KV is wrong, and every later token of the request attends to it. The row's own
mapping (``request_lora_mapping``) is right, and so are its blocks, slots, positions, lengths,
token ids and sampled row: it breaks no post-condition kvfuzz checks.

Upstream's own bugs of this kind are token-to-adapter index mappings at segment boundaries:
vLLM issue #15979 (Punica kernel metadata indexing tokens by the wrong start), issue #4995 and
PR #9057 (LoRA index mapping under chunked prefill). A request alone is never hit, so its
reference is right.
"""

from __future__ import annotations

from typing import Any

from . import wrap

_TAG = "unseen-fault-prefill-first-token-neighbours-adapter"


def _make(original):
    def make_lora_inputs(self: Any, num_scheduled_tokens: Any, num_sampled_tokens: Any, *args: Any, **kwargs: Any):
        prompt, token, requests = original(self, num_scheduled_tokens, num_sampled_tokens, *args, **kwargs)
        n = self.num_reqs
        if n < 2:
            return prompt, token, requests
        rows = self.request_lora_mapping[:n]
        counts = [int(c) for c in num_scheduled_tokens[:n]]
        mapping = list(token)
        start = counts[0]
        for r in range(1, n):
            if counts[r] > 1:
                # The bug: the segment boundary is one token late.
                mapping[start] = int(rows[r - 1])
            start += counts[r]
        return prompt, tuple(mapping), requests

    return make_lora_inputs


def install() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    wrap(InputBatch, "make_lora_inputs", _TAG, _make)
