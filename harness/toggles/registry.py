"""The toggle registry and the process-wide active set."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from traces.errors import BadInput

ENV_VAR = "KVFUZZ_TOGGLES"


class ToggleError(BadInput):
    """A toggle cannot be applied to the installed vLLM (its self-check failed)."""


@dataclass
class Toggle:
    name: str
    kind: Literal["fix", "fault"]
    # The vLLM issue / PR the toggle models, e.g. "vllm#38606".
    models: str
    # Which vLLM process the patched code runs in.
    process: Literal["engine-core", "worker", "api-server"]
    # The patched code path, e.g. "vllm.v1.core.kv_cache_utils._gen_lora_extra_hash_keys".
    target: str
    # Devices / backends on which the toggle can change outputs ("cpu", "cuda").
    backends: tuple[str, ...]
    # vLLM versions the patch was written against.
    versions: str
    description: str
    # Returns None when the target code looks as expected, else why not.
    check: Callable[[], str | None]
    # Installs the (gated) patch. Called only after check() passed; must be idempotent.
    patch: Callable[[], None]
    installed: bool = field(default=False, repr=False)


REGISTRY: dict[str, Toggle] = {}
_ACTIVE: set[str] = set()


def register(t: Toggle) -> Toggle:
    REGISTRY[t.name] = t
    return t


def _load_builtin() -> None:
    from . import builtin  # noqa: F401  (registers on import)


def get(name: str) -> Toggle:
    _load_builtin()
    try:
        return REGISTRY[name]
    except KeyError:
        raise BadInput(f"unknown toggle {name!r} (known: {', '.join(sorted(REGISTRY))})", field="toggles") from None


def install(names: Iterable[str]) -> None:
    """Self-check and install the named toggles' patches (inactive until activated)."""
    for name in names:
        t = get(name)
        if t.installed:
            continue
        problem = t.check()
        if problem:
            raise ToggleError(f"cannot apply toggle {name!r} to the installed vLLM: {problem}", field="toggles")
        t.patch()
        t.installed = True


def is_active(name: str) -> bool:
    return name in _ACTIVE


def active() -> frozenset[str]:
    return frozenset(_ACTIVE)


@contextlib.contextmanager
def activate(names: Iterable[str]) -> Iterator[None]:
    """Make exactly ``names`` active for the duration (installing them if needed)."""
    names = list(names)
    install(names)
    saved = set(_ACTIVE)
    _ACTIVE.clear()
    _ACTIVE.update(names)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)


def set_active(names: Iterable[str]) -> None:
    """Install and activate for the rest of the process (used by the server plugin)."""
    names = list(names)
    install(names)
    _ACTIVE.clear()
    _ACTIVE.update(names)


def status() -> list[tuple[Toggle, str | None]]:
    """Every toggle with its self-check result on the installed vLLM (None = applicable)."""
    _load_builtin()
    out = []
    for t in REGISTRY.values():
        try:
            problem = t.check()
        except Exception as e:  # a check must never take the listing down
            problem = f"self-check raised {type(e).__name__}: {e}"
        out.append((t, problem))
    return out
