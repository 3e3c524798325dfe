"""Wiring of the rooms: trace -> harness -> history -> oracle -> finding.

A ``Session`` owns one engine at a time (restarting it when a trace needs another engine
configuration) and the reference memo, and turns a trace into verdicts and, when something
diverged, a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.base import Engine
from harness.runner import Recording, ReferenceStore, record
from oracle import Thresholds, check, divergent, make_finding
from traces import Divergence, EngineConfig, Finding, Trace
from traces.errors import BadInput


def engine_kind(engine: str, base_url: str | None, device: str) -> str:
    """The engine kind the shared CLI options name (``--engine``, ``--base-url``, ``--device``):
    ``url`` when a base URL is given, else ``inprocess`` or ``server``."""
    if base_url is not None:
        kind = "url"
    elif engine in ("inprocess", "server"):
        kind = engine
    else:
        raise BadInput(f"unknown engine {engine!r} (inprocess or server)", field="--engine")
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    return kind


@dataclass
class Checked:
    recording: Recording
    verdicts: list[Divergence]
    finding: Finding | None


@dataclass
class Session:
    engine_kind: str = "inprocess"
    device: str = "cpu"
    runs: int = 3
    thresholds: Thresholds = field(default_factory=Thresholds)
    log_file: Path | None = None
    engine: Engine | None = None
    references: ReferenceStore = field(default_factory=ReferenceStore)
    # engine_kind "server": harness.server.ServerOptions; "url": the server's address.
    server_options: Any = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    # Explain every divergence by re-running in the clean / single-toggle arms (kvfuzz run).
    attribute: bool = False
    # In-process engine: wall-clock deadline of one run of a trace (docs/reliability.md).
    trace_deadline_s: float | None = 600.0

    @classmethod
    def for_target(cls, kind: str, *, device: str, runs: int, out: Path, near_tie: float | None = None,
                   base_url: str | None = None, api_key: str | None = None, model: str | None = None,
                   server_flags: list[str] | None = None, attribute: bool = False) -> "Session":
        """A session on the engine the replay-style commands name (in-process, a managed
        server with its logs in ``out``, or a server at ``base_url``)."""
        from harness.server import ServerOptions

        return cls(engine_kind=kind, device=device, runs=runs, thresholds=Thresholds(near_tie=near_tie),
                   log_file=out / "engine.log", base_url=base_url, api_key=api_key, model=model,
                   server_options=ServerOptions(device=device, extra_flags=list(server_flags or []), log_dir=out),
                   attribute=attribute)

    def engine_for(self, config: EngineConfig) -> Engine:
        if self.engine is not None and self.engine.compatible(config):
            return self.engine
        self.close()
        if self.engine_kind == "inprocess":
            from harness.inprocess import InProcessEngine

            self.engine = InProcessEngine(config, device=self.device, log_file=self.log_file,
                                          trace_deadline_s=self.trace_deadline_s).start()
        elif self.engine_kind == "server":
            from harness.server import ServerEngine, ServerOptions

            opts = self.server_options or ServerOptions(
                device=self.device, log_dir=self.log_file.parent if self.log_file else Path("kvfuzz-out"))
            self.engine = ServerEngine(config, options=opts).start()
        elif self.engine_kind == "url":
            from harness.url import UrlEngine

            assert self.base_url is not None
            self.engine = UrlEngine(config, self.base_url, api_key=self.api_key, model=self.model).start()
        else:
            raise ValueError(f"engine kind {self.engine_kind!r} is not available")
        # References depend on the engine configuration (the memo key includes it), so the
        # store can be kept across restarts.
        return self.engine

    def check(self, trace: Trace, *, runs: int | None = None, arms: dict[str, list[str]] | None = None,
              attribute: bool | None = None) -> Checked:
        """Record ``trace`` in ``arms`` (default: its own toggles) and check it. With
        attribution on, a divergence re-runs the trace in the clean arm (and single-toggle arms
        when needed) so each divergence says which toggle explains it, or that none does."""
        engine = self.engine_for(trace.engine)
        runs = runs or self.runs
        rec = record(engine, trace, runs=runs, arms=arms, store=self.references)
        verdicts = check(trace, rec.histories, rec.references, self.thresholds)
        notes: dict = {}
        if (self.attribute if attribute is None else attribute) and divergent(verdicts):
            verdicts, notes = self._attribute(engine, trace, rec, verdicts, runs)
        finding = None
        if divergent(verdicts):
            finding = make_finding(trace, rec.histories, rec.references, verdicts, rec.environment, rec.arms,
                                   thresholds=self.thresholds)
            note = getattr(engine, "reference_note", None)
            if note:
                finding.notes["references"] = note
            if notes:
                finding.notes["attribution"] = notes
        return Checked(rec, verdicts, finding)

    def _attribute(self, engine: Engine, trace: Trace, rec: Recording, verdicts: list[Divergence],
                   runs: int) -> tuple[list[Divergence], dict]:
        from harness.toggles import clean_set
        from oracle.attribution import attribute, plan

        clean = clean_set(self.device)
        extra = plan({v.arm for v in divergent(verdicts)}, rec.arms, clean)
        if extra:
            more = record(engine, trace, runs=runs, arms=extra, store=self.references)
            rec.histories.extend(more.histories)
            # A new dict: rec.arms may be the caller's arm map, reused for the next trace.
            rec.arms = {**rec.arms, **extra}
            rec.environment.toggles = sorted({t for ts in rec.arms.values() for t in ts})
            verdicts = check(trace, rec.histories, rec.references, self.thresholds)
        return attribute(verdicts, rec.arms, clean), {"clean": clean, "added_arms": sorted(extra)}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
