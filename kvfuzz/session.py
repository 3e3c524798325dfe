"""Wiring of the rooms: trace -> harness -> history -> oracle -> finding.

A ``Session`` owns one engine at a time (restarting it when a trace needs another engine
configuration) and the reference memo. It records a trace (harness), checks the recording
(oracle) and, when something diverged, packages a finding. Re-runs that explain a finding
(minimization, controls, attribution, ablation) are triage's (kvfuzz.triage), which
replays through a session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuzz.harness.base import Engine, EngineKind
from kvfuzz.harness.runner import ReferenceStore, record
from kvfuzz.oracle import Thresholds, check, classify_run, divergent, make_finding
from kvfuzz.oracle.check import ENGINE
from kvfuzz.traces import EngineConfig, Trace
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.result import Checked, Recording

if TYPE_CHECKING:
    from kvfuzz.harness.inprocess import EnginePool
    from kvfuzz.harness.server import ServerOptions

DEVICES = ("cpu", "cuda")


def check_device(device: str, flag: str = "--device") -> str:
    """The one place a device name is validated (every command's --device)."""
    if device not in DEVICES:
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field=flag)
    return device


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


@dataclass
class Session:
    engine_kind: EngineKind = "inprocess"
    device: str = "cpu"
    runs: int = 3
    thresholds: Thresholds = field(default_factory=Thresholds)
    log_file: Path | None = None
    engine: Engine | None = None
    references: ReferenceStore = field(default_factory=ReferenceStore)
    # engine_kind "server": how to run the managed server; "url": the server's address.
    server_options: ServerOptions | None = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    # In-process engine: wall-clock deadline of one run of a trace (docs/reliability.md).
    trace_deadline_s: float | None = 600.0

    @classmethod
    def for_target(cls, kind: EngineKind, *, device: str, runs: int, out: Path, near_tie: float | None = None,
                   base_url: str | None = None, api_key: str | None = None, model: str | None = None,
                   server_flags: list[str] | None = None) -> "Session":
        """A session on the engine the replay-style commands name (in-process, a managed
        server with its logs in ``out``, or a server at ``base_url``)."""
        from kvfuzz.harness.server import ServerOptions

        return cls(engine_kind=kind, device=device, runs=runs, thresholds=Thresholds(near_tie=near_tie),
                   log_file=out / "engine.log", base_url=base_url, api_key=api_key, model=model,
                   server_options=ServerOptions(device=device, extra_flags=list(server_flags or []), log_dir=out))

    # -- what triage may rely on (kvfuzz.triage.probe.Replayer) ----------------------------------
    @property
    def step_exact(self) -> bool:
        return self.engine_kind == "inprocess"

    @property
    def reference_runs(self) -> int:
        return self.references.computed

    def secrets(self) -> list[str]:
        """Values that must never land in a finding (API keys)."""
        opts = self.server_options
        return [s for s in (self.api_key, opts.api_key if opts else None) if s]

    # -- engines ---------------------------------------------------------------------------------
    def engine_for(self, config: EngineConfig) -> Engine:
        if self.engine is not None and self.engine.compatible(config):
            return self.engine
        self.close()
        engine: Engine
        if self.engine_kind == "inprocess":
            from kvfuzz.harness.inprocess import InProcessEngine, engine_pool

            pool = engine_pool()
            if pool is not None:  # a test process: engines are shared (kvfuzz's pytest plugin)
                self.engine = pool.acquire(config, device=self.device, log_file=self.log_file,
                                           trace_deadline_s=self.trace_deadline_s)
                return self.engine
            engine = InProcessEngine(config, device=self.device, log_file=self.log_file,
                                     trace_deadline_s=self.trace_deadline_s)
        elif self.engine_kind == "server":
            from kvfuzz.harness.server import ServerEngine, ServerOptions

            opts = self.server_options or ServerOptions(
                device=self.device, log_dir=self.log_file.parent if self.log_file else Path("kvfuzz-out"))
            engine = ServerEngine(config, options=opts)
        else:
            from kvfuzz.harness.url import UrlEngine

            if self.base_url is None:
                raise BadInput("a URL engine needs a base URL", field="--base-url")
            engine = UrlEngine(config, self.base_url, api_key=self.api_key, model=self.model)
        # References depend on the engine configuration (the memo key includes it), so the
        # store is kept across restarts.
        self.engine = engine.start()
        return self.engine

    # -- record, check, judge ----------------------------------------------------------------------
    def record(self, trace: Trace, *, runs: int | None = None,
               arms: dict[str, list[str]] | None = None) -> Recording:
        """Replay ``trace`` ``runs`` times in each arm (default: its own toggles), with references."""
        return record(self.engine_for(trace.engine), trace, runs=runs or self.runs, arms=arms, store=self.references)

    def verdicts_of(self, rec: Recording, *, notes: dict | None = None) -> Checked:
        """The oracle's verdicts on a recording and, when anything diverged, the finding."""
        verdicts = check(rec.trace, rec.histories, rec.references, self.thresholds)
        return Checked(rec, verdicts, self.finding_of(rec, verdicts, notes=notes))

    def finding_of(self, rec: Recording, verdicts: list, *, notes: dict | None = None):
        if not divergent(verdicts):
            return None
        finding = make_finding(rec.trace, rec.histories, rec.references, verdicts, rec.environment, rec.arms,
                               thresholds=self.thresholds)
        if self.engine is not None and self.engine.reference_note:
            finding.notes["references"] = self.engine.reference_note
        finding.notes.update(notes or {})
        return finding

    def check(self, trace: Trace, *, runs: int | None = None,
              arms: dict[str, list[str]] | None = None) -> Checked:
        """Record ``trace`` in ``arms`` and check it."""
        return self.verdicts_of(self.record(trace, runs=runs, arms=arms))

    def judge(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str]) -> str:
        """The verdict class of ``victim`` in one replay of ``trace``: only the victim's reference
        is needed, so shrinking other requests' prompts costs no reference runs."""
        engine = self.engine_for(trace.engine)
        h = engine.replay(trace, arm=arm, run_index=0, toggles=list(toggles))
        if victim == ENGINE:
            return "engine-crash" if h.crashed else "ok"
        send = trace.send(victim)
        ref = self.references.get(engine, send)
        return classify_run(send, ref, h.requests.get(victim), h, self.thresholds.resolve(trace.engine.dtype)).cls

    def close(self) -> None:
        """Done with the engine: closed, or back to the process's engine pool if there is one."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        pool = self._pool_of(engine)
        if pool is not None:
            pool.release(engine)
        else:
            engine.close()

    def discard_engine(self) -> None:
        """Close the engine for good (it crashed or hung: its state is suspect); the next trace
        starts a fresh one."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        pool = self._pool_of(engine)
        if pool is not None:
            pool.discard(engine)
        else:
            engine.close()

    @staticmethod
    def _pool_of(engine: Engine) -> EnginePool | None:
        if engine.kind != "inprocess":
            return None
        from kvfuzz.harness.inprocess import engine_pool

        return engine_pool()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
