"""Engine configurations per trace: the scheduler and KV-cache knobs vLLM takes other paths under.

A trace's engine is the campaign's, or, with probability ``p_config``, that engine with one knob
moved to one of a few values (``VARIANTS``): prefix caching off, chunked prefill off, another
block size, few sequences (more waiting and preemption), a small token budget (more chunking),
a long-prefill cap. One knob at a time, from a small set, so a campaign's engines stay few
enough for the engine pool to keep (harness/inprocess.py ``EnginePool``) and each trace's region
says which path it exercises. The draw has its own random stream: traces that draw no variant
are the ones the generator drew before. ``region`` names a configuration's knobs for coverage
and the campaign's counts; the ``engine_knob`` mutation operator (fuzzer/mutate.py) moves a
trace to another region, one knob at a time.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from kvfuzz.traces import EngineConfig

# `kvfuzz run`'s share of traces with a knob moved (in-process).
DEFAULT_SHARE = 0.4
# Knob -> values a trace may take besides the campaign's. Block sizes: multiples of 32 (the CPU
# attention backend's requirement). Chunked prefill off needs a token budget that holds the
# longest prompt (vLLM refuses less): it is raised to max_model_len with it.
VARIANTS: dict[str, tuple[Any, ...]] = {
    "enable_prefix_caching": (False,),
    "enable_chunked_prefill": (False,),
    "block_size": (64, 128),
    "max_num_seqs": (2, 4),
    "max_num_batched_tokens": (256, 512),
    "long_prefill_token_threshold": (64, 256),
}


def with_knob(engine: EngineConfig, knob: str, value: Any) -> EngineConfig:
    """``engine`` with one knob set, and what vLLM requires with it."""
    update: dict[str, Any] = {knob: value}
    if knob == "enable_chunked_prefill" and not value:
        update["max_num_batched_tokens"] = max(engine.max_num_batched_tokens, engine.max_model_len)
    if knob == "max_num_batched_tokens" and not engine.enable_chunked_prefill:
        return engine  # without chunking the budget must hold a whole prompt
    return engine.model_copy(update=update)


def draw(seed: int, engine: EngineConfig, p: float) -> EngineConfig:
    """The engine of trace ``seed``: ``engine``, or with probability ``p`` one knob moved."""
    rng = random.Random(f"kvfuzz/engine-config/{seed}")
    if p <= 0 or rng.random() >= p:
        return engine
    knob = rng.choice(sorted(VARIANTS))
    return with_knob(engine, knob, rng.choice(VARIANTS[knob]))


def moved(engine: EngineConfig, base: EngineConfig) -> dict[str, Any]:
    """The knobs of ``VARIANTS`` on which ``engine`` differs from ``base``."""
    return {k: getattr(engine, k) for k in sorted(VARIANTS) if getattr(engine, k) != getattr(base, k)}


def region(engine: EngineConfig, base: EngineConfig | None = None) -> str:
    """A configuration's region: ``default``, or its moved knobs (``block_size=64``; chunked
    prefill off reads ``enable_chunked_prefill=False`` alone: its raised budget follows from it)."""
    knobs = moved(engine, base or _BASE)
    if knobs.get("enable_chunked_prefill") is False:
        knobs.pop("max_num_batched_tokens", None)
    return "+".join(f"{k}={v}" for k, v in knobs.items()) or "default"


def mutate_knob(engine: EngineConfig, rng: random.Random, base: EngineConfig | None = None) -> EngineConfig | None:
    """``engine`` with one knob moved: back to ``base``'s value where it differs, else to a
    variant. None when nothing changes."""
    base = base or _BASE
    knob = rng.choice(sorted(VARIANTS))
    current = getattr(engine, knob)
    choices = [v for v in (getattr(base, knob), *VARIANTS[knob]) if v != current]
    out = with_knob(engine, knob, rng.choice(choices)) if choices else engine
    if knob == "enable_chunked_prefill" and out.enable_chunked_prefill and not engine.enable_chunked_prefill:
        out = out.model_copy(update={"max_num_batched_tokens": base.max_num_batched_tokens})
    return None if out == engine else out


def counts_text(counts: Mapping[str, int]) -> str:
    """Traces per region, most first."""
    return ", ".join(f"{r} {n}" for r, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


_BASE = EngineConfig()
