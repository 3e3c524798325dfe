"""The campaign driver for many workers (``kvfuzz run --ray``): one driver, one campaign state.

The driver owns everything the serial loop owns (seed sequence, corpus, coverage, bandit, bug
buckets, findings, ``campaign.json``); workers only run traces (harness + oracle + triage) and
send back the finding and the coverage buckets. Nothing here imports Ray: the cluster is an
``Executor`` (kvfuzz/scale/cluster.py has the Ray one; the tests also use an in-process fake).

Determinism: the window rule. Results are *committed* (learned, recorded, written to
``campaign.json``) strictly in trace-index order, whatever order they finish in, and trace ``i``
is generated right after index ``i - window`` is committed, so it sees exactly the feedback of
indices ``0 .. i - window``. The trace sequence is then a pure function of (seed, window, the
verdicts), never of the worker count, the cluster's timing or worker deaths. ``window = 1``
is the serial campaign (trace ``i`` sees ``0 .. i-1``). A window larger than the worker count
keeps workers busy while a slow trace holds the commit point; it is recorded in
``campaign.json`` and kept by ``--resume``.

Buckets are keyed by equality (oracle/buckets.py), so two workers that open a bucket for one
key at once open the same id: the one committed first opens it, the other joins it.

Traces generated but not yet committed are appended to ``OUT/pending.jsonl`` before they are
handed out, so a resumed campaign re-runs exactly them (a result that finished after the commit
point but before the driver died is simply run again).

Writes are grouped: after each batch of results (one ``ray.wait`` drain), everything that can be
committed is, then the pending log is fsynced and ``campaign.json`` atomically replaced once. An
fsync costs tens of milliseconds on a busy disk; one per trace would cap a driver at a few
traces per second, one per batch lets the batch grow with the load (docs/scale.md).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvfuzz.traces import Finding, Trace, atomic_write_text, parse_trace
from kvfuzz.traces.timing import TimeBreakdown  # noqa: TC001 - a Result field
from kvfuzz.traces.buckets import Bucket, BucketMembership
from kvfuzz.traces.errors import BadInput, InfraError

from .campaign import CAMPAIGN_FILE, Campaign, CampaignOptions, CampaignState, TraceOutcome, thin_log

PENDING_LOG = "pending.jsonl"
# A trace whose worker died this many times is not re-queued again: the trace itself kills the
# worker process (a segfault in the engine), which is an engine crash, recorded as a finding.
MAX_WORKER_DEATHS_PER_TRACE = 2


@dataclass
class Task:
    index: int
    trace: Trace
    # Bug buckets committed so far (id -> bucket): a finding whose key is one of them joins it
    # without minimizing a witness. Every committed index is lower than this one.
    known: dict[str, Bucket]


@dataclass
class Result:
    index: int
    worker: str
    finding: Finding | None = None
    buckets: list[str] = field(default_factory=list)
    # The finding's bug-bucket memberships, as the worker's triage placed it.
    memberships: list[BucketMembership] = field(default_factory=list)
    seconds: float = 0.0
    # Files the worker's triage wrote (originals of minimized findings ...), relative to OUT:
    # the driver writes them, so workers on other nodes need no shared filesystem.
    files: dict[str, str] = field(default_factory=dict)
    # Where the worker's time went on this trace (traces/timing.py); summed into state.time.
    time: TimeBreakdown | None = None
    # The witness of each bucket the finding opens (``Triaged.cases``).
    cases: dict[str, Finding] = field(default_factory=dict)
    # The engine refused the trace's configuration (``ConfigRefused``): skipped, this reason counted.
    refused: str | None = None


@dataclass
class Lost:
    """A task whose worker died (actor or node gone) before it answered."""

    index: int
    worker: str
    detail: str


class Executor(Protocol):
    """What the driver needs from a cluster of workers."""

    def idle(self) -> list[str]: ...

    def busy(self) -> int: ...

    def submit(self, worker: str, task: Task) -> None: ...

    def wait(self, timeout_s: float | None) -> list[Result | Lost]: ...

    def alive(self) -> bool: ...

    def crash_finding(self, trace: Trace, arms: dict[str, list[str]] | None, deaths: list[dict]) -> Finding:
        """The engine-crash finding for a trace that killed its worker every time it ran (built
        by the executor: the fuzzer does not import the harness or the oracle)."""
        ...


def read_pending(out: Path) -> dict[int, tuple[Trace, str]]:
    """index -> (trace, source) from the pending log; the last record of an index wins and a
    torn last line (the driver died while appending) is ignored."""
    path = out / PENDING_LOG
    got: dict[int, tuple[Trace, str]] = {}
    if not path.exists():
        return got
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):
        try:
            data = json.loads(line)
            got[int(data["index"])] = (parse_trace(data["trace"]), data["source"])
        except (ValueError, KeyError) as e:
            if n == len(lines) - 1:
                break
            raise BadInput(f"cannot resume: unreadable pending trace on line {n + 1} ({e})",
                           source=str(path)) from None
    return got


def default_window(workers: int) -> int:
    """``--window``'s default. At 2 x workers, one worker's triage of a few seconds (a known
    bucket's attribution, 8-11 s; a new bucket's box, 34 s) held the commit point while the
    other ran out of traces: workers sat idle 8-28% of the time in 3-minute Ray campaigns, and
    4 x workers halved it. Trace ``i`` then sees the feedback of ``0 .. i - 4w``: older by a few
    traces, still deterministic."""
    return 4 * workers


class Driver:
    """The commit loop over an ``Executor``. See the module docstring for the window rule."""

    def __init__(self, opts: CampaignOptions, executor: Executor, *, window: int,
                 arms: dict[str, list[str]] | None = None,
                 on_outcome: Callable[[TraceOutcome, CampaignState], None] | None = None,
                 on_start: Callable[[Campaign], None] | None = None,
                 on_commit: Callable[["Driver", int], None] | None = None):
        if window < 1:
            raise BadInput("must be at least 1", field="--window")
        self.opts = opts
        self.ex = executor
        self.out = opts.out
        (self.out / "findings").mkdir(parents=True, exist_ok=True)
        self.camp = Campaign(opts)
        st = self.state = self.camp.state
        if opts.resume and st.window is not None and st.window != window:
            # The sequence depends on the window: a resumed campaign keeps its own.
            window = st.window
        st.window = window
        self.window = window
        if on_start:
            on_start(self.camp)
        self.on_outcome = on_outcome
        self.on_commit = on_commit
        self.generated: dict[int, tuple[Trace, str]] = {}
        self.queue: deque[int] = deque()
        self.done: dict[int, Result] = {}
        self.running: dict[int, str] = {}
        self.deaths: dict[int, list[dict]] = {}
        self.arms = arms
        # CPU of this whole process while the loop ran (Ray's client threads included), and the
        # part spent committing (learn, record, generate, write state).
        self.driver_cpu_s = 0.0
        self.commit_cpu_s = 0.0
        self.committed = 0

    # -- the limit ---------------------------------------------------------------------------
    def _last_index(self) -> int | None:
        """The first index past the campaign's trace budget (None: time-bounded only)."""
        if self.opts.max_traces is None:
            return None
        return self.state.next_index + (self.opts.max_traces - self.state.traces)

    def _generate(self, i: int, pending: dict[int, tuple[Trace, str]] | None = None) -> None:
        """Draw (or read back) trace ``i`` and log it; queue it if it is within the trace budget.
        Indices past the budget are drawn and logged too, not run: trace i is drawn from the
        state after index i - window, so a campaign stopped by --traces N and resumed with more
        must find traces N .. N + window - 1 in the pending log to continue the same sequence."""
        got = pending.get(i) if pending else None
        trace, source = got if got is not None else self.camp.next_trace(i)
        self.generated[i] = (trace, source)
        self.log.write(json.dumps({"index": i, "source": source, "trace": trace.model_dump(mode="json")}) + "\n")
        self.logged += 1
        end = self._last_index()
        if end is None or i < end:
            self.queue.append(i)

    def _first_window(self) -> None:
        """Indices next_index .. next_index + window - 1. On --resume their generation is already
        in the state (the pending log is synced before every campaign.json that follows it), so
        they are read back, not drawn again."""
        first = self.state.next_index
        pending = read_pending(self.out) if self.opts.resume else {}
        self._open_log()
        for i in range(first, first + self.window):
            self._generate(i, pending)

    def _compact_log(self) -> None:
        """Rewrite the pending log to hold only the uncommitted traces (drawn, not yet run)."""
        lines = [json.dumps({"index": i, "source": src, "trace": t.model_dump(mode="json")})
                 for i, (t, src) in sorted(self.generated.items())]
        atomic_write_text(self.out / PENDING_LOG, "".join(x + "\n" for x in lines))
        self.logged = len(lines)

    def _open_log(self) -> None:
        """A fresh pending log, open for appending (it is rewritten whenever it has grown well
        past the window, so it stays small)."""
        self._compact_log()
        self.log = open(self.out / PENDING_LOG, "a", encoding="utf-8")

    def _sync(self) -> None:
        """The commit point: pending log on disk first, then the state that counts its traces."""
        self.log.flush()
        os.fsync(self.log.fileno())
        atomic_write_text(self.out / CAMPAIGN_FILE, self.state.to_json())
        if self.logged > 4 * self.window + 64:
            self.log.close()
            self._open_log()

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> CampaignState:
        import resource

        st = self.state
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        base_seconds = st.seconds
        self.started = start
        self._first_window()
        self._sync()
        stopping = False
        while True:
            elapsed = time.monotonic() - start
            if self.opts.budget_s is not None and elapsed >= self.opts.budget_s:
                stopping = True  # no new work; what runs is committed if it comes back in order
            if not self.queue and not self.running:
                break
            if stopping and not self.running:
                if self._commit_ready(stopping, base_seconds, start):
                    self._sync()
                break
            if not stopping:
                for w in self.ex.idle():
                    if not self.queue:
                        break
                    i = self.queue.popleft()
                    self.running[i] = w
                    self.ex.submit(w, Task(i, self.generated[i][0], dict(st.bug_buckets)))
            if not self.running:
                if not self.ex.alive():
                    raise InfraError("no Ray worker is left alive (every worker died and none could be replaced)")
                # Nothing running but work queued: workers are being (re)started.
            left = None if self.opts.budget_s is None else max(0.05, self.opts.budget_s - elapsed)
            starved = self._starved(stopping)
            t_wait = time.monotonic()
            events = self.ex.wait(left if left is not None else 5.0)
            st.window_wait_s = round(st.window_wait_s + starved * (time.monotonic() - t_wait), 3)
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            for ev in events:
                self.running.pop(ev.index, None)
                if isinstance(ev, Lost):
                    self._lost(ev)
                else:
                    self.done[ev.index] = ev
            committed = self._commit_ready(stopping, base_seconds, start)
            if committed or events:
                self._sync()
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            self.commit_cpu_s += (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.driver_cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        st.complete = True
        st.seconds = round(base_seconds + time.monotonic() - start, 3)
        self._sync()
        self.log.close()
        # The pending log keeps only the drawn, unrun window: what a later --resume continues with.
        self._compact_log()
        return st

    def _starved(self, stopping: bool) -> int:
        """Workers idle only because the window is full: nothing queued, though the campaign
        would go on (the next index to draw is within its trace budget)."""
        if stopping or self.queue or not self.running:
            return 0
        end = self._last_index()
        if end is not None and self.state.next_index + self.window >= end:
            return 0
        return len(self.ex.idle())

    def _commit_ready(self, stopping: bool, base_seconds: float, start: float) -> bool:
        """Commit what is next in index order."""
        committed = False
        while (res := self.done.pop(self.state.next_index, None)) is not None:
            self._commit(res, base_seconds, start)
            committed = True
        return committed

    def _lost(self, ev: Lost) -> None:
        st = self.state
        deaths = self.deaths.setdefault(ev.index, [])
        deaths.append({"worker": ev.worker, "detail": ev.detail})
        st.worker_deaths.append({"index": ev.index, "worker": ev.worker, "detail": ev.detail[:300]})
        if len(deaths) >= MAX_WORKER_DEATHS_PER_TRACE:
            trace = self.generated[ev.index][0]
            self.done[ev.index] = Result(ev.index, ev.worker,
                                         finding=self.ex.crash_finding(trace, self.arms, deaths))
            return
        st.requeued += 1
        self.queue.appendleft(ev.index)  # lowest first: it holds the commit point

    def _commit(self, res: Result, base_seconds: float, start: float) -> None:
        st = self.state
        i = res.index
        trace, source = self.generated.pop(i)
        if res.refused is not None:
            st.refused[res.refused] = st.refused.get(res.refused, 0) + 1
            st.next_index = i + 1
            self._generate(i + self.window)
            return
        buckets = frozenset(res.buckets)
        before = (st.buckets, st.findings)
        novel = self.camp.learn(i, trace, source, buckets)
        for rel, text in res.files.items():
            atomic_write_text(self.out / rel, text)
        if res.finding is not None:
            members = self._first_in_order(res.memberships or res.finding.buckets)
            # Before record_finding: it writes the file, and the file must name its worker.
            res.finding.provenance.worker = res.finding.provenance.worker or res.worker
            self.camp.record_finding(i, trace, source, res.finding, members, res.cases)
        st.traces += 1
        st.count_requests(trace, res.buckets)
        self.committed += 1
        st.next_index = i + 1
        st.sources[source] = st.sources.get(source, 0) + 1
        st.by_worker[res.worker] = st.by_worker.get(res.worker, 0) + 1
        if res.time is not None:
            st.set_time(st.time_breakdown.plus(res.time))
        st.seconds = round(base_seconds + time.monotonic() - start, 3)
        if (st.buckets, st.findings) != before or i == 0:
            st.coverage_log.append([st.traces, st.seconds, st.buckets, st.findings])
            thin_log(st.coverage_log)
        # The trace one window ahead is drawn from the state that now includes exactly indices
        # 0..i, and logged (pending) before the campaign.json that includes its drawing.
        self._generate(i + self.window)
        if self.on_outcome:
            self.on_outcome(TraceOutcome(i, trace, res.finding, res.seconds, source, novel, buckets), st)
        if self.on_commit:
            self.on_commit(self, i)

    def _first_in_order(self, members: list[BucketMembership]) -> list[BucketMembership]:
        """A bucket's first finding is its lowest index: two workers may both have opened a
        bucket for one key; the one committed first opens it, the other joins it."""
        out = []
        for m in members:
            if m.status == "opened" and m.bucket in self.state.bug_buckets:
                m = m.model_copy(update={"status": "triaged", "how": "another worker opened it first"})
            out.append(m)
        return out


__all__ = ["Driver", "Executor", "Lost", "Result", "Task", "default_window"]
