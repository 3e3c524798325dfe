"""The ``kvfuzz`` command line. Thin: each command wires the rooms together and reports.

Exit codes everywhere: 0 done (findings or not), 1 divergence reproduced / gate failed,
2 bad input (one line naming the file and field), 3 infrastructure failure (engine or server
would not start, died, or a URL does not answer).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from traces.errors import BadInput, InfraError, KvfuzzError

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


def _debug_enabled() -> bool:
    return "--debug" in sys.argv or os.environ.get("KVFUZZ_DEBUG") == "1"


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False) -> None:
    if debug:
        os.environ["KVFUZZ_DEBUG"] = "1"


# -- schema / model ---------------------------------------------------------------------------


@app.command()
def schema(
    kind: Annotated[str, typer.Argument(help="trace or finding")] = "trace",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file.")] = None,
) -> None:
    """Print the JSON Schema of the trace or finding format."""
    import traces

    schemas = traces.json_schemas()
    if kind not in schemas:
        raise BadInput(f"unknown schema {kind!r} (choose from {', '.join(schemas)})", field="kind")
    text = json.dumps(schemas[kind], indent=2, sort_keys=True) + "\n"
    if out:
        traces.atomic_write_text(out, text)
        console.print(f"wrote {out}")
    else:
        sys.stdout.write(text)


@model_app.command("build")
def model_build(
    out: Annotated[Optional[Path], typer.Option(help="Directory (default: the kvfuzz cache).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the embedded tiny Qwen2 model, tokenizer and LoRA adapters (deterministic)."""
    from harness import embedded

    m = embedded.build(out, force=force)
    console.print(f"model    {m.model_dir}")
    for name, p in m.adapters.items():
        console.print(f"adapter  {name}: {p}")
    console.print(f"content hash {m.content_hash}")


# -- run --------------------------------------------------------------------------------------


@app.command()
def run(
    budget: Annotated[Optional[float], typer.Option(help="Seconds to fuzz (default 60 unless --traces).")] = None,
    traces_n: Annotated[Optional[int], typer.Option("--traces", help="Number of traces to run.")] = None,
    seed: Annotated[int, typer.Option(help="Campaign seed.")] = 0,
    runs: Annotated[int, typer.Option(min=1, help="Runs of each trace (K).")] = 3,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("kvfuzz-out"),
    lora: Annotated[bool, typer.Option("--lora/--no-lora", help="Mix LoRA adapter requests in.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue the campaign in --out.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kv_cache_mb: Annotated[int, typer.Option(min=1, help="KV cache size in MiB.")] = 24,
    near_tie: Annotated[Optional[float], typer.Option(help="Margin (nats) below which a divergence is a numeric "
                                                           "near-tie (default: per dtype, docs/oracle.md).")] = None,
    minimize: Annotated[bool, typer.Option("--minimize/--no-minimize", help="Minimize each finding (the original "
                                                                             "is kept in OUT/originals).")] = True,
    minimize_seconds: Annotated[float, typer.Option(min=1, help="Time limit per minimization.")] = 120.0,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Run control arms on findings.")] = True,
) -> None:
    """Fuzz the embedded default model on the in-process vLLM engine."""
    from fuzzer import CampaignOptions, default_engine, run_campaign
    from kvfuzz.display import CampaignDisplay
    from kvfuzz.session import Session
    from oracle import Thresholds

    if budget is None and traces_n is None:
        budget = 60.0
    if budget is not None and budget <= 0:
        raise BadInput("must be positive", field="--budget")
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    if near_tie is not None and not near_tie >= 0:
        raise BadInput("must be >= 0", field="--near-tie")
    out.mkdir(parents=True, exist_ok=True)
    engine = default_engine(lora=lora, kv_cache_bytes=kv_cache_mb * 2**20)
    opts = CampaignOptions(seed=seed, budget_s=budget, max_traces=traces_n, runs=runs, out=out, engine=engine,
                           resume=resume)
    session = Session(device=device, runs=runs, thresholds=Thresholds(near_tie=near_tie),
                      log_file=out / "engine.log")
    display = CampaignDisplay(console, budget_s=budget, max_traces=traces_n)

    def check_trace(t: Any) -> Any:
        finding = session.check(t).finding
        if finding is None or not (minimize or controls):
            return finding
        from kvfuzz.commands.minimize import finish_finding

        display.status(f"finding {finding.id}: " + ("minimizing" if minimize else "control arms"))
        small = finish_finding(session, finding, out=out, device=device, do_minimize=minimize, controls=controls,
                               max_seconds=minimize_seconds)
        display.status("fuzzing")
        return small

    try:
        with display:
            display.status("starting vLLM engine (log: %s)" % (out / "engine.log"))
            session.engine_for(engine)
            display.status("fuzzing")
            state = run_campaign(opts, check_trace, display.update)
    finally:
        session.close()
    display.summary(state, out)


# -- entry point ------------------------------------------------------------------------------


def _register_optional_commands() -> None:
    # Commands contributed by later modules register themselves on `app` when imported.
    import importlib

    for mod in ("kvfuzz.commands",):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def main() -> None:
    _register_optional_commands()
    try:
        app(standalone_mode=True)
    except KvfuzzError as e:
        if _debug_enabled():
            traceback.print_exc()
        err_console.print(f"kvfuzz: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        err_console.print("kvfuzz: interrupted", markup=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
