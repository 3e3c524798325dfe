"""Check a trace in a fresh child process with extra environment variables.

For engine settings vLLM reads once per process — ``VLLM_BATCH_INVARIANT`` is read when
vLLM's attention modules are imported — an arm cannot be switched on in a process that
already imported them. The parent writes a request file, the child (``python -m
kvfuzz.driver.isolated IN OUT``) runs ``Session.check`` and writes the verdicts back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

from kvfuzz.driver.settings import SessionSettings
from kvfuzz.traces import Divergence, Trace
from kvfuzz.traces.errors import InfraError

if TYPE_CHECKING:
    from kvfuzz.driver.session import Session


def request(trace: Trace, runs: int, arms: dict[str, list[str]], settings: SessionSettings,
            log_file: Path | None = None) -> dict:
    """What the child is given: the trace, and the parent's session settings (bounds, calibration
    profiles, engine kind, device), so it judges as the parent would."""
    return {"trace": trace.model_dump(mode="json"), "runs": runs, "arms": arms,
            "settings": settings.model_dump(mode="json"), "log_file": str(log_file) if log_file else None}


def child_session(req: dict) -> Session:
    """The child's session, built from the parent's settings (kvfuzz.driver.session.build_session)."""
    from kvfuzz.driver.session import build_session

    # One trace, checked once: no reference engine beside it (its references are computed in turn).
    settings = SessionSettings.model_validate(req["settings"]).model_copy(update={"runs": req["runs"],
                                                                                   "reference_engines": 0})
    log = Path(req["log_file"]) if req.get("log_file") else None
    if log is None:
        return build_session(settings, Path(tempfile.gettempdir()), log_name="kvfuzz-isolated-engine.log")
    return build_session(settings, log.parent, log_name=log.name)


def check_isolated(trace: Trace, runs: int, arms: dict[str, list[str]], env: dict[str, str], *,
                   settings: SessionSettings, timeout: float = 1800.0,
                   log_file: Path | None = None) -> list[Divergence]:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-isolated-") as d:
        inp, out = Path(d) / "in.json", Path(d) / "out.json"
        inp.write_text(json.dumps(request(trace, runs, arms, settings, log_file)))
        try:
            p = subprocess.run([sys.executable, "-m", "kvfuzz.driver.isolated", str(inp), str(out)],
                               env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise InfraError(f"isolated check timed out after {timeout:g} s") from None
        if p.returncode != 0 or not out.exists():
            lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
            raise InfraError(f"isolated check exited {p.returncode}: {lines[-1] if lines else 'no output'}")
        return [Divergence.model_validate(v) for v in json.loads(out.read_text())]


def _child(inp: Path, out: Path) -> None:
    req = json.loads(inp.read_text())
    trace = Trace.model_validate(req["trace"])
    with child_session(req) as s:
        c = s.check(trace, runs=req["runs"], arms=req["arms"])
    out.write_text(json.dumps([v.model_dump(mode="json", by_alias=True) for v in c.verdicts]))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
