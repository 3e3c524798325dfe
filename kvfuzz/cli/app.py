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

def make_console(*, stderr: bool = False) -> Console:
    """The terminal's width on a terminal. Piped, or in a CI log, rich would assume 80 columns
    and squeeze or clip wide tables (toggle names, finding paths, verdicts): there the width is
    $COLUMNS, else 200, and table cells fold rather than clip."""
    probe = Console(stderr=stderr)
    if probe.is_terminal:
        return probe
    return Console(stderr=stderr, width=int(os.environ.get("COLUMNS") or 0) or 200)


console = make_console()
err_console = make_console(stderr=True)


def debug_enabled() -> bool:
    return "--debug" in sys.argv or os.environ.get("KVFUZZ_DEBUG") == "1"


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
          verbose: Annotated[bool, typer.Option("--verbose", help="Show vLLM's and torch's own output (warnings, "
                                                "progress bars); otherwise it goes to the engine log.")] = False,
          ) -> None:
    if debug:
        os.environ["KVFUZZ_DEBUG"] = "1"
    if verbose:
        os.environ["KVFUZZ_VERBOSE"] = "1"
