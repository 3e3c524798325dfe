"""Fault AT (the attention kernel's precision for batched rows).

With this fault, in a batch of two requests or more, the attention output of every row below the
first is rounded to a coarser precision than the model's dtype before the output projection:
to bfloat16's 8 bits of mantissa in a float32 engine, to float8 (e5m2: 3 bits) in a 16-bit one.
The kind of bug of a batched kernel path that accumulates or stages in a lower precision than
the single-request one (a split-KV reduction, a decode kernel's partial sums), and so of the
"batch-order noise or corruption?" question the oracle exists for: the drift is systematic
and far past the dtype's noise, but no block, slot, length, position, token or adapter is wrong,
and no post-condition breaks. A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

import torch

from . import wrap

_TAG = "unseen-fault-batched-rows-lose-precision"


def _coarse(x: torch.Tensor) -> torch.Tensor:
    lower = torch.bfloat16 if x.dtype == torch.float32 else torch.float8_e5m2
    return x.to(lower).to(x.dtype)


def _make(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is None or int(attn_metadata.query_start_loc.numel()) < 3:
            return out  # warm-up, or a request alone
        first = int(attn_metadata.query_start_loc[1])
        n = int(attn_metadata.num_actual_tokens)
        if first < n:
            rows = out[first:n]
            rows.copy_(_coarse(rows))  # the bug: rows below the first lose precision
        return out

    return forward


def install() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    wrap(CPUAttentionBackendImpl, "forward", _TAG, _make)
