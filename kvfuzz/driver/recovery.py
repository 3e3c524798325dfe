"""Keep a campaign going when the engine under test dies or hangs.

A fuzzer's job is to make engines fall over. When a trace kills or wedges the engine (a
managed server that exits, stops answering, or an in-process engine whose step raises or
runs past its deadline), the trace is recorded as an ``engine-crash`` finding with the log
tail, the engine is killed and restarted on the next trace, and the campaign goes on. Only a
run of consecutive crashes (an engine that cannot live at all) stops it, as an infrastructure
failure (exit 3). See docs/reliability.md.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvfuzz.harness.base import Engine
from kvfuzz.oracle.check import ENGINE
from kvfuzz.driver.session import Session
from kvfuzz.traces import CrashInfo, CrashKind, Divergence, Finding, History, Trace
from kvfuzz.traces.errors import BadInput, ConfigRefused, EngineHang, InfraError
from kvfuzz.traces.result import Checked, Recording

log = logging.getLogger("kvfuzz.driver.recovery")

LOG_TAIL_LINES = 40
MAX_CONSECUTIVE_CRASHES = 3


def redact(lines: list[str], secrets: list[str]) -> list[str]:
    """Log lines with every secret (API key) replaced: findings are shared with strangers."""
    out = []
    for ln in lines:
        for s in secrets:
            if s:
                ln = ln.replace(s, "<redacted>")
        out.append(ln)
    return out


def crash_info(engine: Engine | None, kind: CrashKind, detail: str, secrets: Sequence[str]) -> CrashInfo:
    tail = engine.log_tail(LOG_TAIL_LINES) if engine is not None else []
    path = engine.log_path if engine is not None else None
    return CrashInfo(kind=kind, detail=detail, log=str(path) if path is not None else None,
                     log_tail=redact(list(tail), list(secrets)))


def crash_finding(trace: Trace, engine: Engine, error: InfraError, *, arms: dict[str, list[str]] | None,
                  secrets: Sequence[str] = ()) -> Finding:
    """An engine-crash finding for ``trace`` from the infrastructure error it caused."""
    detail = str(error)
    kind: Literal["hang", "died"] = "hang" if isinstance(error, EngineHang) else "died"
    runs: list[History] = [error.history] if error.history is not None else []
    for h in runs:
        if not h.crashed:
            h.crashed = True
            h.crash_kind = kind
            h.crash_detail = detail
    arm = runs[0].arm if runs else next(iter(arms or {"default": []}))
    div = Divergence(request_id=ENGINE, class_="engine-crash", arm=arm, runs_diverged=1, runs=1,
                     detail=("hang: " if kind == "hang" and not detail.startswith("hang") else "") + detail)
    try:
        env = engine.environment()
    except Exception:  # noqa: BLE001 - the environment of a dead engine is best effort
        from kvfuzz.harness.environment import describe

        env = describe(engine=engine.kind, config=trace.engine, device=engine.device, model_hash=None)
    env.toggles = sorted({t for ts in (arms or {}).values() for t in ts})
    f = Finding(trace=trace, environment=env, runs=runs, divergences=[div], verdicts=[div],
                arms=arms or {arm: list(trace.engine.toggles)},
                created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat())
    f.crash = crash_info(engine, kind, detail, secrets)
    f.id = f.compute_id()
    return f


def refusal(error: str) -> str:
    """The reason an engine configuration was refused: the error's last non-empty line (vLLM's
    own message ends a start failure's traceback), shortened."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return (lines[-1] if lines else "the engine did not start")[:200]


@dataclass
class Recovering:
    """Wraps ``session.check``: an engine that dies or hangs during a trace becomes an
    engine-crash finding, and the engine is killed so the next trace starts a fresh one.
    Re-runs above it (toggle attribution, triage/attribution.py ``explain_guarded``) go through
    ``rerun``: this floor knows nothing of triage."""

    session: Session
    max_consecutive: int = MAX_CONSECUTIVE_CRASHES
    crashes: int = 0
    restarts: int = 0
    _consecutive: int = 0
    _started: bool = False  # an engine configuration started in this campaign

    def check(self, trace: Trace, *, runs: int | None = None, arms: dict[str, list[str]] | None = None) -> Checked:
        # A start failure is not the trace's doing: an infrastructure error (exit 3), unless
        # another configuration started before: then this configuration is what was refused.
        try:
            self.session.engine_for(trace.engine)
        except (InfraError, BadInput) as e:
            if not self._started:
                raise
            raise ConfigRefused(refusal(str(e))) from e
        self._started = True
        try:
            checked = self.session.check(trace, runs=runs, arms=arms)
        except InfraError as e:
            return self._crashed(trace, e, arms)
        finding = checked.finding
        if finding is not None and finding.worst_class() == "engine-crash":
            # The in-process engine recorded the crash (a step raised, or the deadline hit);
            # its state is suspect now, so it restarts too.
            crashed = next((h for h in checked.histories if h.crashed), None)
            kind: CrashKind = (crashed.crash_kind if crashed is not None else None) or "died"
            crash = next(d for d in finding.divergences if d.class_ == "engine-crash")
            finding.crash = crash_info(self.session.engine, kind, crash.detail or "", self.session.secrets())
            self._note(finding)
            self._restart()
            self._consecutive += 1
            self.crashes += 1
        else:
            self._consecutive = 0
        return checked

    def rerun(self, checked: Checked, step: Callable[[], Checked]) -> Checked:
        """``step``, a re-run of ``checked``'s trace (e.g. its toggle attribution), with the same
        crash handling: an engine that dies or hangs makes it an engine-crash finding."""
        try:
            out = step()
        except InfraError as e:
            return self._crashed(checked.recording.trace, e, checked.recording.arms)
        if any(h.crashed for h in out.histories[len(checked.histories):]):
            # An arm of the re-run crashed (recorded, as in a first run): its state is suspect.
            self._restart()
        return out

    def _crashed(self, trace: Trace, error: InfraError, arms: dict[str, list[str]] | None) -> Checked:
        engine = self.session.engine
        self.crashes += 1
        self._consecutive += 1
        if engine is None:
            raise error
        finding = crash_finding(trace, engine, error, arms=arms, secrets=self.session.secrets())
        log.warning("engine crash on trace %s: %s", trace.trace_id(), error)
        self._restart()
        self._note(finding)
        if self._consecutive >= self.max_consecutive:
            raise InfraError(f"the engine crashed on {self._consecutive} traces in a row; last: {error}") from error
        rec = Recording(trace=trace, histories=list(finding.runs), references={}, environment=finding.environment,
                        arms=dict(finding.arms))
        return Checked(rec, list(finding.verdicts), finding)

    def _note(self, finding: Finding) -> None:
        if finding.crash is not None:
            finding.crash.restarts = self.restarts + 1

    def _restart(self) -> None:
        """Kill what crashed now; the next trace runs on a fresh engine. An engine that can
        recover in place (a managed server: kill the server, keep the pool) does; any other is
        closed and the session starts a new one."""
        engine = self.session.engine
        self.restarts += 1
        if engine is None:
            return
        try:
            if engine.recover():
                return
            self.session.discard_engine()
        except Exception:  # noqa: BLE001 - a broken engine must not stop the campaign
            self.session.engine = None
            log.warning("could not stop the crashed engine cleanly", exc_info=True)
