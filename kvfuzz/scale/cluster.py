"""Campaigns and gates across many engines on Ray (``kvfuzz run --ray``, ``kvfuzz gate --ray``).

Ray is optional (the ``[ray]`` extra) and imported only here, only when ``--ray`` is given.
Each worker is a Ray actor that owns one kvfuzz ``Session`` (one engine: in-process, or a
managed server), its crash recovery and its campaign triage; the driver
(fuzzer/distributed.py) owns all campaign state. See docs/scale.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvfuzz.driver.settings import CampaignSettings
from kvfuzz.traces import Finding, Trace
from kvfuzz.traces.errors import BadInput, InfraError, KvfuzzError

if TYPE_CHECKING:
    from kvfuzz.driver.recovery import Recovering
    from kvfuzz.driver.session import Session
    from kvfuzz.triage.campaign import CampaignTriage

# Ray's C++ core reads RAY_* variables once, when ray is imported: they are set before that.
# Without them a bad address retries for about 14 minutes (docs/scale.md, "Connecting").
FAST_CONNECT = {
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": "2",
    "RAY_gcs_rpc_server_connect_timeout_s": "2",
    "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
    "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "2",
}
# Ray namespace of kvfuzz's actors; each is named kvfuzz-<driver pid>-<executor>-w<n>
# (``RayExecutor.actor_name``), so an operator (or a test) can find a campaign's workers with
# ray.get_actor. A killed actor's name is released asynchronously: names are never reused.
NAMESPACE = "kvfuzz"
# A local start on a loaded machine: the raylet aborts when the dashboard agent has not written
# its port within agent_register_timeout_ms, and the driver gives the GCS 30 s per connect;
# measured on a 2-core box at load average 30-45, both were missed (docs/benchmarks.md, "Ray").
SLOW_MACHINE_START = {"RAY_agent_register_timeout_ms": "600000", "RAY_py_gcs_connect_timeout_s": "300"}
# Ray gives a starting raylet a fixed 30 s to register with its GCS; a machine under heavy load
# can miss that, so a local start is tried this many times.
LOCAL_START_ATTEMPTS = 4
# A worker that is not up after this long (imports, engine start) means the cluster cannot place it.
WORKER_START_TIMEOUT_S = 900.0
# How many replacement workers a campaign starts in all (after actor or node deaths).
MAX_REPLACEMENTS_FACTOR = 2


def ray_available() -> str | None:
    """None if ray can be imported, else why not (a one-line hint)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'kvfuzz[ray]'"
    return None


def _resolve(address: str) -> tuple[str, str, int]:
    """``auto`` | ``host:port`` | ``ray://host:port`` -> (kind, host, port)."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or ""
        if not address:
            # Where `ray start --head` records its address (Ray's own lookup for "auto").
            p = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
            if not p.exists():
                raise InfraError("no running Ray cluster found for --ray auto (start one with `ray start --head`)")
            address = p.read_text().strip()
    kind = "gcs"
    if address.startswith("ray://"):
        kind, address = "client", address[len("ray://"):]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"bad Ray address {address!r} (auto, host:port or ray://host:port)", field="--ray")
    return kind, host.strip("[]"), int(port)


def _reachable(host: str, port: int) -> None:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            pass
    except OSError as e:
        raise InfraError(f"cannot reach Ray at {host}:{port}: {e.strerror or e}") from None


def connect(address: str | None, *, num_cpus: float | None = None, env: dict[str, str] | None = None) -> bool:
    """Join the Ray cluster at ``address`` (None: start a local Ray instance). Returns True when
    this process started Ray (and must stop it). A bad or unreachable address raises
    InfraError (exit 3) with one line; Ray's own retry chatter goes to a file it names."""
    where = _resolve(address) if address is not None else None  # bad input first (exit 2)
    if where is not None:
        _reachable(where[1], where[2])
    why = ray_available()
    if why:
        raise InfraError(why)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from a fuzzer
    runtime_env = {"env_vars": dict(env or {})}
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return False
    if address is None:
        if "ray" not in sys.modules:
            for k, v in SLOW_MACHINE_START.items():
                os.environ.setdefault(k, v)
        import ray

        kw: dict[str, Any] = {}
        if num_cpus is not None:
            kw["num_cpus"] = num_cpus
        # Ray gives its raylet a fixed 30 s to register; on a loaded machine that can pass: try
        # again before calling it an infrastructure failure.
        for _attempt in range(LOCAL_START_ATTEMPTS):
            with _stderr_to_file() as log:
                try:
                    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                             runtime_env=runtime_env, namespace=NAMESPACE, **kw)
                    return True
                except Exception as e:  # noqa: BLE001 - Ray raises bare Exception here
                    error = f"{_first_line(e)} [details: {log}]"
                    ray.shutdown()
                    _kill_half_started_ray()
        raise InfraError(f"could not start a local Ray instance ({LOCAL_START_ATTEMPTS} attempts): {error}")
    assert where is not None  # an address was given: resolved above
    kind, host, port = where
    if "ray" not in sys.modules:
        for k, v in FAST_CONNECT.items():
            os.environ.setdefault(k, v)
        # Ray >= 2.5x turns token auth on for clusters it starts, but a driver given an explicit
        # address does not use the token unless told to.
        if "RAY_AUTH_MODE" not in os.environ and (
                (Path.home() / ".ray" / "auth_token").exists() or "RAY_AUTH_TOKEN" in os.environ
                or "RAY_AUTH_TOKEN_PATH" in os.environ):
            os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    target = f"ray://{host}:{port}" if kind == "client" else f"{host}:{port}"
    with _stderr_to_file() as log:  # Ray's C++ core writes its retries straight to fd 2
        try:
            ray.init(address=target, log_to_driver=False, logging_level=logging.WARNING, runtime_env=runtime_env,
                     namespace=NAMESPACE)
        except Exception as e:  # noqa: BLE001 - ConnectionError, auth errors, timeouts: all one line
            raise InfraError(f"Ray at {target} did not answer as a Ray cluster: {_first_line(e)} "
                             f"[details: {log}]") from None
    return False


def _kill_half_started_ray() -> None:
    """A local start that timed out leaves its GCS, raylet and helpers running (Ray raised
    before it recorded them, so ray.shutdown() cannot stop them): kill this process's Ray
    children."""
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(child.cmdline()):
                child.kill()
        except psutil.Error:
            pass


@contextlib.contextmanager
def _stderr_to_file():
    """File descriptor 2 into a temporary file (yields its name): Ray's start-up and retry
    chatter stays off the terminal, and a one-line error can point at it."""
    log = tempfile.NamedTemporaryFile(prefix="kvfuzz-ray-", suffix=".log", delete=False)
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield log.name
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


def worker_env(threads: int) -> dict[str, str]:
    """Environment of every worker process (runtime_env): vLLM in-process and quiet, the
    driver's kvfuzz/vLLM/HF settings, torch threads to fit the worker's CPU share."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    for k, v in os.environ.items():
        if k.startswith(("KVFUZZ_", "VLLM_", "HF_")) and k not in env:
            env[k] = v
    return env


@dataclass
class WorkerSpec:
    """What a campaign worker builds its session and triage from (picklable, no engine): a Ray
    actor's, and `kvfuzz run`'s own without --ray, both by kvfuzz.driver.settings' builders."""

    settings: CampaignSettings = field(default_factory=CampaignSettings)
    log_dir: str = "kvfuzz-out/workers"
    threads: int = 1
    # On Ray: the name of the campaign's StoreService actor (set by RayExecutor), which every
    # worker reads and writes instead of its own disk tiers.
    store_actor: str | None = None

    @property
    def device(self) -> str:
        return self.settings.session.device

    @property
    def reference_engines(self) -> int:
        return self.settings.session.reference_engines

    @property
    def cpus(self) -> int:
        """CPUs a worker asks for: its engine's threads, and one for its reference engine's
        child (one torch thread), so Ray never places that child on a core a worker uses."""
        return self.threads + self.reference_engines

    @property
    def pooled(self) -> bool:
        return self.settings.pooled

    def build_session(self, log_dir: Path) -> "Session":
        """The campaign's session; its engine and server logs go to ``log_dir``."""
        from kvfuzz.driver.session import build_session

        return build_session(self.settings.session, log_dir)

    def build_triage(self, session: "Session", guard: "Recovering", out: Path, *,
                     status: Callable[[str], None] = lambda _m: None) -> "CampaignTriage":
        from kvfuzz.triage.campaign import build_triage

        return build_triage(self.settings, session, guard, out, status=status)


# Kills a worker's managed vLLM server when the worker process is gone (ray.kill is SIGKILL:
# nothing in the worker can clean up, and the server runs in its own session).
_WATCHDOG = """
import os, signal, sys, time
pid, pidfile = int(sys.argv[1]), sys.argv[2]
while True:
    time.sleep(1.0)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
try:
    pg = int(open(pidfile).read().split()[0])
    for sig in (signal.SIGTERM, signal.SIGKILL):
        os.killpg(pg, sig)
        time.sleep(5.0)
except (OSError, ValueError):
    pass
"""


class WorkerCore:
    """One worker: a session on one engine, its crash recovery and campaign triage. Ray-free
    (``ray_worker_class`` wraps it as an actor), so its logic is testable in-process."""

    def __init__(self, spec: WorkerSpec, name: str):
        import subprocess

        from kvfuzz.driver.recovery import Recovering

        self.spec = spec
        self.name = name
        # Engines at a lower priority than the cluster's control plane (a busy raylet misses
        # Ray's fixed start-up deadlines): KVFUZZ_WORKER_NICE, passed to every worker.
        want = int(os.environ.get("KVFUZZ_WORKER_NICE", "0") or 0)
        if want > os.nice(0):
            os.nice(want - os.nice(0))
        log_dir = Path(spec.log_dir) / name
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            import torch

            torch.set_num_threads(max(1, spec.threads))
        except ImportError:
            pass
        if spec.settings.session.kind == "server":
            subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(log_dir / "server.pid")],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        self.session = spec.build_session(log_dir)
        if spec.store_actor:
            self._use_store(spec.store_actor)
        self.guard = Recovering(self.session)
        self.pooled = spec.pooled
        if self.pooled:
            from kvfuzz.harness.inprocess import CAMPAIGN_POOL_SIZE, share_engines

            share_engines(CAMPAIGN_POOL_SIZE)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kvfuzz-{name}-"))
        self.triage = spec.build_triage(self.session, self.guard, self.scratch)

    def _use_store(self, actor: str) -> None:
        """The campaign's reference store is the driver's StoreService (harness/refstore.py):
        read-through, write-through; hits on entries another worker wrote count as shared."""
        import ray

        from kvfuzz.harness.refstore import RemoteTiers

        handle = ray.get_actor(actor, namespace=NAMESPACE)

        def call(method: str, *args: Any) -> Any:
            return ray.get(getattr(handle, method).remote(*args))

        tiers = RemoteTiers(call, writer=f"{socket.gethostname()}-{os.getpid()}-{self.name}")
        self.session.references.tiers = self.session.scores.tiers = tiers

    def ready(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "host": socket.gethostname()}

    def start(self, config, profile=None, calibrate: bool = False, profile_file: str | None = None) -> dict:
        """Start the engine and settle its noise bounds: ``profile`` (measured by another
        worker), else the profile file / cache / a calibration when ``calibrate``."""
        from kvfuzz.driver.calibrate import calibrate_drawn, prepare_bounds
        from kvfuzz.traces.calibration import find_profile

        self.session.engine_for(config)
        warned: list[str] = []
        if profile is not None:
            bounds = self.session.use_profile(config, profile)
        else:
            bounds = prepare_bounds(self.session, config, profile_file=Path(profile_file) if profile_file else None,
                                    calibrate_if_missing=calibrate, warn=warned.append)
            profile = next(iter(self.session.profiles), None) or find_profile(
                self.session.engine_for(config).noise_key(), self.session.profiles_dir)
        if calibrate and profile_file is None:
            self.session.calibrate_missing = calibrate_drawn(self.session, None, warned)
        return {"profile": profile, "warnings": warned, "bounds": bounds.describe(), **self.ready()}

    def run(self, task) -> Any:
        from kvfuzz.fuzzer.distributed import Result
        from kvfuzz.fuzzer.feedback import trace_signature
        from kvfuzz.traces.timing import TRIAGE

        t0 = time.monotonic()
        # Exactly the buckets committed below this index (not what this worker saw before):
        # whether a finding opens a bucket never depends on which worker ran what.
        self.triage.restore(dict(task.known))
        ledger = self.session.ledger
        before = ledger.breakdown()
        ledger.fresh = True  # the trace's first replay is its fuzzed run (traces/timing.py)
        from kvfuzz.traces.errors import ConfigRefused

        try:
            with ledger.span(TRIAGE):
                triaged = self.triage(task.trace)
        except ConfigRefused as e:
            return Result(task.index, self.name, refused=e.reason, seconds=time.monotonic() - t0)
        checked = triaged.checked
        spent = ledger.breakdown().minus(before)
        buckets = sorted(trace_signature(checked.histories, task.trace))
        files = {}
        for p in self.scratch.rglob("*"):
            if p.is_file():
                files[str(p.relative_to(self.scratch))] = p.read_text()
                p.unlink()
        return Result(task.index, self.name, finding=checked.finding, buckets=buckets, memberships=triaged.buckets,
                      seconds=time.monotonic() - t0, files=files, time=spent, cases=triaged.cases)

    def gate(self, planned, runs: int, strict: bool, engine_args: list[str]) -> tuple:
        from kvfuzz.gate.gate import GateRunner

        runner = GateRunner(self.session, runs=runs, strict=strict, engine_args=engine_args, findings_dir=None)
        return runner.run(planned)

    def stop(self) -> None:
        self.session.close()
        self.session.close_references()
        if self.pooled:
            from kvfuzz.harness.inprocess import unshare_engines

            self.pooled = False
            unshare_engines()


def worker_resources(spec: WorkerSpec) -> dict[str, int]:
    """What one worker asks Ray for: a GPU on CUDA, its CPU share on CPU; with a reference
    engine, as much again for its child (a GPU of its own: two engines on one device take turns
    on it; one CPU on CPU)."""
    if spec.device == "cuda":
        return {"num_gpus": 1 + spec.reference_engines, "num_cpus": 1 + spec.reference_engines}
    return {"num_cpus": spec.cpus}


def describe_resources(spec: WorkerSpec) -> str:
    """``worker_resources`` in words, for the message of a worker Ray cannot place."""
    names = {"num_gpus": "GPU(s)", "num_cpus": "CPU(s)"}
    return " and ".join(f"{n} {names[what]}" for what, n in worker_resources(spec).items())


def ray_worker_class(ray, spec: WorkerSpec):
    """``WorkerCore`` as a Ray actor class with ``worker_resources``. max_restarts=0: Ray never
    silently brings back a worker whose engine state is unknown; the driver re-queues its trace
    and starts a fresh one."""
    return ray.remote(**worker_resources(spec), max_restarts=0)(WorkerCore)


def worker_died_finding(trace: Trace, arms: dict[str, list[str]] | None, deaths: list[dict], *,
                        engine: str = "inprocess", device: str = "cpu") -> Finding:
    """An engine-crash finding for a trace that killed its worker process every time it ran
    (no engine survived to describe itself: the environment is the trace's). Here, not in
    fuzzer/distributed.py: the fuzzer does not import the harness or the oracle."""
    import datetime as _dt

    from kvfuzz.harness.environment import describe
    from kvfuzz.oracle.check import ENGINE
    from kvfuzz.traces import CrashInfo, Divergence, WorkerDeath

    detail = f"the worker process died while running this trace ({len(deaths)} times): {deaths[-1]['detail']}"
    arm = next(iter(arms or {"default": []}))
    div = Divergence(request_id=ENGINE, class_="engine-crash", arm=arm, runs_diverged=len(deaths), runs=len(deaths),
                     detail=detail)
    env = describe(engine=engine, config=trace.engine, device=device, model_hash=None)
    f = Finding(trace=trace, environment=env, runs=[], divergences=[div], verdicts=[div],
                arms=arms or {arm: list(trace.engine.toggles)},
                created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat())
    f.crash = CrashInfo(kind="worker-died", detail=detail,
                        deaths=[WorkerDeath(worker=str(d["worker"]), detail=str(d["detail"])) for d in deaths])
    f.id = f.compute_id()
    return f


class RayExecutor:
    """The driver's view of the Ray workers (fuzzer/distributed.py ``Executor``)."""

    def __init__(self, spec: WorkerSpec, workers: int, *, status=lambda _m: None):
        import ray

        self.ray = ray
        self.spec = spec
        self.n = workers
        self.cls = ray_worker_class(ray, spec)
        self.status = status
        self.actors: dict[str, Any] = {}
        self.ready_workers: set[str] = set()
        self.busy_refs: dict[Any, tuple[str, int]] = {}
        self.starting: dict[Any, str] = {}
        self.started = 0
        self.replacements_left = MAX_REPLACEMENTS_FACTOR * workers
        self.config = None
        self.profile = None
        self.info: dict[str, dict] = {}
        RayExecutor.created += 1
        self.prefix = f"kvfuzz-{os.getpid()}-{RayExecutor.created}"
        self.store = None
        store = spec.settings.session.store
        if store is not None and store.out is not None:
            # One reference store for every worker, on the driver's node: it writes OUT/references.
            import dataclasses

            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from kvfuzz.harness.refstore import StoreService

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            name = f"{self.prefix}-store"
            self.store = ray.remote(num_cpus=0, max_restarts=0)(StoreService).options(
                name=name, namespace=NAMESPACE, scheduling_strategy=here).remote(str(store.out))
            self.spec = dataclasses.replace(spec, store_actor=name)

    created = 0

    def crash_finding(self, trace: Trace, arms: dict[str, list[str]] | None, deaths: list[dict]) -> Finding:
        return worker_died_finding(trace, arms, deaths, engine=self.spec.settings.session.kind, device=self.spec.device)

    def actor_name(self, worker: str) -> str:
        return f"{self.prefix}-{worker}"

    def _new(self) -> str:
        self.started += 1
        name = f"w{self.started}"
        self.actors[name] = self.cls.options(name=self.actor_name(name), namespace=NAMESPACE).remote(self.spec, name)
        return name

    def _get(self, refs, timeout: float):
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise InfraError(f"Ray workers did not start within {timeout:.0f} s (does the cluster have "
                             f"{describe_resources(self.spec)} free per worker? resources: "
                             f"{self.ray.cluster_resources()})") from None
        except self.ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        except self.ray.exceptions.RayActorError as e:
            raise InfraError(f"a Ray worker died while starting: {str(e).splitlines()[0]}") from None

    def start(self, config, *, calibrate: bool, profile_file: str | None = None) -> list[dict]:
        """Start every worker's engine; the first settles the noise bounds (calibrating if asked)
        and the others reuse its profile, so the workers judge alike and calibrate once."""
        self.config = config
        names = [self._new() for _ in range(self.n)]
        first, rest = names[0], names[1:]
        self.status(f"starting {self.n} Ray worker(s)")
        head = self.actors[first].start.remote(config, None, calibrate, profile_file)
        # The others load vLLM meanwhile (their engine starts when the profile is known).
        warm = [self.actors[n].ready.remote() for n in rest]
        info = self._get(head, WORKER_START_TIMEOUT_S)
        self.profile = info["profile"]
        self._get(warm, WORKER_START_TIMEOUT_S)
        infos = [info] + self._get([self.actors[n].start.remote(config, self.profile) for n in rest],
                                   WORKER_START_TIMEOUT_S)
        for n, i in zip(names, infos):
            self.info[n] = i
        self.ready_workers.update(names)
        return infos

    def start_lazy(self) -> list[dict]:
        """Start the workers without an engine (each starts the one its first job needs)."""
        names = [self._new() for _ in range(self.n)]
        self.status(f"starting {self.n} Ray worker(s)")
        infos = self._get([self.actors[n].ready.remote() for n in names], WORKER_START_TIMEOUT_S)
        self.info.update(zip(names, infos))
        self.ready_workers.update(names)
        return infos

    def map(self, method: str, items: list, *args, on_result=lambda k, v: None) -> list:
        """``worker.method(item, *args)`` for every item, spread over the workers; an item whose
        worker died is run again on another. Results in item order."""
        from collections import deque

        from kvfuzz.fuzzer.distributed import Lost

        queue = deque(range(len(items)))
        results: list = [None] * len(items)
        running = 0
        while queue or running:
            for w in self.idle():
                if not queue:
                    break
                k = queue.popleft()
                self.busy_refs[getattr(self.actors[w], method).remote(items[k], *args)] = (w, k)
                running += 1
            if not running and not self.alive():
                raise InfraError("no Ray worker is left alive (every worker died and none could be replaced)")
            for k, v in self.wait_indexed(5.0):
                running -= 1
                if isinstance(v, Lost):
                    queue.appendleft(k)
                    continue
                results[k] = v
                on_result(k, v)
        return results

    # -- Executor ------------------------------------------------------------------------------
    def idle(self) -> list[str]:
        busy = {w for w, _ in self.busy_refs.values()}
        return sorted(w for w in self.ready_workers if w not in busy)

    def busy(self) -> int:
        return len(self.busy_refs)

    def alive(self) -> bool:
        return bool(self.ready_workers or self.starting)

    def submit(self, worker: str, task) -> None:
        self.busy_refs[self.actors[worker].run.remote(task)] = (worker, task.index)

    def wait(self, timeout_s: float | None) -> list:
        return [v for _i, v in self.wait_indexed(timeout_s)]

    def wait_indexed(self, timeout_s: float | None) -> list[tuple[int, Any]]:
        """Finished calls as (index, value); a call whose worker died comes back as ``Lost``."""
        from kvfuzz.fuzzer.distributed import Lost

        refs = list(self.busy_refs) + list(self.starting)
        if not refs:
            time.sleep(min(timeout_s or 0.1, 0.1))
            return []
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:  # drain everything else that is done too (one driver pass per batch)
            more, _ = self.ray.wait([r for r in refs if r not in ready], num_returns=len(refs) - len(ready),
                                    timeout=0) if len(refs) > len(ready) else ([], None)
            ready += more
        events: list = []
        for ref in ready:
            if ref in self.starting:
                self._started(ref)
                continue
            worker, index = self.busy_refs.pop(ref)
            try:
                events.append((index, self.ray.get(ref)))
            except self.ray.exceptions.RayActorError as e:
                # The actor (or its node) is gone: not the trace's verdict. Re-queue, replace.
                self._died(worker)
                events.append((index, Lost(index, worker, _first_line(e))))
            except self.ray.exceptions.RayTaskError as e:
                raise _cause(e) from None
        return events

    def _died(self, worker: str) -> None:
        self.ready_workers.discard(worker)
        self.actors.pop(worker, None)
        if self.replacements_left <= 0:
            return
        self.replacements_left -= 1
        name = self._new()
        self.status(f"worker {worker} died: starting {name}")
        if self.config is None:  # a gate's workers start their engines on their first case
            self.starting[self.actors[name].ready.remote()] = name
        else:
            self.starting[self.actors[name].start.remote(self.config, self.profile)] = name

    def _started(self, ref) -> None:
        name = self.starting.pop(ref)
        try:
            self.info[name] = self.ray.get(ref)
            self.ready_workers.add(name)
        except self.ray.exceptions.RayActorError:
            self.actors.pop(name, None)
        except self.ray.exceptions.RayTaskError as e:
            raise _cause(e) from None

    def kill(self, worker: str) -> None:
        """Kill a worker actor at once (tests, and the last step of ``shutdown``)."""
        self.ray.kill(self.actors[worker], no_restart=True)

    def shutdown(self, grace_s: float = 20.0) -> None:
        """Close every engine (a managed server is stopped by its worker), then kill the actors:
        nothing is left running on the cluster. Busy workers cannot close until their trace
        ends, so after ``grace_s`` they are killed (an in-process engine dies with its actor; a
        server is stopped by the worker's watchdog)."""
        idle = set(self.idle())
        refs = [self.actors[w].stop.remote() for w in idle if w in self.actors]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for w in list(self.actors):
            try:
                self.ray.kill(self.actors[w], no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors.clear()
        self.ready_workers.clear()
        if self.store is not None:
            try:
                self.ray.kill(self.store, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            self.store = None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _cause(e: Exception) -> KvfuzzError:
    """A worker's exception as the driver's error: kvfuzz errors keep their exit code."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, KvfuzzError):
        return cause
    what = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else _first_line(e)
    return InfraError(f"a Ray worker failed: {what}")


def local_cpus(workers: int, cpus: int) -> float:
    """CPUs of a local Ray instance for ``workers`` of ``cpus`` each (``WorkerSpec.cpus``): every
    worker fits, even when that oversubscribes the machine (each engine is then slower, not
    absent; docs/scale.md)."""
    return float(max(os.cpu_count() or 1, workers * cpus))


__all__ = ["RayExecutor", "WorkerCore", "WorkerSpec", "connect", "local_cpus", "ray_available", "worker_died_finding",
           "worker_env", "worker_resources"]
