"""Wiring of the rooms: trace -> harness -> history -> oracle -> finding.

A ``Session`` owns one engine at a time (restarting it when a trace needs another engine
configuration) and the reference memo, and turns a trace into verdicts and, when something
diverged, a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.base import Engine
from harness.runner import Recording, ReferenceStore, record
from oracle import Thresholds, check, divergent, make_finding
from traces import Divergence, EngineConfig, Finding, Trace


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

    def engine_for(self, config: EngineConfig) -> Engine:
        if self.engine is not None and self.engine.compatible(config):
            return self.engine
        self.close()
        if self.engine_kind == "inprocess":
            from harness.inprocess import InProcessEngine

            self.engine = InProcessEngine(config, device=self.device, log_file=self.log_file).start()
        else:
            raise ValueError(f"engine kind {self.engine_kind!r} is not available")
        # References depend on the engine configuration (the memo key includes it), so the
        # store can be kept across restarts.
        return self.engine

    def check(self, trace: Trace, *, runs: int | None = None, arms: dict[str, list[str]] | None = None) -> Checked:
        engine = self.engine_for(trace.engine)
        rec = record(engine, trace, runs=runs or self.runs, arms=arms, store=self.references)
        verdicts = check(trace, rec.histories, rec.references, self.thresholds)
        finding = None
        if divergent(verdicts):
            finding = make_finding(trace, rec.histories, rec.references, verdicts, rec.environment, rec.arms,
                                   thresholds=self.thresholds)
        return Checked(rec, verdicts, finding)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
