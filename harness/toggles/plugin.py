"""vLLM general plugin: applies the toggles named in KVFUZZ_TOGGLES in every vLLM process,
and installs the user's own patches named in KVFUZZ_PLUGIN_MODULES.

vLLM calls every ``vllm.general_plugins`` entry point once per process (API server,
EngineCore, workers). With both variables unset this does nothing at all.

``KVFUZZ_PLUGIN_MODULES=pkg.mod:install,other.mod`` (comma separated): each module is imported
and its function (default ``install``) called with no argument, in every vLLM process. It is
the extension point for patches that are not kvfuzz toggles: a fault of one's own (the tests'
faults kvfuzz has never seen, tests/unseen_faults/), or instrumentation. Such a patch is always
on (kvfuzz's arms cannot turn it off): to the oracle it is a vLLM bug, unexplained by any toggle.
A module that cannot be imported fails the process loudly, with its name.
"""

from __future__ import annotations

import importlib
import os

from .base import ENV_VAR

PLUGIN_MODULES_VAR = "KVFUZZ_PLUGIN_MODULES"
_INSTALLED: set[str] = set()


def plugin_modules(value: str | None = None) -> list[tuple[str, str]]:
    """``(module, function)`` pairs named by the variable's value."""
    raw = os.environ.get(PLUGIN_MODULES_VAR, "") if value is None else value
    out = []
    for item in (x.strip() for x in raw.split(",")):
        if item:
            mod, _, fn = item.partition(":")
            out.append((mod.strip(), fn.strip() or "install"))
    return out


def install_plugin_modules(value: str | None = None) -> None:
    for mod, fn in plugin_modules(value):
        if f"{mod}:{fn}" in _INSTALLED:
            continue
        try:
            getattr(importlib.import_module(mod), fn)()
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"{PLUGIN_MODULES_VAR}: cannot install {mod}:{fn} ({e})") from e
        _INSTALLED.add(f"{mod}:{fn}")


def register() -> None:
    install_plugin_modules()
    names = [n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()]
    if not names:
        return
    from .registry import set_active

    set_active(names)
