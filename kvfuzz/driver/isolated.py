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

from kvfuzz.traces import Divergence, Trace
from kvfuzz.traces.errors import InfraError


def check_isolated(trace: Trace, runs: int, arms: dict[str, list[str]], env: dict[str, str], *,
                   engine_kind: str = "inprocess", device: str = "cpu", timeout: float = 1800.0,
                   log_file: Path | None = None) -> list[Divergence]:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-isolated-") as d:
        inp, out = Path(d) / "in.json", Path(d) / "out.json"
        inp.write_text(json.dumps({"trace": trace.model_dump(mode="json"), "runs": runs, "arms": arms,
                                   "engine_kind": engine_kind, "device": device,
                                   "log_file": str(log_file) if log_file else None}))
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
    from kvfuzz.driver.session import Session

    req = json.loads(inp.read_text())
    trace = Trace.model_validate(req["trace"])
    log = Path(req["log_file"]) if req.get("log_file") else None
    with Session(engine_kind=req["engine_kind"], device=req["device"], runs=req["runs"], log_file=log) as s:
        c = s.check(trace, runs=req["runs"], arms=req["arms"])
    out.write_text(json.dumps([v.model_dump(mode="json", by_alias=True) for v in c.verdicts]))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
