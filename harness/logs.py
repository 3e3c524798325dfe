"""vLLM's log output: routed to the engine log file (the CLI's display stays readable; the
file is what a bug report needs), and read back (the tail of a log for a crash finding)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Loggers whose records belong in the engine log, not on the terminal: vLLM's, Python warnings
# (torch's and vLLM's deprecation warnings; logging.captureWarnings routes them here), and
# kvfuzz's own about the engines it starts (the engine pool).
ENGINE_LOGGERS = ("vllm", "py.warnings", "kvfuzz.engine")


def route_vllm_logs(log_file: Path | None) -> None:
    """Send vLLM's log records and Python warnings to a file (or silence them below ERROR) so
    the CLI's display stays readable; the file is what a bug report needs. Verbose: the
    terminal too."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM must not add its own stdout handler
    logging.captureWarnings(True)
    for name in ENGINE_LOGGERS:
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(log_file)
            fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            lg.addHandler(fh)
            lg.setLevel(logging.INFO)
        else:
            lg.addHandler(logging.NullHandler())
            lg.setLevel(logging.ERROR)
        if verbose():
            lg.addHandler(logging.StreamHandler())
        lg.propagate = False



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



def verbose() -> bool:
    """``kvfuzz --verbose``: vLLM's and torch's own output on the terminal, not only in the log."""
    return os.environ.get("KVFUZZ_VERBOSE") == "1"


@contextlib.contextmanager
def quiet_stderr(log_file: Path | None) -> Iterator[None]:
    """Send everything written to stderr — Python warnings, torch's C++ warnings, vLLM's
    import-time prints, progress bars — to ``log_file`` for the duration (engine start and
    shutdown, where they come from), unless verbose. At the file-descriptor level: C++ and
    child-process writes bypass ``sys.stderr``."""
    if log_file is None or verbose():
        yield
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_file, "ab") as f, warnings.catch_warnings():
            warnings.simplefilter("default")  # once per place, into the log like the rest
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
