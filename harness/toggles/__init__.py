"""Fault and fix toggles: named, versioned patches of vLLM internals.

A toggle is installed once per process (``install``) and then gated by the process-wide
active set, so the in-process engine can run a reference with every fault off and the next
run with a fault on, without restarting. In a server, the plugin (``plugin.py``) installs and
activates the toggles named in ``KVFUZZ_TOGGLES`` in every vLLM process. docs/toggles.md lists
them.
"""

from .base import ENV_VAR, REGISTRY, Toggle, active, is_active
from .registry import (
    ToggleError,
    activate,
    catalog,
    clean_set,
    get,
    install,
    kinds,
    names,
    output_changing,
    self_check,
    status,
    unreachable,
)

__all__ = ["ENV_VAR", "REGISTRY", "Toggle", "ToggleError", "activate", "active", "catalog", "clean_set", "get", "install",
           "is_active", "kinds", "names", "output_changing", "self_check", "status", "unreachable"]
