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
from kvfuzz.harness.environment import stamp
from kvfuzz.harness.runner import ReferenceStore, ScoreStore, record, score_diverged
from kvfuzz.oracle import NoiseBounds, bounds_from, check, classify_run, default_bounds, divergent, make_finding
from kvfuzz.oracle.check import ENGINE
from kvfuzz.traces import Divergence, EngineConfig, Finding, Scoring, Trace
from kvfuzz.traces.calibration import CalibrationProfile, find_profile
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.result import Checked, Recording
from kvfuzz.traces.timing import CONFIRM, ENGINE_START, Ledger

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
    # Noise bounds the user set (near_tie, drift, teacher); the others come from the matching
    # calibration profile in ``profiles_dir`` (default: the kvfuzz cache), else the defaults.
    bound_overrides: dict[str, float] = field(default_factory=dict)
    profiles_dir: Path | None = None
    # Profiles named on the command line, used for every engine whose key they match.
    profiles: list[CalibrationProfile] = field(default_factory=list)
    log_file: Path | None = None
    engine: Engine | None = None
    references: ReferenceStore = field(default_factory=ReferenceStore)
    scores: ScoreStore = field(default_factory=ScoreStore)
    # engine_kind "server": how to run the managed server; "url": the server's address.
    server_options: ServerOptions | None = None
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    # In-process engine: wall-clock deadline of one run of a trace (docs/reliability.md).
    trace_deadline_s: float | None = 600.0
    # Where the session's time goes (traces/timing.py), shared with its stores.
    ledger: Ledger = field(default_factory=Ledger)
    _bounds: dict[str, NoiseBounds] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.references.ledger = self.scores.ledger = self.ledger

    def use_reference_store(self, out: Path | None, *, cache: bool = True, verify: float = 0.0,
                            seed: int = 0) -> None:
        """References and scorings kept on disk too: in ``out/references`` and (``cache``) the
        kvfuzz cache, a share ``verify`` of hits computed again (harness/refstore.py)."""
        from kvfuzz.harness.refstore import DiskTiers

        tiers = DiskTiers.for_campaign(out, cache=cache)
        self.references = ReferenceStore(tiers=tiers, verify=verify, ledger=self.ledger, verify_seed=seed)
        self.scores = ScoreStore(tiers=tiers, ledger=self.ledger)

    @classmethod
    def for_target(cls, kind: EngineKind, *, device: str, runs: int, out: Path,
                   bounds: dict[str, float] | None = None, base_url: str | None = None, api_key: str | None = None,
                   model: str | None = None, server_flags: list[str] | None = None) -> "Session":
        """A session on the engine the replay-style commands name (in-process, a managed
        server with its logs in ``out``, or a server at ``base_url``)."""
        from kvfuzz.harness.server import ServerOptions

        return cls(engine_kind=kind, device=device, runs=runs, bound_overrides=dict(bounds or {}),
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
                with self.ledger.span(ENGINE_START):
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
        with self.ledger.span(ENGINE_START):
            self.engine = engine.start()
        return self.engine

    # -- record, check, judge ----------------------------------------------------------------------
    def record(self, trace: Trace, *, runs: int | None = None,
               arms: dict[str, list[str]] | None = None) -> Recording:
        """Replay ``trace`` ``runs`` times in each arm (default: its own toggles), with references."""
        return record(self.engine_for(trace.engine), trace, runs=runs or self.runs, arms=arms, store=self.references,
                      fuzzed=self.ledger.take_fresh())

    # -- noise bounds ------------------------------------------------------------------------------
    def bounds_for(self, config: EngineConfig) -> NoiseBounds:
        """The bounds for runs of ``config``: from the calibration profile that matches its
        engine (device, dtype, model, flags), else the dtype's defaults; the user's overrides win."""
        k = config.key()
        if k not in self._bounds:
            key = self.engine_for(config).noise_key()
            profile = next((p for p in self.profiles if p.key == key), None) or find_profile(key, self.profiles_dir)
            self._bounds[k] = self._with_overrides(bounds_from(profile) if profile else default_bounds(config.dtype))
        return self._bounds[k]

    def use_profile(self, config: EngineConfig, profile: CalibrationProfile) -> NoiseBounds:
        """Judge runs of ``config`` by ``profile`` (just measured, or named on the command line)."""
        self._bounds[config.key()] = self._with_overrides(bounds_from(profile))
        return self._bounds[config.key()]

    def _with_overrides(self, bounds: NoiseBounds) -> NoiseBounds:
        return bounds.with_overrides(**self.bound_overrides)

    # -- verdicts ------------------------------------------------------------------------------------
    def verdicts_of(self, rec: Recording, *, notes: dict | None = None) -> Checked:
        """The oracle's verdicts on a recording and, when anything diverged, the finding. A run
        that diverged is scored by teacher forcing first (its own tokens, the request alone on a
        clean cache): the evidence that tells a 16-bit near tie from wrong KV."""
        bounds = self.bounds_for(rec.trace.engine)
        verdicts = check(rec.trace, rec.histories, rec.references, bounds, rec.scores)
        if divergent(verdicts) and self.engine is not None:
            more = score_diverged(self.engine, rec, verdicts, self.scores)
            if more:
                rec.scores.extend(more)
                verdicts = check(rec.trace, rec.histories, rec.references, bounds, rec.scores)
        return Checked(rec, verdicts, self.finding_of(rec, verdicts, notes=notes))

    def finding_of(self, rec: Recording, verdicts: list[Divergence], *, notes: dict | None = None) -> Finding | None:
        if not divergent(verdicts):
            return None
        finding = make_finding(rec.trace, rec.histories, rec.references, verdicts, rec.environment, rec.arms,
                               bounds=self.bounds_for(rec.trace.engine), scores=rec.scores)
        if self.engine is not None and self.engine.reference_note:
            finding.notes["references"] = self.engine.reference_note
        finding.notes.update(notes or {})
        return finding

    def confirm(self, rec: Recording, runs: int) -> Recording:
        """``rec`` with each of its arms replayed until it has ``runs`` runs (adaptive runs: a
        trace runs once, and again only when something diverged, to measure the rate)."""
        engine = self.engine_for(rec.trace.engine)
        histories = list(rec.histories)
        with self.ledger.span(CONFIRM):
            for arm, toggles in rec.arms.items():
                have = sum(1 for h in histories if h.arm == arm)
                for k in range(have, runs):
                    histories.append(stamp(engine.replay(rec.trace, arm=arm, run_index=k, toggles=toggles),
                                           engine.kind))
        return Recording(trace=rec.trace, histories=histories, references=rec.references,
                         environment=rec.environment, arms=dict(rec.arms), scores=list(rec.scores))

    def check(self, trace: Trace, *, runs: int | None = None,
              arms: dict[str, list[str]] | None = None) -> Checked:
        """Record ``trace`` in ``arms`` and check it."""
        return self.verdicts_of(self.record(trace, runs=runs, arms=arms))

    def judge(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str]) -> str:
        """The verdict class of ``victim`` in one replay of ``trace``: only the victim's reference
        (and, if it diverged, its teacher-forced scoring) is needed, so shrinking other
        requests' prompts costs no reference runs."""
        engine = self.engine_for(trace.engine)
        h = engine.replay(trace, arm=arm, run_index=0, toggles=list(toggles))
        if victim == ENGINE:
            return "engine-crash" if h.crashed else "ok"
        send = trace.send(victim)
        binding = trace.bindings_at_admission().get(victim)
        ref = self.references.get(engine, send, binding)
        rec = h.requests.get(victim)
        bounds = self.bounds_for(trace.engine)
        verdict = classify_run(send, ref, rec, h, bounds)
        if verdict.cls == "numeric-near-tie" and rec is not None:
            # Only teacher forcing can still call it corruption (it never makes corruption noise).
            toks = rec.token_ids[: send.max_tokens]
            scoring = Scoring(request_id=victim, arm=arm, token_ids=toks, logprobs=self.scores.get(engine, send, toks, binding))
            verdict = classify_run(send, ref, rec, h, bounds, scoring)
        return verdict.cls

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
