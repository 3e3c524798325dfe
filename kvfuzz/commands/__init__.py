"""CLI commands beyond the core ones in kvfuzz/cli.py. Each module registers its commands on
``kvfuzz.cli.app`` when imported; add a module name to ``MODULES`` to expose it."""

import importlib

MODULES: list[str] = ["replay", "toggles", "bench", "minimize", "report", "gate"]

for _name in MODULES:
    importlib.import_module(f"{__name__}.{_name}")
