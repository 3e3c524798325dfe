"""The calibration profile: how far batch-order floating-point noise moves temperature-0
logprobs on one device, dtype, model and set of numerics-relevant engine flags. Measured by
``kvfuzz calibrate`` (kvfuzz/driver/calibrate.py); the oracle's noise bounds come from it
(oracle/noise.py). Versioned plain data, stored as JSON in the kvfuzz cache
(``calibration/<key id>.json``) or wherever ``--out`` says."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import BadInput
from .io import atomic_write_text
from .paths import kvfuzz_cache

CALIBRATION_VERSION: Final = 2


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class NoiseKey(_Data):
    """What numeric noise depends on. A profile applies to a campaign whose key is equal: the
    same device (and its model: AVX2 and AVX-512 kernels differ, so do GPUs), dtype, model
    content, vLLM build, attention backend, and the flags that change how a prompt is split
    into kernel calls."""

    device: str
    device_name: str = "unknown"
    dtype: Literal["float32", "bfloat16", "float16"]
    model: str
    model_hash: str | None = None
    vllm: str | None = None
    attention_backend: str = "default"
    chunked_prefill: bool = True
    max_num_batched_tokens: int = 2048
    block_size: int = 32
    lora: bool = False

    def id(self) -> str:
        data = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


class ContextNoise(_Data):
    """One batch context (all at once, staggered, reversed, chunked prefill, prefix hits,
    preempted and recomputed): each request's run compared with the same request alone."""

    name: str
    requests: int = 0
    # Generated positions compared (while the run's tokens equal the alone run's).
    positions: int = 0
    # Requests whose tokens differed from alone, the reference margin and the pair shift
    # (reference margin + the run's own margin) at each first differing token.
    flips: int = 0
    flip_margins: list[float] = Field(default_factory=list)
    flip_shifts: list[float] = Field(default_factory=list)
    # Largest |chosen-token logprob difference|, run vs alone, decode vs decode (before a flip).
    max_dlogprob: float = 0.0
    # Largest |top-1 minus top-2 margin difference| where both chose the same two tokens.
    max_dmargin: float = 0.0
    # Largest |the run's decode logprob - the same token scored alone by teacher forcing|, over
    # every generated position (after a flip too: the run's own tokens are scored).
    max_teacher: float = 0.0
    # Largest |prompt-token logprob difference|, run vs alone, over the prompts of requests that
    # ask for them: a prefill in the batch against the same prefill alone.
    max_prompt: float = 0.0
    # What the context did, so a profile shows it exercised what it claims.
    prefix_hit_requests: int = 0
    chunked_requests: int = 0
    preempted_requests: int = 0


class CalibrationProfile(_Data):
    schema_version: Literal[2] = CALIBRATION_VERSION
    kind: Literal["calibration"] = "calibration"
    key: NoiseKey
    created: str | None = None
    seconds: float = 0.0
    requests: int = 0
    max_tokens: int = 0
    contexts: list[ContextNoise] = Field(default_factory=list)
    # Contexts the time budget left out.
    skipped: list[str] = Field(default_factory=list)
    # Largest |decode logprob - teacher-forced logprob| of requests alone: what the
    # teacher-forced comparison itself adds (prefill and decode kernels differ).
    prefill_vs_decode: float = 0.0
    # The bounds computed from it when it was written (oracle/noise.py recomputes them).
    headroom: float = 0.0
    bounds: dict[str, float] = Field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.key.id()


# Where profiles are read and written instead of the kvfuzz cache's: a test run (and every
# kvfuzz process it starts) judges only by the profiles it measures.
CALIBRATION_DIR_ENV = "KVFUZZ_CALIBRATION_DIR"


def calibration_dir() -> Path:
    env = os.environ.get(CALIBRATION_DIR_ENV)
    return Path(env) if env else kvfuzz_cache() / "calibration"


def profile_path(key: NoiseKey, directory: Path | None = None) -> Path:
    return (directory or calibration_dir()) / f"{key.dtype}-{key.id()}.json"


def save_profile(profile: CalibrationProfile, path: Path | None = None) -> Path:
    path = path or profile_path(profile.key)
    atomic_write_text(path, profile.model_dump_json(indent=2) + "\n")
    return path


def load_profile(path: Path) -> CalibrationProfile:
    try:
        return CalibrationProfile.model_validate_json(Path(path).read_text())
    except OSError as e:
        raise BadInput(f"cannot read calibration profile: {e.strerror}", source=str(path)) from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "profile"
        if where == "schema_version":
            raise BadInput(f"schema_version: a version-{err.get('input')} profile; this kvfuzz reads version "
                           f"{CALIBRATION_VERSION} (measure it again with kvfuzz calibrate)", source=str(path)) from None
        raise BadInput(f"{where}: {err['msg']}", source=str(path)) from None


def find_profile(key: NoiseKey, directory: Path | None = None) -> CalibrationProfile | None:
    """The stored profile for exactly ``key``, or None. A damaged file is no profile (it will
    be measured again), not an error: the cache is kvfuzz's own."""
    path = profile_path(key, directory)
    if not path.exists():
        return None
    try:
        profile = load_profile(path)
    except BadInput:
        return None
    return profile if profile.key == key else None


# `kvfuzz run` calibrates before it fuzzes within this budget (at most a minute on the
# embedded default on CPU); the first contexts are the ones that move numerics most.
DEFAULT_BUDGET_S = 60.0
# `kvfuzz calibrate` measures every context by default (a few minutes on 2 CPU cores).
FULL_BUDGET_S = 600.0
