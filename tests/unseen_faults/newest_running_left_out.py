"""Fault AU (the scheduler's running queue).

While two or more requests run, ``Scheduler.schedule`` leaves the newest of them (the latest to
arrive) out of the step: it is taken out of the running queue for the step and put back at its
place after, keeping its blocks. The others are served as usual, so the engine keeps stepping and
no token changes; the newest request gets its next token only once it runs alone (or a newer one
arrives and takes its place). The kind of bug of a running-queue walk that skips an entry. A
request alone is never left out, so its reference is right. Nothing recorded is wrong but the
schedule: the liveness check names it (``stall``; docs/oracle.md, "Liveness").
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-newest-running-left-out"


def _make(original):
    def schedule(self, *args, **kwargs):
        left_out = max(self.running, key=lambda r: r.arrival_time) if len(self.running) >= 2 else None
        if left_out is None:
            return original(self, *args, **kwargs)
        at = self.running.index(left_out)
        del self.running[at]
        try:
            return original(self, *args, **kwargs)
        finally:
            self.running.insert(min(at, len(self.running)), left_out)

    return schedule


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    wrap(Scheduler, "schedule", _TAG, _make)
