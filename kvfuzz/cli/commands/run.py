"""``kvfuzz run``: a fuzzing campaign on the in-process engine or a managed server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from kvfuzz.driver import arms as arm_specs
from kvfuzz.cli import options, tables
from kvfuzz.cli.app import app, console, err_console
from kvfuzz.traces.errors import BadInput

if TYPE_CHECKING:
    from kvfuzz.scale.cluster import WorkerSpec


@app.command()
def run(
    budget: Annotated[Optional[float], typer.Option(help="Seconds to fuzz (default 60 unless --traces).")] = None,
    traces_n: Annotated[Optional[int], typer.Option("--traces", help="Number of traces to run.")] = None,
    seed: Annotated[int, typer.Option(help="Campaign seed.")] = 0,
    runs: Annotated[int, typer.Option(min=1, help="Confirmation runs (K): a trace runs once, and up to K times "
                                                  "when something diverged, to measure the rate.")] = 3,
    runs_fixed: Annotated[bool, typer.Option("--runs-fixed", help="Run every trace K times (for benchmarks: the "
                                                                  "behaviour before adaptive runs).")] = False,
    explain_: Annotated[bool, typer.Option("--explain/--no-explain", help="Causal ablation of the first finding "
                                           "of each bucket (which engine mechanisms it needs).")] = True,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("kvfuzz-out"),
    lora: Annotated[bool, typer.Option("--lora/--no-lora", help="Mix LoRA adapter requests in.")] = False,
    lifecycle: Annotated[bool, typer.Option("--lifecycle", help="Adapter lifecycle churn (implies --lora): adapters "
                                            "loaded, unloaded and reloaded between requests, max_loras / "
                                            "max_cpu_loras drawn per trace, cache_salt tenants "
                                            "(docs/fuzzer.md).")] = False,
    resume: Annotated[bool, typer.Option(help="Continue the interrupted campaign in --out (same seed sequence).")] = False,
    corpus: Annotated[Optional[Path], typer.Option(help="Corpus directory: seeds the campaign, novel traces join it "
                                                       "(default: <out>/corpus).")] = None,
    feedback: Annotated[bool, typer.Option("--feedback/--no-feedback",
                                           help="Mutate corpus entries that reached new coverage buckets "
                                                "(--no-feedback: plain random generation).")] = True,
    operators: Annotated[Optional[str], typer.Option(help="Comma-separated mutation operators to use "
                                                          "(default: all; see docs/fuzzer.md).")] = None,
    device: options.DeviceOpt = "cpu",
    kv_cache_mb: Annotated[Optional[int], typer.Option(min=1, help="KV cache size in MiB at float32 (default 24; "
                                                                    "16-bit dtypes get the same tokens in half the bytes; "
                                                                    "embedded:tiny-hybrid: 2, i.e. 127 blocks).")] = None,
    dtype: options.DtypeOpt = None,
    near_tie: options.NearTieOpt = None,
    bound: options.BoundOpt = None,
    calibration: options.CalibrationOpt = None,
    calibrate: Annotated[bool, typer.Option("--calibrate/--no-calibrate", help="With no calibration profile for "
                                            "this engine, measure one first (about a minute; kept in the cache). "
                                            "--no-calibrate: the dtype's default bounds.")] = True,
    minimize: Annotated[bool, typer.Option("--minimize/--no-minimize", help="Minimize each finding (the original "
                                                                             "is kept in OUT/originals).")] = True,
    minimize_seconds: Annotated[float, typer.Option(min=1, help="Time limit per minimization.")] = 120.0,
    triage_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of the campaign's time triage may "
                                                "spend on attribution, confirmations and witnesses (1: all it "
                                                "needs); what it cannot reach is provisional.")] = 0.15,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Run control arms on findings.")] = True,
    engine_name: options.EngineOpt = "inprocess",
    server_arg: options.ServerArgOpt = None,
    port: Annotated[Optional[int], typer.Option(help="Port of the managed server on 127.0.0.1 (default: a free "
                                                     "one).")] = None,
    model: Annotated[Optional[Path], typer.Option(help="A model directory to fuzz instead of the embedded "
                                                       "default (no --lora), or embedded:tiny-hybrid (the hybrid "
                                                       "model with the kvfuzz-store KV connector; docs/hybrid.md).")] = None,
    max_requests: Annotated[int, typer.Option(min=1, max=1000, help="Most requests in a generated trace.")] = 10,
    max_model_len: Annotated[Optional[int], typer.Option(min=64, help="Engine context length; also caps generated "
                                                                      "prompt lengths (small = fast traces).")] = None,
    trace_timeout: Annotated[float, typer.Option(help="Seconds one run of a trace may take (in-process engine) / "
                                                      "one request may take (server) before it counts as a "
                                                      "hang.")] = 600.0,
    with_: options.WithOpt = None,
    without: options.WithoutOpt = None,
    arms: options.ArmsOpt = None,
    attribute: options.AttributeOpt = True,
    ray_address: options.RayOpt = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="With --ray: how many workers (one engine each; "
                                                               "default 2).")] = None,
    window: Annotated[Optional[int], typer.Option(min=1, help="With --ray: trace i is drawn from the feedback of "
                                                              "traces 0..i-WINDOW (default 4 x workers; the same "
                                                              "seed and window give the same campaign whatever the "
                                                              "worker count; docs/scale.md).")] = None,
    vllm: options.VllmOpt = None,
    reference_store: Annotated[bool, typer.Option("--reference-store/--no-reference-store", help="Keep references "
                                                  "on disk (OUT/references and the kvfuzz cache) and reuse them "
                                                  "across traces, workers and campaigns (--no-reference-store: an "
                                                  "in-memory memo per campaign; docs/oracle.md).")] = True,
    verify_references: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of reference store hits computed "
                                                     "again and compared; any mismatch stops the campaign.")] = 0.02,
    reference_engines: Annotated[Optional[int], typer.Option(min=0, help="Reference engines beside the fuzzed one: 1 "
                                                   "computes each trace's references in a second process while the "
                                                   "trace runs (0: on the fuzzed engine, in turn). Default: 1 "
                                                   "in-process where a core (CPU) or a device (CUDA) is free beside "
                                                   "the fuzzed engine's, else 0; with --ray 0 (1: one beside each "
                                                   "worker). docs/oracle.md \"Reference engine\", docs/scale.md.")] = None,
    prompt_reuse: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Probability that a fresh trace's request "
                                                "takes a prompt (or a shared prefix) from the campaign's pool, as "
                                                "real traffic repeats prompts (default 0: off, by measurement; docs/fuzzer.md).")] = None,
    request_state: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of generated requests that carry "
                                                 "per-request state (allowed tokens, bias, EOS and stop rules, "
                                                 "min_tokens, penalties, n, prompt logprobs, prompt embeddings); some traces also "
                                                 "schedule by priority. 0: plain greedy requests only "
                                                 "(docs/fuzzer.md).")] = 0.4,
    speculative: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Share of traces run with ngram "
                                                         "speculative decoding, each request judged against the same "
                                                         "request on an engine without it (default 0.2 in-process; "
                                                         "a server campaign draws none).")] = None,
    engine_configs: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Share of traces whose engine "
                                                            "has one scheduler or KV-cache knob moved (prefix "
                                                            "caching or chunked prefill off, block size, max "
                                                            "sequences, token budget, long-prefill cap; "
                                                            "fuzzer/configs.py). Default 0.4 in-process, 0 on a "
                                                            "server (it would restart for each).")] = None,
) -> None:
    """Fuzz the embedded default model on the in-process vLLM engine or a managed vLLM server.

    By default each trace runs on unmodified vLLM (arm "vanilla") and every divergence is
    re-run in the clean arm to say which toggle explains it; unexplained ones are candidate
    new vLLM bugs and are listed first."""
    options.use_release(vllm, device=device)
    from kvfuzz.driver.calibrate import calibrate_drawn, prepare_bounds
    from kvfuzz.cli.display import CampaignDisplay
    from kvfuzz.fuzzer import CampaignOptions, default_engine, run_campaign
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.driver.settings import CampaignSettings, StoreSettings, TriageSettings
    from kvfuzz.traces import load_finding

    if budget is None and traces_n is None:
        budget = 60.0
    if ray_address is None and (workers is not None or window is not None):
        raise BadInput("only with --ray", field="--workers" if workers is not None else "--window")
    if budget is not None and budget <= 0:
        raise BadInput("must be positive", field="--budget")
    if ray_address is not None and port is not None:
        raise BadInput("one port cannot serve every Ray worker's server", field="--port")
    if reference_engines is None:
        from kvfuzz.harness.refengine import default_reference_engines

        reference_engines = default_reference_engines(engine_name, device, ray=ray_address is not None)
    if reference_engines > 1:
        raise BadInput(f"{reference_engines} reference engines are not supported yet (0 or 1)",
                       field="--reference-engines")
    if reference_engines and (engine_name != "inprocess"):
        raise BadInput("a reference engine runs beside the in-process engine only", field="--reference-engines")
    settings = CampaignSettings(
        session=options.session_settings(engine_name, device, runs=runs, near_tie=near_tie, bound=bound,
                                         calibration=calibration, server_arg=server_arg, port=port,
                                         trace_timeout=trace_timeout).model_copy(update={
            "store": StoreSettings(out=out.resolve(), verify=verify_references, seed=seed) if reference_store else None,
            "reference_engines": reference_engines}),
        arms=arm_specs.build_arms(with_=with_, without=without, arms=arms, device=device),
        triage=TriageSettings(runs_fixed=runs_fixed, attribute=attribute, minimize=minimize, controls=controls,
                              ablate=explain_, minimize_seconds=minimize_seconds, budget_s=budget,
                              share=triage_share))
    kind, arm_map = settings.session.kind, settings.arms
    dtype_r = check_dtype(dtype, device)
    overrides: dict[str, Any] = {}
    hybrid = False
    if model is not None and str(model).startswith("embedded:"):
        from kvfuzz.traces import EMBEDDED_HYBRID, EMBEDDED_MODEL

        if str(model) not in (EMBEDDED_MODEL, EMBEDDED_HYBRID):
            raise BadInput(f"unknown embedded model {str(model)!r} (have {EMBEDDED_MODEL}, {EMBEDDED_HYBRID})",
                           field="--model")
        hybrid, model = str(model) == EMBEDDED_HYBRID, None
        if hybrid and lifecycle:
            raise BadInput(f"{EMBEDDED_HYBRID} has no LoRA adapters; drop --lifecycle", field="--model")
        if hybrid and lora:
            raise BadInput(f"{EMBEDDED_HYBRID} has no LoRA adapters; drop --lora", field="--model")
    if lifecycle and model is not None:
        raise BadInput("--lifecycle uses the embedded model's adapters; it cannot be combined with --model",
                       field="--model")
    lora = lora or lifecycle
    if model is not None:
        overrides["model"] = options.model_dir(model, lora)
    out.mkdir(parents=True, exist_ok=True)
    if max_model_len is not None:
        overrides["max_model_len"] = max_model_len
    if hybrid:
        from kvfuzz.fuzzer.hybrid import BLOCK_BYTES, DEFAULT_BLOCKS, hybrid_engine

        engine = hybrid_engine(blocks=kv_cache_mb * 2**20 // BLOCK_BYTES["float32"] if kv_cache_mb else DEFAULT_BLOCKS,
                               dtype=dtype_r, **overrides)
    else:
        engine = default_engine(lora=lora, kv_cache_bytes=(kv_cache_mb or 24) * 2**20, dtype=dtype_r, **overrides)
    if corpus is not None and corpus.exists() and not corpus.is_dir():
        raise BadInput("is not a directory", source=str(corpus), field="--corpus")
    if resume and not (out / "campaign.json").exists():
        raise BadInput("nothing to resume: no campaign.json", source=str(out), field="--resume")
    from kvfuzz.fuzzer.mutate import OPERATORS

    ops = None
    if operators:
        ops = [o.strip() for o in operators.split(",") if o.strip()]
        unknown = [o for o in ops if o not in OPERATORS]
        if unknown or not ops:
            raise BadInput(f"unknown operator {unknown[0] if unknown else operators!r} "
                           f"(known: {', '.join(OPERATORS)})", field="--operators")
    from kvfuzz.fuzzer import GenOptions
    from kvfuzz.fuzzer.configs import DEFAULT_SHARE as DEFAULT_ENGINE_CONFIGS
    from kvfuzz.fuzzer.reuse import DEFAULT_PROMPT_REUSE

    # The engine settings drawn per trace (priority scheduling, prompt embeddings, speculative
    # decoding) are in-process only: a server would restart for each.
    per_trace = request_state > 0 and kind == "inprocess"
    if speculative is None:
        speculative = GenOptions.p_spec if per_trace else 0.0
    elif speculative and kind != "inprocess":
        raise BadInput("speculative decoding is drawn per trace, which a server would restart for: in-process only",
                       field="--speculative")
    if engine_configs is None:
        engine_configs = DEFAULT_ENGINE_CONFIGS if kind == "inprocess" and not lifecycle else 0.0
    elif engine_configs and kind != "inprocess":
        raise BadInput("engine configurations are drawn per trace, which a server would restart for: in-process "
                       "only", field="--engine-configs")
    gen = GenOptions(min_requests=min(2, max_requests), max_requests=max_requests,
                     adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [], lifecycle=lifecycle,
                     prompt_reuse=0.0 if lifecycle else (DEFAULT_PROMPT_REUSE if prompt_reuse is None else prompt_reuse),
                     pool_seed=seed, request_state=request_state,
                     p_priority=GenOptions.p_priority if per_trace else 0.0,
                     p_embeds=GenOptions.p_embeds if per_trace else 0.0,
                     p_spec=speculative, p_config=engine_configs)
    opts = CampaignOptions(seed=seed, budget_s=budget, max_traces=traces_n, runs=runs, out=out, engine=engine, gen=gen,
                           resume=resume, corpus=corpus, mode="feedback" if feedback else "random", operators=ops,
                           # Naming an engine-changing operator (small_kv) is asking for restarts.
                           allow_engine_changes=any(OPERATORS[o].changes_engine for o in ops or []))
    # What builds the campaign's session and triage, here or on each Ray worker (kvfuzz/scale/cluster.py;
    # it imports no Ray).
    from kvfuzz.scale.cluster import WorkerSpec

    spec = WorkerSpec(settings, log_dir=str((out / "workers").resolve()), threads=1)
    if ray_address is not None:
        _run_on_ray(ray_address, opts, spec, arm_map=arm_map, calibrate=calibrate, calibration=calibration,
                    workers=workers or 2, window=window)
        return
    session = spec.build_session(out)
    from kvfuzz.driver.recovery import Recovering

    # A trace that kills or hangs the engine becomes an engine-crash finding; the engine restarts.
    guard = Recovering(session)
    display = CampaignDisplay(console, budget_s=budget, max_traces=traces_n, out=out)
    triage = spec.build_triage(session, guard, out, status=display.status)
    pooled = spec.pooled
    if pooled:
        from kvfuzz.harness.inprocess import CAMPAIGN_POOL_SIZE, share_engines

        share_engines(CAMPAIGN_POOL_SIZE)
    try:
        with display:
            log_name = "engine.log" if kind == "inprocess" else "server-1.log"
            display.status("starting vLLM %s (log: %s)" % ("engine" if kind == "inprocess" else "server",
                                                           out / log_name))
            session.engine_for(engine)
            warned: list[str] = []
            bounds = prepare_bounds(session, engine, profile_file=calibration, calibrate_if_missing=calibrate,
                                    progress=display.status, warn=warned.append)
            if calibrate and calibration is None:
                session.calibrate_missing = calibrate_drawn(session, display.status, warned)
            display.status("fuzzing")
            state = run_campaign(opts, triage, display.update,
                                 on_start=lambda c: triage.restore(c.state.bug_buckets),
                                 ledger=session.ledger,
                                 lookahead=session.look_ahead if settings.session.reference_engines else None)
    finally:
        session.close()
        session.close_references()
        if pooled:
            from kvfuzz.harness.inprocess import unshare_engines

            unshare_engines()
    for line in warned:
        err_console.print(f"kvfuzz: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    display.summary(state, out)
    from kvfuzz.cli.time_table import print_time

    print_time(console, state.time_breakdown)
    console.print(bounds.describe(), markup=False, highlight=False)
    console.print("arms: " + "; ".join(f"{a} = [{', '.join(ts) or 'no toggles'}]" for a, ts in arm_map.items()),
                  markup=False, highlight=False)
    # The closing table speaks in buckets (display.summary): one row per bug, not per finding.




def _run_on_ray(address: str, opts: Any, spec: WorkerSpec, *, arm_map: dict[str, list[str]], calibrate: bool,
                calibration: Path | None, workers: int, window: int | None) -> None:
    """The campaign on Ray workers (docs/scale.md): the driver here owns the state, each worker
    an engine. Ray is imported only on this path."""
    from kvfuzz.cli.display import CampaignDisplay
    from kvfuzz.scale.cluster import RayExecutor, connect, local_cpus, worker_env
    from kvfuzz.fuzzer.distributed import Driver, default_window
    from kvfuzz.traces import load_finding

    threads = spec.threads
    display = CampaignDisplay(console, budget_s=opts.budget_s, max_traces=opts.max_traces, out=opts.out)
    owns = connect(None if address == "local" else address, num_cpus=local_cpus(workers, spec.cpus),
                   env=worker_env(threads))
    import ray

    driver = None
    try:
        with display:
            ex = RayExecutor(spec, workers, status=display.status)
            try:
                infos = ex.start(opts.engine, calibrate=calibrate,
                                 profile_file=str(calibration) if calibration else None)
                display.status(f"fuzzing on {workers} Ray worker(s)")
                driver = Driver(opts, ex, window=window or default_window(workers), arms=arm_map,
                                on_outcome=display.update)
                state = driver.run()
            finally:
                ex.shutdown()
    finally:
        if owns:
            ray.shutdown()
    for line in infos[0]["warnings"]:
        err_console.print(f"kvfuzz: warning: {line}", markup=False, highlight=False, soft_wrap=True)
    display.summary(state, opts.out)
    from kvfuzz.cli.time_table import print_time

    print_time(console, state.time_breakdown)
    per = 1000 * driver.driver_cpu_s / max(1, driver.committed)
    commit = 1000 * driver.commit_cpu_s / max(1, driver.committed)
    console.print(f"ray: {workers} worker(s) on {len({i['host'] for i in infos})} host(s), window {state.window}; "
                  f"per worker {dict(sorted(state.by_worker.items()))}; re-queued {state.requeued} trace(s) after "
                  f"{len(state.worker_deaths)} worker death(s); workers idle {state.window_wait_s:.0f} s in all on a full window; "
                  f"driver CPU {per:.1f} ms per trace "
                  f"({commit:.1f} ms committing)",
                  markup=False, highlight=False)
    console.print(infos[0]["bounds"], markup=False, highlight=False)
    console.print("arms: " + "; ".join(f"{a} = [{', '.join(ts) or 'no toggles'}]" for a, ts in arm_map.items()),
                  markup=False, highlight=False)
    # The closing table speaks in buckets (display.summary): one row per bug, not per finding.
