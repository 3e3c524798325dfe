"""A vLLM server process (group) that kvfuzz starts, watches and stops.

The server runs in its own session (process group); stop() sends SIGTERM to the group and
SIGKILL after a grace period, so the EngineCore and workers never outlive it. Its
stdout/stderr go to a log file.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvfuzz.traces.errors import InfraError

from .http.control import health
from .logs import read_tail
from .vllm_args import HOST

log = logging.getLogger("kvfuzz.server")

STOP_GRACE_S = 15.0
# How long stop() waits for the kernel to reap the group leader after its last signal.
REAP_WAIT_S = 30.0
PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def dying(pid: int) -> str | None:
    """Why the kernel is tearing ``pid`` down, or None: SIGKILL pending, or the leader already in
    do_exit() or a zombie. waitpid() reports such a process only once its last thread has
    exited, which under load has taken over 10 s after a SIGKILL (on CI): it is dead to us
    from the kill on, not hung. Linux /proc; elsewhere (no /proc) None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return parse_dying(status, stat)


def parse_dying(status: str, stat: str) -> str | None:
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    pending = 0
    for key in ("SigPnd", "ShdPnd"):
        try:
            pending |= int(fields.get(key, "0").strip(), 16)
        except ValueError:
            pass
    if pending & (1 << (signal.SIGKILL - 1)):
        return "killed by SIGKILL"
    # After the command name (which may hold spaces and parentheses): state is field 3, flags
    # field 9, exit_code field 52 (proc(5)).
    rest = stat.rsplit(")", 1)[-1].split()
    if len(rest) < 7:
        return None
    state, flags = rest[0], int(rest[6])
    if state not in ("Z", "X") and not flags & PF_EXITING:
        return None
    code = int(rest[49]) if len(rest) > 49 else 0
    if code & 0x7F:
        return describe_exit(-(code & 0x7F))
    return describe_exit(code >> 8) if code else "exiting"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ManagedServer:
    """One server process (group) on a free loopback port."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, port: int, nice: int = 0):
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.port = port
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        """Running and not being torn down (see dying())."""
        return self.proc is not None and self.proc.poll() is None and dying(self.proc.pid) is None

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            logf.write(f"# kvfuzz: {' '.join(self.cmd)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        if self.nice:
            # Before vLLM spawns its EngineCore and workers (seconds of imports later): they
            # inherit it. preexec_fn would be exact but is unsafe in a threaded parent.
            try:
                # Relative to ours, as nice(1): set absolutely, a kvfuzz run under `nice 10` gave
                # its server 7, ahead of the client it was meant to yield to.
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
            except OSError as e:  # e.g. a negative value without privilege: run at our priority
                log.warning("could not renice the vLLM server to %d: %s", self.nice, e)
        (self.log_path.parent / "server.pid").write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise InfraError(f"vLLM server would not start ({self.died()}): "
                                 f"{self.last_error() or 'no error in its log'} (log: {self.log_path})")
            if health(self.base_url, timeout=2.0):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise InfraError(f"vLLM server did not answer /health within {timeout_s:.0f} s (log: {self.log_path})")
            time.sleep(0.25)
        self.start_seconds = time.perf_counter() - t0

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the process group, then SIGKILL if it lingers."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        steps = ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)) if grace_s > 0 else ((signal.SIGKILL, 5.0),)
        for sig, wait in steps:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; children (EngineCore) may still be exiting.
            if not _group_alive(pgid):
                break
            time.sleep(0.2)
            if not _group_alive(pgid):
                break
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=REAP_WAIT_S)
            except subprocess.TimeoutExpired:  # the kernel finishes it; nothing more we can send
                log.warning("vLLM server (pid %d) not reaped %.0f s after SIGKILL", self.proc.pid, REAP_WAIT_S)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole group at once: for a server that hung (a stopped or wedged
        process would sit out SIGTERM's grace period) or already died."""
        self.stop(grace_s=0.0)

    def log_tail(self, n: int = 40) -> list[str]:
        return read_tail(self.log_path, n)

    def last_error(self) -> str | None:
        """The most telling line of the log tail (an exception line, else the last line)."""
        tail = [ln.strip() for ln in self.log_tail(80) if ln.strip()]
        for ln in reversed(tail):
            if "Error" in ln or "error:" in ln or "Exception" in ln:
                return ln[-300:]
        return tail[-1][-300:] if tail else None

    def died(self) -> str | None:
        """None while alive; else why it stopped."""
        if self.proc is None:
            return describe_exit(None)
        code = self.proc.poll()
        return describe_exit(code) if code is not None else dying(self.proc.pid)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

