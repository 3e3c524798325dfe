"""What a toggle is, and which toggles are on. The toggle modules (one per toggle) declare
themselves here; the registry API (registry.py) lists, installs and activates them. Kept apart
so that no toggle module imports the registry that loads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ENV_VAR = "KVFUZZ_TOGGLES"

Kind = Literal["fix", "fault"]


@dataclass
class Toggle:
    name: str
    kind: Kind
    # The vLLM issue / PR the toggle models, e.g. "vllm#38606".
    models: str
    # Which vLLM process the patched code runs in.
    process: Literal["engine-core", "worker", "api-server"]
    # The patched code path, e.g. "vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys".
    target: str
    # Devices / backends on which the toggle can change outputs ("cpu", "cuda"). A toggle whose
    # tuple lacks the current device is still applied (its patch is real) but cannot change a
    # temperature-0 output there: detection benchmarks skip it and the clean arm leaves it out.
    backends: tuple[str, ...]
    # vLLM versions the patch was written against.
    versions: str
    description: str
    # Returns None when the target code looks as expected, else why not.
    check: Callable[[], str | None]
    # Installs the (gated) patch. Called only after check() passed; must be idempotent.
    patch: Callable[[], None]
    # Engine features the toggle's code path needs to be reached at all
    # ("prefix-caching", "lora", "chunked-prefill", "preemption", "prompt-embeds", "speculative").
    needs: tuple[str, ...] = ()
    # Forgets per-run state (e.g. bookkeeping of blocks a fault released); called whenever the
    # active set changes, i.e. between runs.
    reset: Callable[[], None] | None = None
    installed: bool = field(default=False, repr=False)

    def changes_outputs_on(self, device: str) -> bool:
        return device in self.backends


REGISTRY: dict[str, Toggle] = {}
_ACTIVE: set[str] = set()


def register(t: Toggle) -> Toggle:
    REGISTRY[t.name] = t
    return t


def is_active(name: str) -> bool:
    return name in _ACTIVE


def active() -> frozenset[str]:
    return frozenset(_ACTIVE)
