"""vLLM's log output: routed to the engine log file (the CLI's display stays readable; the
file is what a bug report needs), and read back (the tail of a log for a crash finding)."""

from __future__ import annotations

import logging
import os
from pathlib import Path


def route_vllm_logs(log_file: Path | None) -> None:
    """Send vLLM's log records to a file (or silence them below WARNING) so the CLI's display
    stays readable; the file is what a bug report needs."""
    vlog = logging.getLogger("vllm")
    for h in list(vlog.handlers):
        vlog.removeHandler(h)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        vlog.addHandler(fh)
        vlog.setLevel(logging.INFO)
    else:
        vlog.addHandler(logging.NullHandler())
        vlog.setLevel(logging.ERROR)
    vlog.propagate = False



def read_tail(path: Path, n: int = 40) -> list[str]:
    """The last ``n`` lines of a log file (at most its last 64 KiB are read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return lines[-n:]

