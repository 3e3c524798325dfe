"""Terminal styles of the verdict classes, shared by every rendering (reports, bucket tables)."""

from __future__ import annotations

CLASS_STYLE = {"corruption": "bold red", "engine-crash": "bold magenta", "error": "red",
               "stall": "bold cyan", "numeric-near-tie": "yellow", "unconstrained": "dim", "truncation": "dim",
               "ok": "green"}
