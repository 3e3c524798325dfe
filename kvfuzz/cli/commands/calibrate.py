"""``kvfuzz calibrate``: measure the numeric noise floor of an engine on this device and keep
the profile the oracle judges by (kvfuzz/driver/calibrate.py, docs/oracle.md "Noise bounds")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvfuzz.cli import options
from kvfuzz.cli.app import app, console
from kvfuzz.traces.calibration import FULL_BUDGET_S, CalibrationProfile
from kvfuzz.traces.errors import BadInput


def profile_table(profile: CalibrationProfile) -> Table:
    t = Table(title=f"noise: {profile.key.dtype} on {profile.key.device_name}", header_style="bold",
              title_justify="left")
    for col in ("context", "requests", "flips (pair shift)", "max |d logprob|", "max |d margin|",
                "max teacher-forced |d|", "max prompt |d|", "prefix hits / chunked / preempted"):
        t.add_column(col, overflow="fold")
    for c in profile.contexts:
        flips = f"{c.flips}" + (f" ({', '.join(f'{s:.3g}' for s in c.flip_shifts)})" if c.flip_shifts else "")
        t.add_row(c.name, str(c.requests), flips, f"{c.max_dlogprob:.3g}", f"{c.max_dmargin:.3g}",
                  f"{c.max_teacher:.3g}", f"{c.max_prompt:.3g}",
                  f"{c.prefix_hit_requests} / {c.chunked_requests} / {c.preempted_requests}")
    t.add_row("alone: teacher forcing vs decode", str(profile.requests), "", "", "", f"{profile.prefill_vs_decode:.3g}", "", "")
    return t


def profile_markdown(profile: CalibrationProfile) -> str:
    lines = ["| context | requests | flips (pair shift) | max \\|Δ logprob\\| | max \\|Δ margin\\| | "
             "max teacher-forced \\|Δ\\| | max prompt \\|Δ\\| | prefix hits / chunked / preempted |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for c in profile.contexts:
        flips = f"{c.flips}" + (f" ({', '.join(f'{s:.3g}' for s in c.flip_shifts)})" if c.flip_shifts else "")
        lines.append(f"| {c.name} | {c.requests} | {flips} | {c.max_dlogprob:.3g} | {c.max_dmargin:.3g} | "
                     f"{c.max_teacher:.3g} | {c.max_prompt:.3g} | {c.prefix_hit_requests} / {c.chunked_requests} / {c.preempted_requests} |")
    lines.append(f"| alone: teacher forcing vs decode | {profile.requests} | | | | {profile.prefill_vs_decode:.3g} | | |")
    b = profile.bounds
    lines.append("")
    lines.append(f"Bounds (x{profile.headroom:g} headroom, floor 2 steps of {profile.key.dtype}): pair shift "
                 f"{b.get('near_tie', 0):.3g}, drift {b.get('drift', 0):.3g}, teacher-forced {b.get('teacher', 0):.3g} "
                 f"nats; {profile.seconds:g} s, {profile.requests} requests x {profile.max_tokens} tokens.")
    return "\n".join(lines) + "\n"


@app.command("calibrate")
def calibrate_cmd(
    dtype: options.DtypeOpt = None,
    device: options.DeviceOpt = "cpu",
    lora: Annotated[bool, typer.Option("--lora/--no-lora", help="The embedded model with its LoRA adapters (a "
                                                                "campaign with --lora needs its own profile).")] = False,
    model: Annotated[Optional[Path], typer.Option(help="A model directory instead of the embedded default.")] = None,
    kv_cache_mb: Annotated[int, typer.Option(min=1, help="KV cache size in MiB at float32, as the campaign's "
                                                                    "(16-bit: the same tokens in half the bytes).")] = 24,
    max_model_len: Annotated[Optional[int], typer.Option(min=64, help="Engine context length.")] = None,
    requests: Annotated[int, typer.Option(min=4, max=512, help="Requests measured in each context.")] = 16,
    max_tokens: Annotated[int, typer.Option(min=2, max=4096, help="Tokens each request generates.")] = 24,
    budget: Annotated[float, typer.Option(help="Seconds of measurement (after the engine starts); contexts beyond "
                                          "it are skipped and listed. kvfuzz run uses 60.")] = FULL_BUDGET_S,
    seed: Annotated[int, typer.Option(help="Seed of the request mix.")] = 0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the profile here (a file, or a "
                                                "directory for <dtype>-<key>.json) instead of the kvfuzz cache, "
                                                "where campaigns find it.")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Also print the table as markdown.")] = False,
    engine_name: options.EngineOpt = "inprocess",
) -> None:
    """Measure how far batch-order noise moves temperature-0 logprobs here, in every batch
    context a campaign produces, and keep the profile the oracle's noise bounds come from."""
    from kvfuzz.driver.calibrate import Plan, calibrate
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.driver.session import build_session
    from kvfuzz.traces.calibration import profile_path, save_profile

    settings = options.session_settings(engine_name, device, runs=1)
    if not budget > 0:
        raise BadInput("must be positive", field="--budget")
    overrides: dict = {"dtype": check_dtype(dtype, device)}
    if model is not None:
        overrides["model"] = options.model_dir(model, lora)
    if max_model_len is not None:
        overrides["max_model_len"] = max_model_len
    config = default_engine(lora=lora, kv_cache_bytes=kv_cache_mb * 2**20, **overrides)
    log_dir = out if out is not None and out.suffix != ".json" else Path("kvfuzz-out")
    log_dir.mkdir(parents=True, exist_ok=True)
    from kvfuzz.driver.calibrate import implausible, unclean_engine

    if (why := unclean_engine()) is not None:
        raise BadInput(f"cannot calibrate: {why}", field="KVFUZZ_PLUGIN_MODULES")
    with build_session(settings, log_dir) as session:
        console.print(f"starting vLLM ({config.dtype}, log: {log_dir / 'engine.log'})", markup=False)
        session.engine_for(config)
        profile = calibrate(session, config, Plan(requests=requests, max_tokens=max_tokens, seed=seed,
                                                  budget_s=budget),
                            progress=lambda m: console.print(m, style="dim", markup=False))
    if (why := implausible(profile)) is not None:
        raise BadInput(f"calibration refused, not saved: {why}", field="calibration")
    if out is None:
        path = save_profile(profile)
    elif out.suffix == ".json":
        path = save_profile(profile, out)
    else:
        path = save_profile(profile, profile_path(profile.key, out))
    show = console
    show.print(profile_table(profile))
    b = profile.bounds
    show.print(f"bounds (measured max x {profile.headroom:g}, at least 2 steps of {profile.key.dtype}): pair shift "
               f"{b['near_tie']:.3g}, drift {b['drift']:.3g}, teacher-forced {b['teacher']:.3g} nats", markup=False)
    if profile.skipped:
        show.print(f"skipped for the {budget:g} s budget: {', '.join(profile.skipped)}", markup=False)
    if markdown:
        show.print(profile_markdown(profile), markup=False, highlight=False, soft_wrap=True)
    show.print(f"profile written to {path} ({profile.seconds:g} s)", markup=False)
