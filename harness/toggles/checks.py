"""Self-check helpers: does the installed vLLM still have the code a patch was written for?

A toggle that silently did nothing on a newer vLLM would make the detector look blind (or a
fix look effective) for the wrong reason, so every patch names the functions it wraps, their
parameters, and source fragments its logic depends on. Imports are lazy: listing toggles must
work without starting an engine.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def resolve(module: str, qualname: str) -> Any:
    """``module`` + dotted ``qualname`` (``Class.method``) -> the object; raises on failure."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def unwrap(obj: Any) -> Any:
    """The vLLM original below any kvfuzz wrappers."""
    while getattr(obj, "__kvfuzz_tags__", None) is not None or getattr(obj, "__kvfuzz_patch__", False):
        obj = obj.__wrapped__
    return obj


def _describe(module: str, qualname: str) -> str:
    return f"{module}.{qualname}"


def expect_source(module: str, qualname: str, *needles: str) -> str | None:
    """None if ``module.qualname`` exists and its source contains every needle."""
    try:
        obj = resolve(module, qualname)
    except Exception as e:
        return f"{_describe(module, qualname)} not found ({type(e).__name__}: {e})"
    obj = unwrap(obj)  # look through our own patches if installed
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        return f"{_describe(module, qualname)}: source unavailable ({e})"
    for n in needles:
        if n not in src:
            return f"{_describe(module, qualname)} no longer contains {n!r}"
    return None


def expect_params(module: str, qualname: str, *params: str) -> str | None:
    """None if ``module.qualname`` is callable with parameters named ``params`` (in order,
    as a prefix of its signature, ``self`` included for methods)."""
    try:
        obj = resolve(module, qualname)
    except Exception as e:
        return f"{_describe(module, qualname)} not found ({type(e).__name__}: {e})"
    obj = unwrap(obj)
    try:
        got = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as e:
        return f"{_describe(module, qualname)}: no signature ({e})"
    if got[: len(params)] != list(params):
        return f"{_describe(module, qualname)} signature is ({', '.join(got)}), expected ({', '.join(params)}, ...)"
    return None


def expect_attr(module: str, qualname: str) -> str | None:
    try:
        resolve(module, qualname)
    except Exception as e:
        return f"{_describe(module, qualname)} not found ({type(e).__name__}: {e})"
    return None


def first_problem(*results: str | None) -> str | None:
    for r in results:
        if r:
            return r
    return None


def wrap_method(cls: type, name: str, make: Any, *, tag: str) -> None:
    """Replace ``cls.name`` with ``make(original)``. Several toggles may wrap the same method
    (each wrapper calls the one below); ``tag`` makes a repeated install a no-op."""
    current = cls.__dict__.get(name, getattr(cls, name))
    layer = current
    while layer is not None:
        if tag in getattr(layer, "__kvfuzz_tags__", ()):
            return
        layer = getattr(layer, "__wrapped__", None)
    patched = make(current)
    patched.__wrapped__ = current  # type: ignore[attr-defined]
    patched.__kvfuzz_tags__ = (tag,)  # type: ignore[attr-defined]
    patched.__name__ = getattr(current, "__name__", name)
    patched.__qualname__ = getattr(current, "__qualname__", name)
    setattr(cls, name, patched)
