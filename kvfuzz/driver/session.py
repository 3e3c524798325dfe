"""Wiring of the rooms: trace -> harness -> history -> oracle -> finding.

A ``Session`` owns one engine at a time (restarting it when a trace needs another engine
configuration) and the reference memo. It records a trace (harness), checks the recording
(oracle) and, when something diverged, packages a finding. Re-runs that explain a finding
(minimization, controls, attribution, ablation) are triage's (kvfuzz.triage), which
replays through a session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvfuzz.harness.base import Engine, EngineKind
from kvfuzz.harness.environment import stamp
from kvfuzz.harness.runner import ReferenceStore, ScoreStore, record, score_diverged
from kvfuzz.oracle import NoiseBounds, bounds_from, check, classify_run, default_bounds, divergent, make_finding
from kvfuzz.oracle.check import ENGINE, stop_at_flip, with_liveness
from kvfuzz.oracle.diff import logprob_drift
from kvfuzz.oracle.liveness import Stall, stalls
from kvfuzz.oracle.postconditions import origin
from kvfuzz.traces import Attribution, Divergence, EngineConfig, Finding, History, RequestRecord, Scoring, Trace
from kvfuzz.traces.calibration import CalibrationProfile, find_profile
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.result import Checked, Judged, Recording
from kvfuzz.traces.history import StopAtFlip
from kvfuzz.traces.trace import ReloadAdapterEvent
from kvfuzz.driver.settings import SessionSettings
from kvfuzz.traces.timing import CONFIRM, ENGINE_START, Ledger

if TYPE_CHECKING:
    from kvfuzz.harness.inprocess import EnginePool, InProcessEngine
    from kvfuzz.harness.server import ServerOptions

@dataclass
class Session:
    """Built by ``kvfuzz.driver.session.build_session`` (the one construction path); what it runs on
    and how it judges are its ``settings``."""

    settings: SessionSettings = field(default_factory=SessionSettings)
    log_file: Path | None = None
    # engine kind "server": how to run the managed server (kvfuzz.driver.session.server_options).
    server_options: ServerOptions | None = None
    engine: Engine | None = None
    references: ReferenceStore = field(default_factory=ReferenceStore)
    scores: ScoreStore = field(default_factory=ScoreStore)
    # Where the session's time goes (traces/timing.py), shared with its stores.
    ledger: Ledger = field(default_factory=Ledger)
    _bounds: dict[str, NoiseBounds] = field(default_factory=dict, repr=False)
    # Measures and keeps a profile for an engine configuration that has none (a campaign that
    # calibrates sets it: its traces' drawn configurations change how prompts are split into
    # kernel calls, so their noise is measured too, once each); None: the dtype's defaults.
    calibrate_missing: Callable[[EngineConfig], NoiseBounds | None] | None = field(default=None, repr=False)
    # Which divergent verdicts teacher forcing scores (``scoring``): all of them, or only near
    # ties — the one class scoring can change (it can call a near tie corruption, never the
    # reverse), which is what a campaign's fuzzed runs need.
    _score_classes: tuple[str, ...] = field(default=("corruption", "numeric-near-tie"), repr=False)
    # The trace the campaign will most likely run next (``look_ahead``), for the reference engine.
    _upcoming: list[Trace] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.references.ledger = self.scores.ledger = self.ledger

    def use_reference_store(self, out: Path | None, *, cache: bool = True, verify: float = 0.0,
                            seed: int = 0) -> None:
        """References and scorings kept on disk too: in ``out/references`` and (``cache``) the
        kvfuzz cache, a share ``verify`` of hits computed again (harness/refstore.py)."""
        from kvfuzz.harness.refstore import DiskTiers

        tiers = DiskTiers.for_campaign(out, cache=cache)
        ahead = self.references.ahead
        self.references = ReferenceStore(tiers=tiers, verify=verify, ledger=self.ledger, verify_seed=seed)
        self.references.ahead = ahead
        self.scores = ScoreStore(tiers=tiers, ledger=self.ledger)

    def use_reference_engine(self, log_file: Path | None = None) -> None:
        """A reference engine beside the fuzzed one (harness/refengine.py): a child process that
        computes each trace's references while its runs replay; the store waits for them. On
        CUDA the child gets a GPU of its own, or, with only one, none is started."""
        from kvfuzz.harness.refengine import DEFAULT_TIMEOUT_S, ReferenceEngine, child_env, child_gpu
        from kvfuzz.harness.refstore import warn_stderr

        if self.references.ahead is not None:
            return
        env = child_env()
        if self.device == "cuda":
            gpu = child_gpu()
            if gpu is None:
                warn_stderr("one GPU: references are computed on the fuzzed engine (a reference engine needs a "
                            "device of its own)")
                return
            env["CUDA_VISIBLE_DEVICES"] = gpu
        # A begun reference not answered within a trace's timeout: the child is hung.
        self.references.ahead = ReferenceEngine(log_file=log_file, env=env,
                                                timeout_s=self.trace_deadline_s or DEFAULT_TIMEOUT_S).start()

    def close_references(self) -> None:
        """Stop the reference engine, if there is one."""
        ahead, self.references.ahead = self.references.ahead, None
        if ahead is not None:
            ahead.close()

    # -- the settings, read where the session is used ---------------------------------------------
    @property
    def engine_kind(self) -> EngineKind:
        return self.settings.kind

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def runs(self) -> int:
        return self.settings.runs

    @runs.setter
    def runs(self, value: int) -> None:
        self.settings = self.settings.model_copy(update={"runs": value})

    @property
    def bound_overrides(self) -> dict[str, float]:
        return self.settings.bound_overrides

    @property
    def profiles(self) -> list[CalibrationProfile]:
        return self.settings.profiles

    @property
    def profiles_dir(self) -> Path | None:
        return self.settings.profiles_dir

    @property
    def trace_deadline_s(self) -> float | None:
        return self.settings.trace_timeout

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
        key = self.settings.api_key.get_secret_value() if self.settings.api_key else None
        return [s for s in (key, opts.api_key if opts else None) if s]

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
            from kvfuzz.harness.server import ServerEngine

            opts = self.server_options or server_options(
                self.settings, self.log_file.parent if self.log_file else Path("kvfuzz-out"))
            engine = ServerEngine(config, options=opts)
        else:
            from kvfuzz.harness.url import UrlEngine

            st = self.settings
            if st.base_url is None:
                raise BadInput("a URL engine needs a base URL", field="--base-url")
            engine = UrlEngine(config, st.base_url, api_key=st.api_key.get_secret_value() if st.api_key else None,
                               model=st.served_model)
        # References depend on the engine configuration (the memo key includes it), so the
        # store is kept across restarts.
        with self.ledger.span(ENGINE_START):
            self.engine = engine.start()
        return self.engine

    # -- record, check, judge ----------------------------------------------------------------------
    def record(self, trace: Trace, *, runs: int | None = None,
               arms: dict[str, list[str]] | None = None) -> Recording:
        """Replay ``trace`` ``runs`` times in each arm (default: its own toggles), with references."""
        fuzzed = self.ledger.take_fresh()
        upcoming, self._upcoming = (self._upcoming, []) if fuzzed else ([], self._upcoming)
        return record(self.engine_for(trace.engine), trace, runs=runs or self.runs, arms=arms, store=self.references,
                      fuzzed=fuzzed, upcoming=upcoming)

    def look_ahead(self, trace: Trace) -> None:
        """``trace`` will most likely be the next fuzzed trace: with a reference engine, its
        references are asked for right after the current trace's (``kvfuzz run``'s campaign
        loop tells it; without a reference engine nothing is done)."""
        if self.references.ahead is not None and self.references.ahead.off is None:
            self._upcoming = [trace]

    # -- noise bounds ------------------------------------------------------------------------------
    def bounds_for(self, config: EngineConfig) -> NoiseBounds:
        """The bounds for runs of ``config``: from the calibration profile that matches its
        engine (device, dtype, model, flags), else the dtype's defaults; the user's overrides win."""
        k = config.key()
        if k not in self._bounds:
            key = self.engine_for(config).noise_key()
            profile = next((p for p in self.profiles if p.key == key), None) or find_profile(key, self.profiles_dir)
            if profile is None and self.calibrate_missing is not None:
                measure, self.calibrate_missing = self.calibrate_missing, None  # not again from inside it
                try:
                    got = measure(config)
                finally:
                    self.calibrate_missing = measure
                if got is not None:
                    self._bounds[k] = got
                    return got
            self._bounds[k] = self._with_overrides(bounds_from(profile) if profile else default_bounds(config.dtype))
        return self._bounds[k]

    def use_profile(self, config: EngineConfig, profile: CalibrationProfile) -> NoiseBounds:
        """Judge runs of ``config`` by ``profile`` (just measured, or named on the command line);
        kept in the settings, so the sessions built from them (an isolated child) judge alike."""
        if profile not in self.settings.profiles:
            self.settings = self.settings.model_copy(update={"profiles": [*self.settings.profiles, profile]})
        self._bounds[config.key()] = self._with_overrides(bounds_from(profile))
        return self._bounds[config.key()]

    def _with_overrides(self, bounds: NoiseBounds) -> NoiseBounds:
        return bounds.with_overrides(**self.bound_overrides)

    # -- verdicts ------------------------------------------------------------------------------------
    def verdicts_of(self, rec: Recording, *, carry: Finding | None = None) -> Checked:
        """The oracle's verdicts on a recording and, when anything diverged, the finding. When a
        run diverged, the recording is first completed with teacher-forced scorings (``scored``)
        and judged on that evidence, which tells a 16-bit near tie from wrong KV. The returned
        ``Checked.recording`` is the completed one; ``rec`` is left as it was."""
        bounds = self.bounds_for(rec.trace.engine)
        verdicts = check(rec.trace, rec.histories, rec.references, bounds, rec.scores)
        full = self.scored(rec, verdicts)
        if full is not rec:
            verdicts = check(full.trace, full.histories, full.references, bounds, full.scores)
        return Checked(full, verdicts, self.finding_of(full, verdicts, carry=carry))

    def scored(self, rec: Recording, verdicts: list[Divergence]) -> Recording:
        """A recording step: ``rec`` plus teacher-forced scorings of the runs behind divergent
        ``verdicts`` (each run's own tokens scored with the request alone on a clean cache), or
        ``rec`` itself when there is nothing new to score."""
        if not divergent(verdicts) or self.engine is None:
            return rec
        more = score_diverged(self.engine, rec, verdicts, self.scores, classes=self._score_classes)
        return replace(rec, scores=[*rec.scores, *more]) if more else rec

    @contextlib.contextmanager
    def scoring(self, which: Literal["all", "near-ties"]) -> Iterator[None]:
        """Inside: teacher forcing scores ``which`` divergent verdicts. A campaign scores only
        near ties on its fuzzed runs (scoring corruption, which it cannot reclassify, can take a
        tenth of a campaign whose bug fires often); a bucket's minimized finding, and every
        replay outside a campaign, are scored in full."""
        old = self._score_classes
        self._score_classes = ("numeric-near-tie",) if which == "near-ties" else ("corruption", "numeric-near-tie")
        try:
            yield
        finally:
            self._score_classes = old

    def finding_of(self, rec: Recording, verdicts: list[Divergence], *, carry: Finding | None = None,
                   attribution: Attribution | None = None) -> Finding | None:
        """The finding of divergent ``verdicts``; ``carry``: the finding of the same recording
        judged before, whose provenance and typed facts it keeps."""
        if not divergent(verdicts):
            return None
        finding = make_finding(rec.trace, rec.histories, rec.references, verdicts, rec.environment, rec.arms,
                               bounds=self.bounds_for(rec.trace.engine), scores=rec.scores)
        if self.engine is not None and self.engine.reference_note:
            finding.notes["references"] = self.engine.reference_note
        finding.attribution = attribution
        if carry is not None:
            finding.inherit(carry)
        return finding

    def confirm(self, rec: Recording, runs: int, *, deadline: float | None = None) -> Recording:
        """``rec`` with each of its arms replayed until it has ``runs`` runs (adaptive runs: a
        trace runs once, and again only when something diverged, to measure the rate). Past
        ``deadline`` (time.monotonic()) no further run starts: the rate is measured on the runs
        it has (a long trace found late must not run the campaign past its budget)."""
        import time

        engine = self.engine_for(rec.trace.engine)
        histories = list(rec.histories)
        with self.ledger.span(CONFIRM):
            for arm, toggles in rec.arms.items():
                have = sum(1 for h in histories if h.arm == arm)
                for k in range(have, runs):
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    histories.append(stamp(engine.replay(rec.trace, arm=arm, run_index=k, toggles=toggles),
                                           engine.kind))
        return Recording(trace=rec.trace, histories=histories, references=rec.references,
                         environment=rec.environment, arms=dict(rec.arms), scores=list(rec.scores))

    def check(self, trace: Trace, *, runs: int | None = None,
              arms: dict[str, list[str]] | None = None) -> Checked:
        """Record ``trace`` in ``arms`` and check it."""
        return self.verdicts_of(self.record(trace, runs=runs, arms=arms))

    def judge(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str]) -> str:
        """The verdict class of ``victim`` in one replay of ``trace`` (``judge_victim``)."""
        return self.judge_victim(trace, victim=victim, arm=arm, toggles=toggles, settle=True).cls

    def judge_victim(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str],
                     others: Sequence[str] = (), settle: bool = False) -> Judged:
        """``victim`` in one replay of ``trace``: its verdict and, when its tokens equal the
        reference's, its logprob drift against the bound; when it no longer corrupts, the
        requests in ``others`` judged alike in the same replay. Only the references of the
        requests judged (and, for a near tie, the victim's teacher-forced scoring) are needed,
        so shrinking other requests' prompts costs no reference runs. ``settle`` (for callers
        that read only the class): the replay may stop at the victim's first flipped token once
        that makes it corruption; ``broke`` then says what broke by there."""
        engine = self.engine_for(trace.engine)
        bounds = self.bounds_for(trace.engine)
        bindings = trace.bindings_at_admission()
        refs: dict[str, RequestRecord] = {}

        def reference(rid: str) -> RequestRecord:
            # Looked up once per request: a settled replay needs the victim's before it runs,
            # and every lookup counts as a store hit (and may be verified by a re-run).
            if rid not in refs:
                refs[rid] = self.references.get(engine, trace.send(rid), bindings.get(rid))
            return refs[rid]

        settled = self._corrupt_at_flip(trace, victim, reference, bounds) if settle and victim != ENGINE else None

        # The replay stops once the victim is done (nothing later changes it); the others are
        # read only when it no longer corrupts, and then the run goes on until they are done too
        # (a second replay, the same run on a step-exact engine). An engine crash is judged on
        # the whole run.
        def run(until: list[str]) -> History:
            return engine.replay(trace, arm=arm, run_index=0, toggles=list(toggles), until=until, settled=settled)

        h = run([] if victim == ENGINE else [victim])
        if victim == ENGINE:
            return Judged("engine-crash" if h.crashed else "ok")
        judged: list[tuple[History, dict[str, Stall]]] = []  # the run's liveness, judged once

        def stall(rid: str) -> Stall | None:
            if not judged or judged[-1][0] is not h:
                judged.append((h, stalls(trace, h)))
            return judged[-1][1].get(rid)

        def one(rid: str, *, score: bool) -> Judged:
            send = trace.send(rid)
            binding = bindings.get(rid)
            ref = reference(rid)
            rec = h.requests.get(rid)
            verdict = classify_run(send, ref, rec, h, bounds)
            if score and verdict.cls == "numeric-near-tie" and rec is not None:
                # Only teacher forcing can still call it corruption (it never makes corruption noise).
                toks = rec.token_ids[: send.max_tokens]
                scoring = Scoring(request_id=rid, arm=arm, token_ids=toks,
                                  logprobs=self.scores.get(engine, send, toks, binding))
                verdict = classify_run(send, ref, rec, h, bounds, scoring)
            verdict = with_liveness(verdict, stall(rid))
            broke = origin(h.breaks, rid)
            if verdict.cls == "ok" and ref is not None and rec is not None and verdict.comparison is not None:
                return Judged("ok", drift=logprob_drift(ref, rec, verdict.comparison.compared), bound=bounds.drift,
                              broke=broke)
            return Judged(verdict.cls, broke=broke)

        j = one(victim, score=True)
        if others and not j.corrupt:
            if h.stopped_at is not None and any(r not in h.requests or h.requests[r].end_ms is None for r in others):
                h = run([victim, *others])  # ``one`` reads this run from here on
            j = replace(j, others=tuple((r, one(r, score=False)) for r in others if r != victim))
        return j

    @staticmethod
    def _corrupt_at_flip(trace: Trace, victim: str, reference: Callable[[str], RequestRecord],
                         bounds: NoiseBounds) -> StopAtFlip | None:
        """Where ``victim``'s verdict is final (``oracle.check.stop_at_flip``). None
        where a later step could still change the verdict: an in-place adapter reload (a reload
        while the victim runs makes any output legal, ``reloaded_while_running``)."""
        if any(isinstance(e, ReloadAdapterEvent) for e in trace.events):
            return None
        return stop_at_flip(trace.send(victim), victim, reference(victim), bounds)

    def close(self) -> None:
        """Done with the engine: closed, or back to the process's engine pool if there is one."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        pooled = self._pooled(engine)
        if pooled is not None:
            pooled[0].release(pooled[1])
        else:
            engine.close()

    def discard_engine(self) -> None:
        """Close the engine for good (it crashed or hung: its state is suspect); the next trace
        starts a fresh one."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        pooled = self._pooled(engine)
        if pooled is not None:
            pooled[0].discard(pooled[1])
        else:
            engine.close()

    @staticmethod
    def _pooled(engine: Engine) -> tuple[EnginePool, InProcessEngine] | None:
        """The process's engine pool and ``engine`` as the pool's kind, when it is pooled."""
        if engine.kind != "inprocess":
            return None
        from kvfuzz.harness.inprocess import InProcessEngine, engine_pool

        pool = engine_pool()
        return (pool, engine) if pool is not None and isinstance(engine, InProcessEngine) else None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.close_references()


# -- the one construction path (kvfuzz.driver.settings) ---------------------------------------------------
def server_options(settings: SessionSettings, log_dir: Path) -> ServerOptions | None:
    """The managed server's options (None unless ``settings.kind`` is "server")."""
    if settings.kind != "server":
        return None
    from kvfuzz.harness.server import ServerOptions

    opts = ServerOptions(device=settings.device, extra_flags=list(settings.server_flags), log_dir=log_dir,
                         port=settings.port)
    if settings.trace_timeout is not None:
        opts.request_timeout_s = settings.trace_timeout
    return opts


def build_session(settings: SessionSettings, log_dir: Path, *, log_name: str = "engine.log") -> Session:
    """The one way a command's session is made: its engine log (and server logs) in ``log_dir``."""
    session = Session(settings=settings, log_file=log_dir / log_name, server_options=server_options(settings, log_dir))
    if settings.store is not None:
        session.use_reference_store(settings.store.out, verify=settings.store.verify, seed=settings.store.seed)
    if settings.reference_engines:
        if settings.kind != "inprocess":
            raise BadInput("a reference engine runs beside the in-process engine only", field="--reference-engines")
        session.use_reference_engine(log_dir / "reference-engine.log")
    return session
