"""Keep the replay client on time while the server it drives holds the CPU.

On a machine where client and server share a few cores, a client thread at normal priority
can wait hundreds of milliseconds to be scheduled (measured on 2 cores with the server niced
to 10: a nice-0 sleeper saw a 360 ms stall, a SCHED_FIFO one at most 8 ms; docs/benchmarks.md).
A send that leaves that late is a different schedule than the trace asked for. So during a
replay the event-loop thread runs under SCHED_FIFO when the OS allows it (root or
CAP_SYS_NICE), and the cyclic garbage collector is paused (a full collection in a process
that imported torch takes ~25 ms with the GIL held). Both are restored afterwards.

The client spends most of a replay asleep in epoll; its busy part (parsing ~100 short streams)
is well under one core, and the kernel's real-time throttling (95 % by default) bounds the
worst case. Without the privilege the replay runs at normal priority and the history says so
(``History.client_priority``), so a reader can tell which send figures to trust.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("kvfuzz.priority")

# Mid-range real-time priority: above every normal task, below the kernel's own RT threads
# (watchdogs, IRQ threads run at 50-99).
RT_PRIORITY = 10
# KVFUZZ_REALTIME=0 turns the real-time policy off (e.g. on a shared host where a runaway
# client must never starve others).
ENV = "KVFUZZ_REALTIME"


def realtime_allowed() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@contextmanager
def send_priority() -> Iterator[str]:
    """Run the body with the calling thread at real-time priority (if allowed and possible)
    and the cyclic GC paused. Yields what was obtained: ``"fifo"`` or ``"normal"``."""
    obtained = "normal"
    old: tuple[int, int] | None = None
    if realtime_allowed() and hasattr(os, "sched_setscheduler"):
        try:
            old = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)
            # pid 0 = the calling thread on Linux: only the event-loop thread is raised.
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
            obtained = "fifo"
        except (OSError, AttributeError) as e:
            old = None
            log.debug("no real-time priority for the replay client: %s", e)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield obtained
    finally:
        if gc_was_enabled:
            gc.enable()
        if old is not None:
            try:
                os.sched_setscheduler(0, old[0], os.sched_param(old[1]))
            except OSError as e:  # cannot happen when raising worked; never fail a replay on it
                log.warning("could not restore the client's scheduling policy: %s", e)
