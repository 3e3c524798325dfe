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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oracle.check import ENGINE
from traces import Divergence, Finding, History, Trace
from traces.errors import InfraError

log = logging.getLogger("kvfuzz.recovery")

LOG_TAIL_LINES = 40
MAX_CONSECUTIVE_CRASHES = 3


def _tail(engine: Any, n: int = LOG_TAIL_LINES) -> tuple[list[str], str | None]:
    tail_fn = getattr(engine, "log_tail", None)
    lines = list(tail_fn(n)) if callable(tail_fn) else []
    path = getattr(engine, "log_path", None) or getattr(engine, "log_file", None)
    return lines, (str(path) if path is not None else None)


def redact(lines: list[str], secrets: list[str]) -> list[str]:
    """Log lines with every secret (API key) replaced: findings are shared with strangers."""
    out = []
    for ln in lines:
        for s in secrets:
            if s:
                ln = ln.replace(s, "<redacted>")
        out.append(ln)
    return out


def crash_finding(trace: Trace, engine: Any, error: InfraError, *, arms: dict[str, list[str]] | None,
                  secrets: Sequence[str] = ()) -> Finding:
    """An engine-crash finding for ``trace`` from the infrastructure error it caused."""
    detail = str(error)
    hang = bool(getattr(error, "hang", False)) or "hang" in detail
    hist = getattr(error, "history", None)
    runs: list[History] = [hist] if isinstance(hist, History) else []
    for h in runs:
        if not h.crashed:
            h.crashed = True
            h.crash_detail = detail
    arm = runs[0].arm if runs else next(iter(arms or {"default": []}))
    tail, log_path = _tail(engine)
    div = Divergence(request_id=ENGINE, class_="engine-crash", arm=arm, runs_diverged=1, runs=1,
                     detail=("hang: " if hang and not detail.startswith("hang") else "") + detail)
    try:
        env = engine.environment()
        env.toggles = sorted({t for ts in (arms or {}).values() for t in ts})
    except Exception:  # the environment of a dead engine is best effort
        from harness.environment import describe

        env = describe(engine=getattr(engine, "kind", "inprocess"), config=trace.engine,
                       device=getattr(engine, "device", "cpu"), model_hash=None)
    f = Finding(trace=trace, environment=env, runs=runs, divergences=[div], verdicts=[div],
                arms=arms or {arm: list(trace.engine.toggles)},
                created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat())
    f.notes["engine_crash"] = {"kind": "hang" if hang else "died", "detail": detail, "log": log_path,
                               "log_tail": redact(tail, list(secrets))}
    f.id = f.compute_id()
    return f


@dataclass
class Recovering:
    """Wraps ``session.check``: an engine that dies or hangs during a trace becomes an
    engine-crash finding, and the engine is killed so the next trace starts a fresh one."""

    session: Any
    max_consecutive: int = MAX_CONSECUTIVE_CRASHES
    crashes: int = 0
    restarts: int = 0
    _consecutive: int = 0

    def check(self, trace: Trace, **kwargs: Any) -> Any:
        # A start failure is not the trace's doing: it stays an infrastructure error (exit 3).
        self.session.engine_for(trace.engine)
        try:
            checked = self.session.check(trace, **kwargs)
        except InfraError as e:
            return self._crashed(trace, e, kwargs.get("arms"))
        finding = getattr(checked, "finding", None)
        if finding is not None and finding.worst_class() == "engine-crash":
            # The in-process engine recorded the crash (a step raised, or the deadline hit);
            # its state is suspect now, so it restarts too.
            crash = next(d for d in finding.divergences if d.class_ == "engine-crash")
            tail, log_path = _tail(self.session.engine)
            finding.notes["engine_crash"] = {
                "kind": "hang" if "hang" in (crash.detail or "") else "died", "detail": crash.detail,
                "log": log_path, "log_tail": redact(tail, self._secrets())}
            self._note(finding)
            self._restart()
            self._consecutive += 1
            self.crashes += 1
        else:
            self._consecutive = 0
        return checked

    def _crashed(self, trace: Trace, error: InfraError, arms: dict[str, list[str]] | None) -> Finding:
        engine = self.session.engine
        self.crashes += 1
        self._consecutive += 1
        finding = crash_finding(trace, engine, error, arms=arms, secrets=self._secrets())
        log.warning("engine crash on trace %s: %s", trace.trace_id(), error)
        self._restart()
        self._note(finding)
        if self._consecutive >= self.max_consecutive:
            raise InfraError(f"the engine crashed on {self._consecutive} traces in a row; last: {error}") from error
        return finding

    def _secrets(self) -> list[str]:
        return [s for s in (getattr(self.session, "api_key", None),
                            getattr(getattr(self.session, "server_options", None), "api_key", None)) if s]

    def _note(self, finding: Finding) -> None:
        finding.notes.setdefault("engine_crash", {})
        finding.notes["engine_crash"]["restarts"] = self.restarts + 1

    def _restart(self) -> None:
        """Kill what crashed now; the next trace runs on a fresh engine. An engine that can
        recover in place (a managed server: kill the server, keep the pool) does; any other is
        closed and the session starts a new one."""
        engine = self.session.engine
        self.restarts += 1
        if engine is None:
            return
        try:
            recover = getattr(engine, "recover", None)
            if callable(recover):
                recover()
                return
            self.session.engine = None
            engine.close()
        except Exception:  # noqa: BLE001 - a broken engine must not stop the campaign
            self.session.engine = None
            log.warning("could not stop the crashed engine cleanly", exc_info=True)
