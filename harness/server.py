"""A vLLM OpenAI server that kvfuzz starts, watches, restarts and stops itself.

The command line comes from the trace's ``EngineConfig`` through the same mapping as the
in-process engine (harness/vllm_args.py); the process lifecycle is harness/process.py.
Toggles reach all of the server's processes through the ``KVFUZZ_TOGGLES`` variable read by
the kvfuzz vLLM plugin, so an arm with other toggles needs another server (a small pool keeps
recent ones alive); so does another engine configuration.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfuzz.traces import EngineConfig, Environment, History, RequestRecord, SendEvent, Trace, expand
from kvfuzz.traces.calibration import NoiseKey
from kvfuzz.traces.errors import BadInput, EngineDied, EngineHang, InfraError, Unreachable
from kvfuzz.traces.history import StopAtFlip, TopLogprobs
from kvfuzz.traces.trace import Binding

from .base import EngineKind, reference_config
from .http import control
from .http.engine import HttpEngineBase
from .http.replay import replay_trace
from .http.wire import HttpTarget
from .process import ManagedServer, free_port, port_free
from .compat import engine_arg_names
from .vllm_args import HOST, LOGPROBS_MODE, server_command, server_env, vllm_launcher

log = logging.getLogger("kvfuzz.server")

DEFAULT_START_TIMEOUT_S = 600.0
# After a failed or timed-out request: how long /health may stay silent before the server
# counts as hung (it is then killed and restarted by a campaign; docs/reliability.md).
HEALTH_GRACE_S = 10.0
WARM_UP_TIMEOUT_S = 300.0
# Default niceness of a managed CPU server (see ServerOptions.nice).
SERVER_NICE = 10


@dataclass
class ServerOptions:
    """How to run the server, beyond what the trace's engine configuration says."""

    device: str = "cpu"
    python: str = sys.executable
    # Raw extra command-line flags appended as given (e.g. ["--max-logprobs", "5"]).
    extra_flags: list[str] = field(default_factory=list)
    # Protects the managed server's /v1 routes; passed by environment, never on the command line.
    api_key: str | None = field(default=None, repr=False)
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    request_timeout_s: float = 300.0
    # Servers kept alive at once, one per toggle set (None: 2 on CPU — an idle server costs
    # memory, not CPU, and saves a restart per arm switch; 1 on GPU, where each would claim
    # its share of GPU memory).
    max_servers: int | None = None
    # Directory for server logs (one file per server start).
    log_dir: Path = Path("kvfuzz-out")
    # Fixed port on 127.0.0.1 (None: a free one picked per start). With a fixed port only one
    # server runs at a time.
    port: int | None = None
    # CPU niceness of the server's process tree (None: SERVER_NICE on CPU, 0 on GPU). When server
    # and client share few cores the client must still send at its planned instants; what
    # keeps it on time is the client's real-time send loop (harness/priority.py) — niceness
    # alone was measured not to be enough — but a nicer server also leaves the client more CPU
    # when the real-time policy is unavailable, and costs nothing while the client sleeps.
    nice: int | None = None

    def server_nice(self) -> int:
        if self.nice is not None:
            return self.nice
        return SERVER_NICE if self.device == "cpu" else 0


class ServerEngine(HttpEngineBase):
    """The Engine protocol over a vLLM server that kvfuzz manages."""

    kind: EngineKind = "server"

    def __init__(self, config: EngineConfig, *, options: ServerOptions | None = None):
        self.config = config
        self.options = options or ServerOptions()
        self.device = self.options.device
        self.request_timeout_s = self.options.request_timeout_s
        # The current server, its target and toggles; idle ones wait in the pool (LRU order).
        self.server: ManagedServer | None = None
        self.target: HttpTarget | None = None
        self.toggles: list[str] = list(config.toggles)
        self._pool: dict[tuple[str, ...], tuple[ManagedServer, HttpTarget]] = {}
        self.max_servers = self.options.max_servers or (2 if self.options.device == "cpu" else 1)
        if self.options.port is not None:
            self.max_servers = 1
        self.starts = 0
        self.start_seconds: list[float] = []
        self._model_path: str | None = None
        self._adapter_paths: dict[str, str] = {}
        self._model_hash: str | None = None
        self._reference: ServerEngine | None = None  # the reference's server, where it differs
        self._cmd: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def _resolve(self) -> None:
        from .embedded import resolve_model

        r = resolve_model(self.config)
        self._model_path, self._model_hash, self._adapter_paths = r.model_path, r.model_hash, dict(r.adapter_paths)

    def command(self, port: int) -> list[str]:
        assert self._model_path is not None
        flags = list(self.options.extra_flags)
        if self.options.python == sys.executable and LOGPROBS_MODE[0] in (engine_arg_names() or ()):
            # The logprobs the oracle reads, as in-process (a server of another environment's
            # release is not asked: its flags are not known here).
            flags = ["--logprobs-mode", LOGPROBS_MODE[1], *flags]
        return server_command(self.config, model_path=self._model_path, adapter_paths=self._adapter_paths,
                              port=port, device=self.options.device,
                              launcher=vllm_launcher(self.options.python), extra_flags=flags)

    def start(self) -> "ServerEngine":
        if self.server is not None and self.server.alive():
            return self
        self._switch(self.toggles)
        return self

    def _switch(self, toggles: list[str]) -> None:
        """Make the server for ``toggles`` current: reuse a live one from the pool, else start
        one (stopping the least recently used if the pool is full)."""
        key = tuple(sorted(toggles))
        if key in self._pool:
            srv, target = self._pool.pop(key)
            self._pool[key] = (srv, target)  # most recently used last
            self.server, self.target, self.toggles = srv, target, list(toggles)
            return
        while self._pool and len(self._pool) >= self.max_servers:
            lru = next(iter(self._pool))
            old, _ = self._pool.pop(lru)
            old.stop()
        self.server = self.target = None
        self.toggles = list(toggles)
        self._start_one()
        assert self.server is not None and self.target is not None
        self._pool[key] = (self.server, self.target)

    def _start_one(self) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise InfraError("vLLM is not installed; install kvfuzz[cpu] or kvfuzz[gpu]")
        if self._model_path is None:
            self._resolve()
        model_path = self._model_path
        assert model_path is not None  # _resolve() sets it
        if self.toggles:
            # The server runs this interpreter's vLLM: a toggle that cannot apply to it is refused
            # here (exit 2, naming toggle and release) rather than failing inside the server's
            # plugin. Installed patches are inert in this process until activated.
            from . import toggles as toggle_registry

            toggle_registry.install(self.toggles)
        port = self.options.port if self.options.port is not None else free_port()
        if self.options.port is not None and not port_free(port):
            raise BadInput(f"port {port} is already in use on {HOST}", field="--port")
        self._cmd = self.command(port)
        self.starts += 1
        log_dir = Path(self.options.log_dir)
        n = 1  # a fresh file per start, also across engines sharing the directory
        while (log_dir / f"server-{n}.log").exists():
            n += 1
        log_path = log_dir / f"server-{n}.log"
        env = server_env(os.environ, toggles=self.toggles, api_key=self.options.api_key,
                         runtime_lora=self.config.lora.enabled)
        self.server = ManagedServer(self._cmd, env, log_path, port, nice=self.options.server_nice())
        log.info("starting vLLM server on port %d (toggles %s, log %s)", port, self.toggles, log_path)
        try:
            self.server.start(self.options.start_timeout_s)
            self.start_seconds.append(self.server.start_seconds or 0.0)
            self.target = HttpTarget(self.server.base_url, self.config.model, api_key=self.options.api_key)
            self._warm_up()
            if control.reset_prefix_cache(self.target) is None:
                raise InfraError(f"the managed server has no /reset_prefix_cache (dev mode); log: {log_path}")
        except BaseException as e:
            self.server.stop()
            if isinstance(e, InfraError) and self.server.start_seconds is None:
                # It never came up: an engine setting this release lacks is named (exit 2).
                from .compat import check_engine_args
                from .vllm_args import engine_args

                check_engine_args(engine_args(self.config, model_path, device=self.options.device))
            raise

    def _warm_up(self) -> None:
        """One tiny request on the base model and on each adapter, one at a time: the first
        forward pass (and an adapter's first load) takes seconds on CPU, which would
        otherwise land in the first run and skew its timing."""
        from kvfuzz.traces import At, TokenPrompt

        assert self.target is not None and self.server is not None
        events = [SendEvent(request_id=f"warm-{i}", at=At(offset_ms=0), adapter=a, max_tokens=2,
                            prompt=TokenPrompt(token_ids=[16, 17, 18, 19]), stream=False)
                  for i, a in enumerate([None, *sorted(self._adapter_paths)])]
        for ev in events:
            one = Trace(engine=self.config.model_copy(update={"toggles": []}), events=[ev])
            # The first forward pass is slow on a busy CPU: the warm-up is not held to the
            # (possibly short) per-request deadline of the runs.
            hist, errors = replay_trace(self.target, one, arm="warm-up",
                                           timeout_s=max(self.request_timeout_s, WARM_UP_TIMEOUT_S))
            rec = hist.requests[ev.request_id]
            if errors or rec.error:
                if not self.server.alive():
                    raise self._death("during warm-up")
                raise InfraError(f"vLLM server warm-up request failed: {rec.error or errors[0]} "
                                 f"(log: {self.server.log_path})")

    def reference_engine(self) -> "ServerEngine":
        config = reference_config(self.config)
        if config is self.config:
            return self
        if self._reference is None:
            self._reference = ServerEngine(config, options=self.options).start()
        return self._reference

    def close(self) -> None:
        twin, self._reference = getattr(self, "_reference", None), None
        if twin is not None:
            twin.close()
        servers = [srv for srv, _ in self._pool.values()]
        if self.server is not None and self.server not in servers:
            servers.append(self.server)
        for srv in servers:
            srv.stop()
        self._pool.clear()
        self.server = None
        self.target = None
        self._drop_adapter_workdir()

    def __enter__(self) -> "ServerEngine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log_path(self) -> Path | None:
        return self.server.log_path if self.server else None

    def compatible(self, config: EngineConfig) -> bool:
        return config.key() == self.config.key()

    # -- runs ----------------------------------------------------------------------------------
    def _ensure(self, toggles: list[str]) -> None:
        if self.server is None or sorted(toggles) != sorted(self.toggles):
            self._switch(toggles)
        assert self.server is not None
        if not self.server.alive():
            raise self._death("before the run")

    def recover(self) -> bool:
        """Kill the current server (SIGKILL to its process group, at once: a hung server would
        sit out a graceful stop) and forget it; the next run starts a fresh one. Servers for
        other toggle sets stay in the pool. What a campaign does after a server died or hung."""
        srv = self.server
        if srv is not None:
            srv.kill()
            for key, (s, _) in list(self._pool.items()):
                if s is srv:
                    del self._pool[key]
        self.server = None
        self.target = None
        return True

    def log_tail(self, n: int = 40) -> list[str]:
        return self.server.log_tail(n) if self.server is not None else []

    def _death(self, when: str) -> EngineDied:
        assert self.server is not None
        why = self.server.died() or "stopped answering"
        detail = self.server.last_error()
        return EngineDied(f"vLLM server (pid {self.server.pid}) died {when}: {why}"
                          + (f"; last log line: {detail}" if detail else "") + f" (log: {self.server.log_path})")

    def _clean_slate(self) -> None:
        """Idle server, its initial adapter set (the names a run's lifecycle events changed put
        back; harness/http/engine.py), empty prefix cache. (Block order and stale KV cannot be
        reset over HTTP: server runs are not step-exact like in-process ones.)"""
        assert self.target is not None and self.server is not None
        try:
            if not control.wait_idle(self.target):
                raise EngineHang(f"vLLM server still busy 30 s after a run (log: {self.server.log_path})")
            self._restore_adapters()
            if not control.reset_prefix_cache(self.target, reset_external=self.config.kv_connector is not None):
                raise InfraError(f"vLLM server refused to reset its prefix cache (log: {self.server.log_path})")
        except InfraError as e:
            if not self.server.alive():
                raise self._death("between runs") from None
            if isinstance(e, (EngineHang, Unreachable)):
                raise EngineHang(f"vLLM server (pid {self.server.pid}) hang between runs: {e}") from None
            raise

    def replay(self, trace: Trace, *, arm: str = "default", run_index: int = 0,
               toggles: Iterable[str] | None = None, until: Iterable[str] = (),
               settled: StopAtFlip | None = None) -> History:
        # ``until``, ``settled``: a wall-clock server runs the whole trace.
        if not self.compatible(trace.engine):
            raise BadInput("trace engine configuration differs from the running server's", field="engine")
        names = list(trace.engine.toggles if toggles is None else toggles)
        self._ensure(names)
        self._clean_slate()
        self._require_resets(trace)
        book = self._adapter_book(trace) if trace.engine.lora.enabled else None
        if book is not None:
            self._bind_working_copies(book, trace)
        hist, errors = self._http_replay(trace, arm=arm, run_index=run_index, toggles=names, cache_salt=None,
                                         book=book)
        self._check_alive(hist, errors, f"during run {run_index + 1} of trace {trace.trace_id()} (arm {arm})")
        return hist

    def _check_alive(self, hist: History, errors: list[str], when: str) -> None:
        """After failed connections or server errors, tell a dead or hung server (infrastructure,
        exit 3) from a live one that failed some requests (recorded, judged by the oracle)."""
        assert self.server is not None and self.target is not None
        suspicious = errors or hist.crashed or any((r.http_status or 0) >= 500 for r in hist.requests.values())
        if not suspicious:
            return
        deadline = time.monotonic() + HEALTH_GRACE_S
        while time.monotonic() < deadline:
            if not self.server.alive():
                err = self._death(when)
                err.history = hist
                raise err
            if control.health(self.target.base_url, timeout=2.0):
                return
            time.sleep(0.2)
        raise EngineHang(f"vLLM server (pid {self.server.pid}) hang: stopped answering /health {when} "
                         f"(log: {self.server.log_path})", history=hist)

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None,
                  binding: Binding | None = None) -> RequestRecord:
        # Vanilla, on purpose: a lone request needs no fix today (the CPU LoRA bug needs a mixed
        # batch), and the current server then serves references without a restart.
        self._ensure([])
        self._clean_slate()
        # Weights other than what the adapter name serves: loaded under a temporary name.
        target, temp = self._reference_target(send, binding)
        try:
            one = self._alone_trace(self.config, send, max_tokens, binding)
            hist, errors = self._http_replay(one, arm="reference", run_index=0, toggles=[], cache_salt=None,
                                             target=target)
        finally:
            if self.server is not None and self.server.alive():
                self._drop_reference_adapter(temp)
        self._check_alive(hist, errors, f"during the reference run of {send.request_id!r}")
        rec = hist.requests[send.request_id]
        if hist.crashed or rec.error:
            raise InfraError(f"reference run for {send.request_id!r} failed: {rec.error or hist.crash_detail}")
        return self._note_reference_binding(rec, binding)

    def score(self, send: SendEvent, tokens: Sequence[int], *, binding: Binding | None = None) -> list[TopLogprobs]:
        """Teacher forcing on the vanilla server after a prefix-cache reset (see
        ``http.control.score``)."""
        self._ensure([])
        self._clean_slate()
        assert self.target is not None
        prompt = expand(send.prompt)
        scored = [int(x) for x in tokens][: max(0, self.config.max_model_len - len(prompt) - 1)]
        if not scored:
            return []
        target, temp = self._reference_target(send, binding)
        try:
            return control.score(target, prompt, scored, adapter=send.adapter, timeout_s=self.request_timeout_s)
        finally:
            if self.server is not None and self.server.alive():
                self._drop_reference_adapter(temp)

    def _server_name(self) -> str:
        if self.options.python == sys.executable:
            return super()._server_name()  # this environment's vLLM release
        return f"the managed server ({self.options.python})"

    def _embeds_model(self, trace: Trace, send: SendEvent) -> str | None:
        """The directory the server loaded (--model): its table is the one the server embeds with."""
        if self._model_path is None:
            self._resolve()
        return self._model_path

    def _initial_adapters(self) -> dict[str, str]:
        """What a managed server starts with: the configuration's adapters (--lora-modules)."""
        if self._model_path is None:
            self._resolve()
        return dict(self._adapter_paths)

    # -- environment ---------------------------------------------------------------------------
    def noise_key(self) -> NoiseKey:
        from .environment import noise_key

        if self._model_path is None:
            self._resolve()
        return noise_key(self.config, device=self.device, model_hash=self._model_hash)

    def environment(self) -> Environment:
        from .environment import describe

        flags: dict[str, Any] = {"command": _redacted(self._cmd), "reference_isolation": self.reference_isolation}
        if self.start_seconds:
            flags["server_start_seconds"] = [round(s, 1) for s in self.start_seconds]
        env = describe(engine="server", config=self.config, device=self.device, model_hash=self._model_hash,
                       flags={**self.config.model_dump(mode="json", exclude={"toggles"}), "server": flags})
        return env


def _redacted(cmd: Sequence[str]) -> list[str]:
    """A command line for the record: any --api-key value replaced (extra_flags could carry one)."""
    out = list(cmd)
    for i, a in enumerate(out):
        if a == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif a.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out
