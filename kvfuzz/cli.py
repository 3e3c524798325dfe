"""The ``kvfuzz`` command line. Thin: each command wires the rooms together and reports.

Exit codes everywhere: 0 done (findings or not), 1 divergence reproduced / gate failed,
2 bad input (one line naming the file and field), 3 infrastructure failure (engine or server
would not start, died, or a URL does not answer).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from kvfuzz import arms as arms_opts
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


def wide_console() -> Console:
    """``console`` on a terminal; piped or logged, a 160-column one, so wide tables (toggle
    names, finding paths, verdicts) are not squeezed into 80 columns."""
    return console if console.is_terminal else Console(width=160, soft_wrap=True)


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
    resume: Annotated[bool, typer.Option(help="Continue the interrupted campaign in --out (same seed sequence).")] = False,
    corpus: Annotated[Optional[Path], typer.Option(help="Corpus directory: seeds the campaign, novel traces join it "
                                                       "(default: <out>/corpus).")] = None,
    feedback: Annotated[bool, typer.Option("--feedback/--no-feedback",
                                           help="Mutate corpus entries that reached new coverage buckets "
                                                "(--no-feedback: plain random generation).")] = True,
    operators: Annotated[Optional[str], typer.Option(help="Comma-separated mutation operators to use "
                                                          "(default: all; see docs/fuzzer.md).")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kv_cache_mb: Annotated[int, typer.Option(min=1, help="KV cache size in MiB.")] = 24,
    near_tie: Annotated[Optional[float], typer.Option(help="Margin (nats) below which a divergence is a numeric "
                                                           "near-tie (default: per dtype, docs/oracle.md).")] = None,
    minimize: Annotated[bool, typer.Option("--minimize/--no-minimize", help="Minimize each finding (the original "
                                                                             "is kept in OUT/originals).")] = True,
    minimize_seconds: Annotated[float, typer.Option(min=1, help="Time limit per minimization.")] = 120.0,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Run control arms on findings.")] = True,
    engine_kind: Annotated[str, typer.Option("--engine", help="inprocess (step-exact) or server (a managed vLLM OpenAI server).")] = "inprocess",
    server_arg: Annotated[Optional[list[str]], typer.Option("--server-arg", help="Extra flag for the managed server (repeatable).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port of the managed server on 127.0.0.1 (default: a free "
                                                     "one).")] = None,
    model: Annotated[Optional[Path], typer.Option(help="A model directory to fuzz instead of the embedded "
                                                       "default (no --lora).")] = None,
    max_requests: Annotated[int, typer.Option(min=1, max=1000, help="Most requests in a generated trace.")] = 10,
    max_model_len: Annotated[Optional[int], typer.Option(min=64, help="Engine context length; also caps generated "
                                                                      "prompt lengths (small = fast traces).")] = None,
    trace_timeout: Annotated[float, typer.Option(help="Seconds one run of a trace may take (in-process engine) / "
                                                      "one request may take (server) before it counts as a "
                                                      "hang.")] = 600.0,
    with_: arms_opts.WithOpt = None,
    without: arms_opts.WithoutOpt = None,
    arms: arms_opts.ArmsOpt = None,
    attribute: arms_opts.AttributeOpt = True,
) -> None:
    """Fuzz the embedded default model on the in-process vLLM engine or a managed vLLM server.

    By default each trace runs on unmodified vLLM (arm "vanilla") and every divergence is
    re-run in the clean arm to say which toggle explains it; unexplained ones are candidate
    new vLLM bugs and are listed first."""
    from fuzzer import CampaignOptions, default_engine, run_campaign
    from kvfuzz.display import CampaignDisplay
    from kvfuzz.session import Session
    from oracle import Thresholds
    from traces import load_finding

    if budget is None and traces_n is None:
        budget = 60.0
    if budget is not None and budget <= 0:
        raise BadInput("must be positive", field="--budget")
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    if engine_kind not in ("inprocess", "server"):
        raise BadInput(f"unknown engine {engine_kind!r} (inprocess or server)", field="--engine")
    arm_map = arms_opts.build_arms(with_=with_, without=without, arms=arms, device=device)
    if near_tie is not None and not near_tie >= 0:
        raise BadInput("must be >= 0", field="--near-tie")
    if not trace_timeout > 0:
        raise BadInput("must be positive", field="--trace-timeout")
    if port is not None and not 0 < port < 65536:
        raise BadInput(f"{port} is not a TCP port", field="--port")
    if port is not None and engine_kind != "server":
        raise BadInput("only with --engine server", field="--port")
    overrides: dict[str, Any] = {}
    if model is not None:
        if not model.is_dir():
            raise BadInput("no such model directory" if not model.exists() else "is not a directory",
                           source=str(model), field="--model")
        if not (model / "config.json").is_file():
            raise BadInput("not a model directory (no config.json)", source=str(model), field="--model")
        if lora:
            raise BadInput("--lora uses the embedded model's adapters; it cannot be combined with --model",
                           field="--model")
        overrides["model"] = str(model.resolve())
        from traces.paths import allow

        allow(model)  # named on the command line: its findings may be replayed from here
    out.mkdir(parents=True, exist_ok=True)
    if max_model_len is not None:
        overrides["max_model_len"] = max_model_len
    engine = default_engine(lora=lora, kv_cache_bytes=kv_cache_mb * 2**20, **overrides)
    if corpus is not None and corpus.exists() and not corpus.is_dir():
        raise BadInput("is not a directory", source=str(corpus), field="--corpus")
    if resume and not (out / "campaign.json").exists():
        raise BadInput("nothing to resume: no campaign.json", source=str(out), field="--resume")
    from fuzzer.mutate import OPERATORS

    ops = None
    if operators:
        ops = [o.strip() for o in operators.split(",") if o.strip()]
        unknown = [o for o in ops if o not in OPERATORS]
        if unknown or not ops:
            raise BadInput(f"unknown operator {unknown[0] if unknown else operators!r} "
                           f"(known: {', '.join(OPERATORS)})", field="--operators")
    from fuzzer import GenOptions

    gen = GenOptions(min_requests=min(2, max_requests), max_requests=max_requests,
                     adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [])
    opts = CampaignOptions(seed=seed, budget_s=budget, max_traces=traces_n, runs=runs, out=out, engine=engine, gen=gen,
                           resume=resume, corpus=corpus, mode="feedback" if feedback else "random", operators=ops,
                           # Naming an engine-changing operator (small_kv) is asking for restarts.
                           allow_engine_changes=bool(ops) and any(OPERATORS[o].changes_engine for o in ops))
    server_options = None
    if engine_kind == "server":
        from harness.server import ServerOptions

        server_options = ServerOptions(device=device, extra_flags=list(server_arg or []), log_dir=out, port=port,
                                       request_timeout_s=trace_timeout)
    session = Session(engine_kind=engine_kind, device=device, runs=runs, thresholds=Thresholds(near_tie=near_tie),
                      log_file=out / "engine.log", server_options=server_options, attribute=attribute,
                      trace_deadline_s=trace_timeout)
    from kvfuzz.recovery import Recovering

    # A trace that kills or hangs the engine becomes an engine-crash finding; the engine restarts.
    guard = Recovering(session)
    display = CampaignDisplay(console, budget_s=budget, max_traces=traces_n)

    def check_trace(t: Any) -> Any:
        checked = guard.check(t, arms=arm_map)
        finding = getattr(checked, "finding", checked)
        if finding is None or not (minimize or controls) or finding.worst_class() == "engine-crash":
            # An engine crash is not minimized here: each replay could crash the engine again.
            return checked
        from kvfuzz.commands.minimize import finish_finding

        display.status(f"finding {finding.id}: " + ("minimizing" if minimize else "control arms"))
        small = finish_finding(session, finding, out=out, device=device, do_minimize=minimize, controls=controls,
                               max_seconds=minimize_seconds)
        display.status("fuzzing")
        # The campaign learns coverage from this trace's histories and records the small finding.
        return dataclasses.replace(checked, finding=small)

    try:
        with display:
            log_name = "engine.log" if engine_kind == "inprocess" else "server-1.log"
            display.status("starting vLLM %s (log: %s)" % ("engine" if engine_kind == "inprocess" else "server",
                                                           out / log_name))
            session.engine_for(engine)
            display.status("fuzzing")
            state = run_campaign(opts, check_trace, display.update)
    finally:
        session.close()
    display.summary(state, out)
    console.print("arms: " + "; ".join(f"{a} = [{', '.join(ts) or 'no toggles'}]" for a, ts in arm_map.items()),
                  markup=False, highlight=False)
    findings = [(f, load_finding(out / f)) for f in state.finding_files]
    arms_opts.print_attribution(wide_console(), findings)


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
