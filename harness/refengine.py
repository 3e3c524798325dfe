"""A reference engine beside the fuzzed one (issue 59; docs/oracle.md "Reference engine").

A trace's prompts and parameters are known before it runs, so its references (each request
alone on a clean cache, on ``reference_config`` of the trace's engine) can be computed while
the fuzzed engine replays it. ``ReferenceEngine`` is the parent's side: it starts a child
process (``python -m kvfuzz.harness.refengine IN_FD OUT_FD``) that runs in-process vLLM engines
of the references' configurations, one torch/OMP thread, with the in-process harness's
environment, and sends it reference requests over a pipe, one JSON line each:

    parent -> child  {"id": n, "config": EngineConfig, "device": str, "send": SendEvent,
                      "binding": Binding | null}      a reference, on the reference's config
                     {"cancel": n}                     skip n if not begun
    child -> parent  {"id": 0, "ready": true}          once, when the child is up
                     {"id": n, "started": true}        it begins n (requests run in order)
                     {"id": n, "record": RequestRecord}  or  {"id": n, "error": "one line"}

The parent's ``ReferenceStore`` (harness/runner.py) submits a trace's references before its
runs, and the next trace's (the campaign's look-ahead) after them (``prefetch``); when it needs
one to compare a request it waits for it (``wait``) if the child has begun it, else computes it
itself and cancels it in the child (so the fuzzed engine never idles behind the child's queue,
e.g. while the child's engine starts). Results enter the store under its usual keys; answers
nobody claimed (the look-ahead guessed wrong) join the store at the next trace. A child that dies (or does not answer within
``timeout_s``) is restarted once, its outstanding requests sent again; the second death turns
the reference engine off for the rest of the campaign (one warning line saying why), and
every reference not yet in is computed on the fuzzed engine as before: ``wait`` returns None,
never a made-up record, so no verdict is made on a missing reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvfuzz.traces import EngineConfig, RequestRecord, SendEvent
from kvfuzz.traces.trace import Binding

from .refstore import warn_stderr

# A reference the child has not answered within this many seconds counts as a dead child.
DEFAULT_TIMEOUT_S = 600.0
# Engines the child keeps alive (one per reference configuration, least recently used closed;
# as in the campaign's own pool, memory bounds it before this cap does).
CHILD_POOL_SIZE = 48
# "0": the caller waits for every reference it asked for, even one the child has not begun
# (tests that must see the child compute; measurements).
STEAL_ENV = "KVFUZZ_REFERENCE_STEAL"
# "0" or "1": ``kvfuzz run``'s default instead of the machine's (the test suite pins 0: its
# campaigns measure other things and must not start a child each).
DEFAULT_ENV = "KVFUZZ_REFERENCE_ENGINES"


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the parent's (toggles, KVFUZZ_PLUGIN_MODULES, the reference
    cache, VLLM_BATCH_INVARIANT when a control set it: what makes its references the parent's),
    the in-process harness's settings (harness/inprocess.py ``_prepare_env``) and one OMP
    thread (vLLM's CPU engine serves with one torch thread)."""
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CONFIGURE_LOGGING": "0", "OMP_NUM_THREADS": "1"})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    return env


def default_reference_engines(engine: str, device: str, *, ray: bool, cores: int | None = None) -> int:
    """``kvfuzz run``'s default: a reference engine where it has a core or a device to itself.
    In-process only (a server computes its references through its own HTTP queue); not on Ray,
    where it doubles what each worker asks of the cluster (``--reference-engines 1`` says so).
    CPU: the fuzzed engine's torch threads (``OMP_NUM_THREADS``, one by default) plus one core
    for the child. CUDA: a second visible GPU (``reference_gpu``)."""
    if (chosen := os.environ.get(DEFAULT_ENV)) is not None:
        return 1 if chosen.strip() == "1" else 0
    if engine != "inprocess" or ray:
        return 0
    if device == "cuda":
        return 1 if child_gpu() is not None else 0
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        threads = 1
    return 1 if cores >= threads + 1 else 0


def reference_gpu(visible: str | None, count: int) -> str | None:
    """The device of a CUDA child (its CUDA_VISIBLE_DEVICES): the parent's second visible GPU
    (the fuzzed engine runs on the first), or None when the parent has one: two engines on one
    device take turns on it, so references stay on the fuzzed engine. ``visible``: the parent's
    CUDA_VISIBLE_DEVICES (Ray sets a worker's); ``count``: the GPUs torch sees when it is unset."""
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else [
        str(i) for i in range(count)]
    return ids[1] if len(ids) >= 2 else None


def child_gpu() -> str | None:
    """``reference_gpu`` of this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return reference_gpu(visible, 0)
    import torch

    return reference_gpu(None, torch.cuda.device_count())


@dataclass
class _Job:
    id: int
    key: object
    message: dict[str, object]
    tag: object = None  # the submitter's, handed back with an answer nobody waited for
    started: bool = False  # the child has begun computing it
    done: threading.Event = field(default_factory=threading.Event)
    record: RequestRecord | None = None
    error: str | None = None


class ReferenceEngine:
    """The parent's side of the reference engine: submit references ahead, wait for them.

    ``command``: how the child is started (tests start a fake child speaking the same
    protocol). ``restarts``: how many deaths are survived by a restart (1) before falling back
    to serial references for good."""

    def __init__(self, *, log_file: Path | None = None, command: Sequence[str] | None = None,
                 env: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, restarts: int = 1,
                 steal: bool | None = None, warn: Callable[[str], None] = warn_stderr) -> None:
        self.log_file = log_file
        self.command = list(command) if command is not None else [sys.executable, "-m", "kvfuzz.harness.refengine"]
        self.env = env if env is not None else child_env()
        self.timeout_s = timeout_s
        self.restarts_left = restarts
        self.warn = warn
        self.restarts = 0
        # A reference needed now that the child has not begun is computed by the caller
        # (``wait`` returns None) and cancelled in the child: the fuzzed engine never idles
        # behind a queue (the child still starting, or behind).
        self.steal = steal if steal is not None else os.environ.get(STEAL_ENV, "1") != "0"
        self.stolen = 0
        self.submitted = 0
        self.answered = 0
        # Why the reference engine is off (None: on).
        self.off: str | None = None
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}  # by id, outstanding or answered and not yet taken
        self._by_key: dict[object, _Job] = {}
        self._next = 1
        self._proc: subprocess.Popen[bytes] | None = None
        # Lines for the current child, written by a thread of their own: a child that does not
        # read (still importing, or stuck) never blocks the fuzzed run on a full pipe.
        self._outbox: queue.SimpleQueue[str | None] | None = None
        self._spawned = 0  # children started so far
        self._current = 0  # which of them is running and still reading (0: none)

    # -- the child -------------------------------------------------------------------------------
    def start(self) -> "ReferenceEngine":
        if self._proc is None and self.off is None:
            self._spawn()
        return self

    def _spawn(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        log = open(self.log_file, "ab") if self.log_file is not None else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen([*self.command, str(to_child_r), str(from_child_w)], env=self.env,
                                          pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=log)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]
            os.close(to_child_r)
            os.close(from_child_w)
        outbox: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._outbox = outbox
        threading.Thread(target=self._write, args=(os.fdopen(to_child_w, "w"), outbox),
                         name="kvfuzz-reference-requests", daemon=True).start()
        self._spawned += 1
        self._current = self._spawned
        reader = threading.Thread(target=self._read, args=(os.fdopen(from_child_r, "r"), self._spawned),
                                  name="kvfuzz-reference-engine", daemon=True)
        reader.start()

    def _read(self, stream: IO[str], generation: int) -> None:
        """The reader thread: answers into their jobs until the child's end of the pipe closes."""
        with stream:
            for line in stream:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                with self._lock:
                    job = self._jobs.get(int(msg.get("id", 0)))
                    if job is None or job.done.is_set():
                        continue
                    if msg.get("started"):
                        job.started = True
                        continue
                    if "record" in msg:
                        try:
                            job.record = RequestRecord.model_validate(msg["record"])
                        except ValueError as e:
                            job.error = f"unreadable answer: {str(e).splitlines()[0]}"
                    else:
                        job.error = str(msg.get("error") or "no record")
                    self.answered += 1
                    job.done.set()
        with self._lock:
            if generation == self._current:
                self._current = 0  # this child is gone: the next wait restarts or falls back

    @staticmethod
    def _write(stream: IO[str], outbox: "queue.SimpleQueue[str | None]") -> None:
        """The writer thread: lines to the child until told to stop (None) or the pipe breaks."""
        with contextlib.suppress(OSError, ValueError), stream:
            while (line := outbox.get()) is not None:
                stream.write(line)
                stream.flush()

    def _died(self, why: str) -> None:
        """The child died or hung: restart it once (sending what it had not answered again), else
        turn the reference engine off, every outstanding reference computed serially."""
        self._kill()
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.restarts += 1
            self.warn(f"reference engine {why}: restarted")
            try:
                self._spawn()
                with self._lock:
                    pending = [j for j in self._jobs.values() if not j.done.is_set()]
                    for j in pending:
                        j.started = False  # the new child has begun none of them
                for j in pending:
                    self._send(j.message)
                return
            except OSError as e:
                why = f"{why}, and would not restart ({e})"
        self.off = why
        self.warn(f"reference engine {why}: references are computed on the fuzzed engine from here on")
        self._release_all()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        outbox, self._outbox = self._outbox, None
        self._current = 0
        if outbox is not None:
            outbox.put(None)  # its writer closes the pipe (or finds it broken once the child is killed)
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, message: dict[str, object]) -> bool:
        if self._outbox is None:
            return False
        self._outbox.put(json.dumps(message) + "\n")
        return True

    def _why_gone(self) -> str:
        """Its exit code (waited for a moment: its pipe closes before it is reaped)."""
        proc = self._proc
        if proc is None:
            return "is not running"
        try:
            return f"exited ({proc.wait(timeout=5)})"
        except subprocess.TimeoutExpired:
            return "closed its pipe"

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._current != 0

    # -- submit and wait -------------------------------------------------------------------------
    def submit(self, key: object, config: EngineConfig, device: str, send: SendEvent,
               binding: Binding | None, tag: object = None) -> None:
        """Ask for the reference of ``send`` (on ``config``, the reference's configuration),
        known to the store by ``key``; a key already asked for is not asked again."""
        if self.off is not None:
            return
        self.start()
        with self._lock:
            if key in self._by_key:
                return
            job = _Job(self._next, key, tag=tag, message={"id": self._next, "config": config.model_dump(mode="json"), "device": device,
                                    "send": send.model_dump(mode="json", by_alias=True),
                                    "binding": binding.model_dump(mode="json") if binding is not None else None})
            self._next += 1
            self._jobs[job.id] = job
            self._by_key[key] = job
        self.submitted += 1
        if not self._send(job.message):
            self._died("lost its pipe")

    def take_answered(self, keep: set[object]) -> list[tuple[object, object, RequestRecord]]:
        """Answers nobody has waited for (references of a trace asked for ahead that ran
        otherwise, or crashed), except those of ``keep``: (key, tag, record) each, forgotten
        here (the store keeps them), so unclaimed answers do not pile up over a campaign."""
        out = []
        with self._lock:
            for k, job in list(self._by_key.items()):
                if k in keep or not job.done.is_set():
                    continue
                del self._by_key[k]
                self._jobs.pop(job.id, None)
                if job.record is not None:
                    out.append((k, job.tag, job.record))
        return out

    def status(self, key: object) -> str | None:
        """Where the reference asked for under ``key`` is: "done" (answered), "begun", "queued",
        or None (not asked for, or forgotten)."""
        with self._lock:
            job = self._by_key.get(key)
            if job is None:
                return None
            return "done" if job.done.is_set() else "begun" if job.started else "queued"

    def pending(self, key: object) -> bool:
        with self._lock:
            return key in self._by_key

    def wait(self, key: object) -> RequestRecord | None:
        """The reference asked for under ``key``, once the child has answered; None when it was
        not asked for, the child has not begun it (``steal``: it is cancelled there, the caller
        computes it now), the child answered with an error, or the reference engine is off (then
        the caller computes it on the fuzzed engine)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                job = self._by_key.get(key)
                if job is None:
                    return None
                if job.done.is_set():
                    del self._by_key[key]
                    self._jobs.pop(job.id, None)
                    break
                stolen = self.steal and not job.started
                if stolen:
                    del self._by_key[key]
                    self._jobs.pop(job.id, None)
                    self.stolen += 1
            if stolen:
                self._send({"cancel": job.id})  # the child skips it (an answer already on its way is dropped)
                return None
            if job.done.wait(0.2):
                continue
            if self.off is not None:
                return None
            if not self.alive:
                self._died(self._why_gone())
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() >= deadline:
                self._died(f"did not answer within {self.timeout_s:g} s")
                deadline = time.monotonic() + self.timeout_s
        if job.error is not None:
            self.warn(f"reference engine could not compute {job.message['send']!r:.60}: {job.error}; "
                      f"computed on the fuzzed engine")
        return job.record

    def close(self) -> None:
        """Stop the child (it also exits by itself when the parent's end of the pipe closes)."""
        self._kill()
        self._release_all()

    def _release_all(self) -> None:
        """Every outstanding wait returns (with no record: the caller computes it) and nothing
        is asked for any more."""
        with self._lock:
            for j in self._jobs.values():
                j.done.set()
            self._jobs.clear()
            self._by_key.clear()


# -- the child -----------------------------------------------------------------------------------
Compute = Callable[[EngineConfig, str, SendEvent, Binding | None], RequestRecord]


def serve(inp: IO[str], out: IO[str], compute: Compute,
          prepare: Callable[[EngineConfig, str], object] | None = None) -> None:
    """The child's loop: requests in, in order, each answered with a line saying it has begun
    (after ``prepare``: its engine is up, so a start is not counted as begun), then its record (or its error: an exception computing one reference is that reference's,
    not the child's end); a request cancelled before it began is skipped. Ends when ``inp``
    closes (the parent went away)."""
    queue: deque[dict[str, Any]] = deque()
    cancelled: set[int] = set()
    closed = [False]
    cond = threading.Condition()

    def read() -> None:
        for line in inp:
            if not line.strip():
                continue
            msg = json.loads(line)
            with cond:
                if "cancel" in msg:
                    cancelled.add(int(msg["cancel"]))
                else:
                    queue.append(msg)
                cond.notify()
        with cond:
            closed[0] = True
            cond.notify()

    threading.Thread(target=read, name="kvfuzz-reference-requests", daemon=True).start()

    def say(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    say({"id": 0, "ready": True})
    while True:
        with cond:
            while not queue and not closed[0]:
                cond.wait()
            if not queue:
                return
            msg = queue.popleft()
            if int(msg["id"]) in cancelled:
                cancelled.discard(int(msg["id"]))
                continue
        answer: dict[str, Any] = {"id": msg["id"]}
        try:
            config = EngineConfig.model_validate(msg["config"])
            if prepare is not None:
                prepare(config, msg.get("device", "cpu"))
                with cond:
                    if int(msg["id"]) in cancelled:  # taken by the parent while the engine started
                        cancelled.discard(int(msg["id"]))
                        continue
            say({"id": msg["id"], "started": True})
            send = SendEvent.model_validate(msg["send"])
            binding = Binding.model_validate(msg["binding"]) if msg.get("binding") is not None else None
            answer["record"] = compute(config, msg.get("device", "cpu"), send, binding).model_dump(mode="json")
        except Exception as e:  # noqa: BLE001 - the parent computes it itself and sees the real error
            answer["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        say(answer)


def _engine_compute(pool_size: int = CHILD_POOL_SIZE) -> tuple[Compute, Callable[[EngineConfig, str], object]]:
    """References on in-process engines of their configurations, kept in an engine pool; and
    the engine's start, before a request counts as begun."""
    from .inprocess import EnginePool

    pool = EnginePool(pool_size)

    def prepare(config: EngineConfig, device: str) -> object:
        import torch

        torch.set_num_threads(1)  # as OMP_NUM_THREADS says: one thread, like the fuzzed engine
        return pool.acquire(config, device=device, log_file=None, trace_deadline_s=None)

    def compute(config: EngineConfig, device: str, send: SendEvent, binding: Binding | None) -> RequestRecord:
        engine = pool.acquire(config, device=device, log_file=None, trace_deadline_s=None)
        try:
            return engine.run_alone(send, binding=binding)
        except BaseException:
            pool.discard(engine)  # its state is suspect
            raise

    return compute, prepare


def main(argv: list[str]) -> None:
    for k, v in child_env().items():
        os.environ[k] = v
    inp = os.fdopen(int(argv[0]), "r")
    out = os.fdopen(int(argv[1]), "w")
    compute, prepare = _engine_compute()
    serve(inp, out, compute, prepare)


if __name__ == "__main__":
    main(sys.argv[1:])
