"""vLLM general plugin: applies the toggles named in KVFUZZ_TOGGLES in every vLLM process.

vLLM calls every ``vllm.general_plugins`` entry point once per process (API server,
EngineCore, workers). With the variable unset this does nothing at all.
"""

from __future__ import annotations

import os

from .base import ENV_VAR


def register() -> None:
    names = [n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()]
    if not names:
        return
    from .registry import set_active

    set_active(names)
