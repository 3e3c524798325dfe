"""What a command runs on, typed once.

The CLI parses its options into these values once (kvfuzz/cli/options.py). Each thing is built
from them by one function, next to what it builds: the session and the managed server's options
(kvfuzz.driver.session.build_session, server_options), a campaign's triage
(kvfuzz.triage.campaign.build_triage); a Ray worker (kvfuzz.scale.cluster.WorkerSpec) and the isolated
child of the batch-invariant control (kvfuzz.driver.isolated) receive them whole. So a setting given on
the command line reaches every engine a command starts (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvfuzz.harness.base import EngineKind
from kvfuzz.traces.calibration import CalibrationProfile
from kvfuzz.traces.errors import BadInput

Device = Literal["cpu", "cuda"]
DEVICES = ("cpu", "cuda")


def check_device(device: str, flag: str = "--device") -> Device:
    """The one place a device name is validated (every command's --device)."""
    if device not in DEVICES:
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field=flag)
    return "cuda" if device == "cuda" else "cpu"


def engine_kind(engine: str, base_url: str | None, device: str) -> EngineKind:
    """The engine kind the shared CLI options name (``--engine``, ``--base-url``, ``--device``):
    ``url`` when a base URL is given, else ``inprocess`` or ``server``."""
    check_device(device)
    if base_url is not None:
        return "url"
    if engine == "inprocess":
        return "inprocess"
    if engine == "server":
        return "server"
    raise BadInput(f"unknown engine {engine!r} (inprocess or server)", field="--engine")


class StoreSettings(BaseModel):
    """The reference store on disk (harness/refstore.py): the campaign's tier (``out``/references,
    shared by the workers of a campaign), the kvfuzz cache's tier, and the share of hits computed
    again and compared. No StoreSettings (``--no-reference-store``): an in-memory memo only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path | None = None
    verify: float = Field(0.02, ge=0.0, le=1.0)
    # Which hits are verified: a pure function of this seed (a resumed campaign checks alike).
    seed: int = 0


class SessionSettings(BaseModel):
    """Where traces run and how they are judged: everything a session needs besides its log
    directory. JSON-safe (the isolated child and Ray workers receive it), except the API key,
    which is never written out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: EngineKind = "inprocess"
    device: Device = "cpu"
    runs: int = Field(3, ge=1)
    # Noise bounds the user set (near_tie, drift, teacher); the others come from the matching
    # calibration profile (``profiles``, then ``profiles_dir``, default the kvfuzz cache).
    bound_overrides: dict[str, float] = Field(default_factory=dict)
    profiles: list[CalibrationProfile] = Field(default_factory=list)
    profiles_dir: Path | None = None
    # A managed server (kind "server"): extra flags and a fixed port.
    server_flags: list[str] = Field(default_factory=list)
    port: int | None = None
    # Seconds one run of a trace may take in-process, one request through a server.
    trace_timeout: float | None = 600.0
    # A server kvfuzz does not manage (kind "url").
    base_url: str | None = None
    api_key: SecretStr | None = Field(default=None, exclude=True)
    served_model: str | None = None
    store: StoreSettings | None = None
    # Reference engines beside the fuzzed one (``--reference-engines``; harness/refengine.py):
    # 0, references computed on the fuzzed engine in turn; 1, by a child process ahead of need.
    reference_engines: int = Field(0, ge=0, le=1)

    @property
    def step_exact(self) -> bool:
        return self.kind == "inprocess"


class TriageSettings(BaseModel):
    """How much each finding of a campaign is re-run (triage/campaign.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    runs_fixed: bool = False
    attribute: bool = True
    minimize: bool = True
    controls: bool = True
    ablate: bool = True
    minimize_seconds: float = 120.0
    # The campaign's --budget: triage never runs past it.
    budget_s: float | None = None
    # --triage-share: the share of the campaign's time triage may spend (triage/executor.py).
    share: float = 0.15


class CampaignSettings(BaseModel):
    """A campaign's session, arms and triage: what ``kvfuzz run`` and each Ray worker build from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session: SessionSettings = Field(default_factory=SessionSettings)
    arms: dict[str, list[str]] = Field(default_factory=dict)
    triage: TriageSettings = Field(default_factory=TriageSettings)

    @property
    def pooled(self) -> bool:
        """Whether triage's engines share a pool: its ablations replay under other engine
        configurations, and keeping those alive next to the campaign's engine saves engine
        starts per bucket (in-process engines of the embedded model are small)."""
        t = self.triage
        return self.session.kind == "inprocess" and (t.ablate or t.minimize or t.controls)
