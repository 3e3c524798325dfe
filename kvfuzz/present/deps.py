"""The optional plotting dependency: whether it is there, and what to tell a user when not."""

from __future__ import annotations

PLOTS_HINT = "pip install 'kvfuzz[plots]'"


_HAVE: list[bool] = []


def have_matplotlib() -> bool:
    """Whether the optional plotting dependency can be imported (without importing it)."""
    if not _HAVE:
        import importlib.util

        _HAVE.append(importlib.util.find_spec("matplotlib") is not None)
    return _HAVE[0]
