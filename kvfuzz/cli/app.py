"""The ``kvfuzz`` Typer app and its consoles. Commands live in ``kvfuzz.cli.commands`` (one
module each) and register themselves on ``app``; ``kvfuzz.cli.main`` imports them and runs it.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Concurrency fuzzer and temperature-0 determinism oracle for vLLM's paged KV cache.",
)
model_app = typer.Typer(no_args_is_help=True, help="The embedded default model.")
app.add_typer(model_app, name="model")

console = Console(stderr=False)
err_console = Console(stderr=True)


def wide_console() -> Console:
    """``console`` on a terminal; piped or logged, a 160-column one, so wide tables (toggle
    names, finding paths, verdicts) are not squeezed into 80 columns."""
    return console if console.is_terminal else Console(width=160, soft_wrap=True)


def debug_enabled() -> bool:
    return "--debug" in sys.argv or os.environ.get("KVFUZZ_DEBUG") == "1"


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    if debug:
        os.environ["KVFUZZ_DEBUG"] = "1"
