"""Fast tests of the server manager and the HTTP client's pure parts (no vLLM): the command
line for CPU and GPU, the server environment, process-group shutdown, /metrics parsing,
request bytes and response parsing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kvfuzz.harness import metrics as prom
from kvfuzz.harness.http import replay as http_replay
from kvfuzz.harness.http import wire
from kvfuzz.harness.process import ManagedServer, free_port
from kvfuzz.harness.vllm_args import args_to_flags, server_command, server_env
from kvfuzz.traces import At, EngineConfig, GenPrompt, LoraSettings, SendEvent, TokenPrompt, expand
from kvfuzz.traces.errors import InfraError

LAUNCHER = ("python", "-m", "vllm.entrypoints.openai.api_server")


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_cpu_command_from_engine_config():
    cfg = EngineConfig(kv_cache_bytes=24 * 2**20, enable_prefix_caching=False, max_num_seqs=8,
                       lora=LoraSettings(enabled=True, adapters={"b": "embedded:b", "a": "embedded:a"}, max_loras=2))
    cmd = server_command(cfg, model_path="/m/model", adapter_paths={"b": "/m/b", "a": "/m/a"}, port=8123,
                         launcher=LAUNCHER)
    assert cmd[:3] == list(LAUNCHER)
    assert _value(cmd, "--model") == "/m/model"
    assert _value(cmd, "--served-model-name") == "embedded:tiny-qwen2"
    assert _value(cmd, "--host") == "127.0.0.1" and _value(cmd, "--port") == "8123"
    assert _value(cmd, "--dtype") == "float32" and "--enforce-eager" in cmd
    assert _value(cmd, "--kv-cache-memory-bytes") == str(24 * 2**20)
    assert _value(cmd, "--block-size") == "32" and _value(cmd, "--max-model-len") == "16384"
    assert "--no-enable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd
    assert "--enable-chunked-prefill" in cmd
    assert _value(cmd, "--max-num-seqs") == "8" and _value(cmd, "--max-num-batched-tokens") == "2048"
    assert "--enable-lora" in cmd and _value(cmd, "--max-loras") == "2" and _value(cmd, "--max-lora-rank") == "8"
    i = cmd.index("--lora-modules")
    assert cmd[i + 1 : i + 3] == ["a=/m/a", "b=/m/b"]  # sorted: stable command lines
    # The model's generation_config.json must not change sampling defaults on the server only.
    assert _value(cmd, "--generation-config") == "vllm"
    # store_true-only flags have no --no- form: disable_log_stats=False must be omitted.
    assert not any("disable-log-stats" in a for a in cmd)
    assert "--attention-backend" not in cmd and "--tensor-parallel-size" not in cmd


def test_gpu_command_is_the_same_code_with_other_flags():
    cfg = EngineConfig(model="Qwen/Qwen2.5-0.5B-Instruct", dtype="bfloat16", kv_cache_bytes=None,
                       extra_args={"attention_backend": "FLASHINFER", "tensor_parallel_size": 2,
                                   "enforce_eager": False, "gpu_memory_utilization": 0.9})
    cmd = server_command(cfg, model_path="Qwen/Qwen2.5-0.5B-Instruct", adapter_paths={}, port=9000, device="cuda",
                         launcher=("/venv/bin/vllm", "serve"), extra_flags=["--max-logprobs", "5"])
    assert cmd[:3] == ["/venv/bin/vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct"]  # `vllm serve MODEL`
    assert "--model" not in cmd
    assert _value(cmd, "--served-model-name") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert _value(cmd, "--attention-backend") == "FLASHINFER"
    assert _value(cmd, "--tensor-parallel-size") == "2"
    assert _value(cmd, "--gpu-memory-utilization") == "0.9"
    assert _value(cmd, "--dtype") == "bfloat16"
    assert "--no-enforce-eager" in cmd and "--enforce-eager" not in cmd
    assert "--kv-cache-memory-bytes" not in cmd and "--enable-lora" not in cmd
    assert cmd[-2:] == ["--max-logprobs", "5"]
    # Same function, same mapping: only the flags differ from the CPU command.
    cpu = server_command(EngineConfig(), model_path="/m", adapter_paths={}, port=9000, launcher=LAUNCHER)
    shared = {"--served-model-name", "--host", "--port", "--block-size", "--max-model-len", "--seed"}
    assert shared <= set(cpu) and shared <= set(cmd)


def test_args_to_flags_encodings():
    flags = args_to_flags({"a_b": True, "c": False, "d": {"x": 1}, "e": [1, 2], "f": None, "model": "m"})
    assert flags == ["--a-b", "--no-c", "--d", '{"x": 1}', "--e", "1", "2"]


def test_server_env_strips_inprocess_settings_and_carries_toggles():
    base = {"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CONFIGURE_LOGGING": "0",
            "KVFUZZ_TOGGLES": "stale", "VLLM_PLUGINS": "other", "VLLM_API_KEY": "inherited"}
    env = server_env(base, toggles=["fix-lora-cpu-no-lora-tokens", "fault-lora-hash-namespace"], api_key="k3y")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "VLLM_CONFIGURE_LOGGING" not in env
    assert env["KVFUZZ_TOGGLES"] == "fix-lora-cpu-no-lora-tokens,fault-lora-hash-namespace"
    assert env["VLLM_PLUGINS"] == "other,kvfuzz_toggles"  # an allowlist must not block our plugin
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # for POST /reset_prefix_cache
    assert env["VLLM_API_KEY"] == "k3y" and env["PATH"] == "/bin"
    plain = server_env(base)
    assert "KVFUZZ_TOGGLES" not in plain and "VLLM_API_KEY" not in plain
    assert plain["VLLM_PLUGINS"] == "other"
    # The in-process harness sets VLLM_ENABLE_V1_MULTIPROCESSING=0 in os.environ: never passed on.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(os.environ)


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


FAKE_SERVER = textwrap.dedent("""
    import http.server, signal, subprocess, sys, time
    port = int(sys.argv[1])
    # A child that ignores SIGTERM, like a stuck engine process: only SIGKILL of the group ends it.
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_managed_server_start_health_and_group_kill(tmp_path):
    port = free_port()
    srv = ManagedServer([sys.executable, "-c", FAKE_SERVER, str(port)], dict(os.environ), tmp_path / "server-1.log", port)
    srv.start(timeout_s=30)
    pgid = srv.pid
    assert srv.alive() and (tmp_path / "server.pid").read_text().strip() == str(pgid)
    assert "fake server up" in (tmp_path / "server-1.log").read_text()
    t0 = time.monotonic()
    srv.stop(grace_s=1.0)  # SIGTERM is ignored by everyone: SIGKILL of the group must follow
    assert time.monotonic() - t0 < 15
    for _ in range(50):
        if not _group_alive(pgid):
            break
        time.sleep(0.1)
    assert not _group_alive(pgid), "a process of the server's group survived stop()"


def test_dying_reads_the_kernels_view_of_a_process():
    """A SIGKILLed process is dead from the kill on, though waitpid() reports it only once its
    last thread exited (over 10 s under CI load): a real zombie reads as killed, a live one as
    not dying, and a pending SIGKILL or a leader in do_exit() (no way to hold a real process
    there) as killed or exiting."""
    from kvfuzz.harness.process import dying, parse_dying

    live = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.05)  # not zombie.poll(): that would reap it
        assert dying(zombie.pid) == "killed by SIGKILL"
        assert dying(live.pid) is None
    finally:
        live.kill()
        live.wait()
        zombie.wait()
    assert dying(zombie.pid) is None  # reaped: no /proc entry, nothing to say
    status = "Name:\tpython3\nState:\tS (sleeping)\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n"
    stat = "77 (vllm (api)) S " + " ".join(["0"] * 49)
    assert parse_dying(status, stat) == "killed by SIGKILL"
    quiet = status.replace("0000000000000100", "0000000000000000")
    assert parse_dying(quiet, stat) is None
    exiting = stat.split(") S ")[0] + ") D 1 1 1 0 -1 4194308 " + " ".join(["0"] * 43)  # PF_EXITING, no code yet
    assert parse_dying(quiet, exiting) == "exiting"


def test_a_sigkilled_server_not_yet_reaped_is_reported_dead_not_hung(tmp_path, monkeypatch):
    """A server SIGKILLed mid-run may not be reaped by waitpid() for seconds, and a health check
    that fails meanwhile would read as a hang. The harness asks the kernel whether it is dying,
    and says died, with the signal."""
    from kvfuzz.harness import process
    from kvfuzz.harness.server import ServerEngine
    from kvfuzz.traces.errors import EngineDied
    from kvfuzz.traces.history import History

    port = free_port()  # nothing listens: /health fails, as after the kill
    srv = ManagedServer(["sleep", "60"], dict(os.environ), tmp_path / "server-1.log", port)
    srv.proc = subprocess.Popen(["sleep", "60"])
    killed = {srv.proc.pid}
    monkeypatch.setattr(process, "dying", lambda pid: "killed by SIGKILL" if pid in killed else None)
    eng = ServerEngine(EngineConfig())
    eng.server, eng.target = srv, wire.HttpTarget(f"http://127.0.0.1:{port}", "m")
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDied, match=r"died during run 1: killed by SIGKILL"):
            eng._check_alive(History(trace_id="t", engine="server"), ["r0: connection reset"], "during run 1")
        assert time.monotonic() - t0 < 5  # at once, not after the 10 s health grace
        assert not srv.alive() and srv.died() == "killed by SIGKILL"
    finally:
        srv.proc.kill()
        srv.proc.wait()


def test_server_that_exits_at_start_is_infra_error(tmp_path):
    port = free_port()
    script = "import sys; print('ValueError: bad flag --nope', flush=True); sys.exit(2)"
    srv = ManagedServer([sys.executable, "-c", script], dict(os.environ), tmp_path / "s.log", port)
    with pytest.raises(InfraError) as e:
        srv.start(timeout_s=30)
    msg = str(e.value)
    assert "would not start" in msg and "exit code 2" in msg and "bad flag --nope" in msg and "s.log" in msg


def test_server_start_timeout_kills_it(tmp_path):
    port = free_port()
    srv = ManagedServer([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ), tmp_path / "s.log", port)
    with pytest.raises(InfraError, match="did not answer /health within 1 s"):
        srv.start(timeout_s=1.0)
    assert srv.proc is None


def test_describe_exit_signal_names():
    from kvfuzz.harness.process import describe_exit

    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"


METRICS = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
python_gc_objects_collected_total{generation="0"} 14776.0
"""


def test_metrics_summary_and_delta():
    s = prom.summarize(METRICS)
    assert s["vllm:num_preemptions_total"] == 4.0  # summed over engines
    assert s["vllm:prefix_cache_hits_total"] == 128.0 and s["vllm:kv_cache_usage_perc"] == 0.25
    assert s["vllm:request_success_total{finished_reason=abort}"] == 4.0
    assert not any("bucket" in k or k.startswith("python") for k in s)
    assert prom.busy(s) == 3 and prom.busy({}) is None
    after = dict(s, **{"vllm:prefix_cache_hits_total": 256.0})
    assert prom.delta(s, after, "vllm:prefix_cache_hits_total") == 128.0
    assert prom.delta(s, {}, "vllm:prefix_cache_hits_total") is None


def test_completion_payload_and_request_bytes():
    send = SendEvent(request_id="r", at=At(offset_ms=5), prompt=GenPrompt(length=40, seed=3), adapter="a",
                     max_tokens=7, stream=True)
    body = wire.completion_payload(send, "a", stream=True, cache_salt="kvfuzz-run-x")
    assert body["prompt"] == expand(send.prompt) and body["model"] == "a" and body["max_tokens"] == 7
    assert body["temperature"] == 0.0 and body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert body["ignore_eos"] is True and body["stream"] is True and body["cache_salt"] == "kvfuzz-run-x"
    target = wire.HttpTarget("http://10.0.0.1:8000/prefix/", "m", api_key="s3cret")
    raw = target.raw_request("/v1/completions", b'{"a":1}', {"X-Request-Id": "q"})
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
    assert b"Host: 10.0.0.1:8000" in head and b"Connection: close" in head
    assert b"Authorization: Bearer s3cret" in head and b"Content-Length: 7" in head and payload == b'{"a":1}'
    assert "s3cret" not in repr(target)  # never in logs or reprs


def test_parse_choice_tokens_and_top2():
    choice = {"text": "x", "finish_reason": "length", "logprobs": {
        "tokens": ["token_id:176", "token_id:28"],
        "top_logprobs": [{"token_id:265": -2.9, "token_id:176": -1.29},
                         {"token_id:28": -2.01, "token_id:354": -2.33, "token_id:7": -5.0}]}}
    tokens, tops, finish = wire.parse_choice(choice)
    assert tokens == [176, 28] and finish == "length"
    assert tops == [[(176, -1.29), (265, -2.9)], [(28, -2.01), (354, -2.33)]]
    with pytest.raises(ValueError, match="token_id"):
        wire.parse_choice({"text": "a", "logprobs": {"tokens": ["hello"]}})
    with pytest.raises(ValueError, match="without token ids"):
        wire.parse_choice({"text": "a", "logprobs": None})
    assert wire.error_text(400, b'{"error": {"message": "max_tokens too large", "code": 400}}') == \
        "HTTP 400: max_tokens too large"


def test_relative_cancel_floor():
    assert http_replay.relative_floor_ms(At(after_tokens=2), 10.0) is None
    assert http_replay.relative_floor_ms(At(after_tokens=2, step=3), 10.0) == 30.0
    assert http_replay.relative_floor_ms(At(after_tokens=2, offset_ms=7.5), 10.0) == 7.5


def test_replay_against_nothing_reports_transport_errors():
    """No server on the port: every request fails with a connection error, none hangs."""
    port = free_port()
    from kvfuzz.traces import Trace

    t = Trace(engine=EngineConfig(), events=[
        SendEvent(request_id="a", at=At(offset_ms=0), prompt=TokenPrompt(token_ids=[20, 21]), max_tokens=2),
        SendEvent(request_id="b", at=At(offset_ms=600), prompt=TokenPrompt(token_ids=[20, 21]), max_tokens=2)])
    h, errors = http_replay.replay_trace(wire.HttpTarget(f"http://127.0.0.1:{port}", "m"), t, timeout_s=10)
    assert len(errors) == 2 and all("connection failed" in (r.error or "") for r in h.requests.values())
    assert h.metrics_before == {} and not h.crashed
    # Root may always raise itself; elsewhere either policy is possible, but one is recorded.
    assert h.client_priority == "fifo" if os.geteuid() == 0 else h.client_priority in ("fifo", "normal")


class _FakeServer:
    def __init__(self, n):
        self.n, self.stopped = n, False

    def alive(self):
        return not self.stopped

    def stop(self):
        self.stopped = True


def test_server_pool_keeps_one_server_per_toggle_set(monkeypatch):
    """Pure pool logic (no vLLM): switching arms reuses live servers, evicts the least
    recently used one beyond max_servers, and close() stops every server."""
    from kvfuzz.harness.server import ServerEngine, ServerOptions

    eng = ServerEngine(EngineConfig(), options=ServerOptions(max_servers=2))
    started = []

    def start_one():
        srv = _FakeServer(len(started))
        started.append((srv, list(eng.toggles)))
        eng.server, eng.target = srv, wire.HttpTarget(f"http://127.0.0.1:{9000 + srv.n}", "m")

    monkeypatch.setattr(eng, "_start_one", start_one)
    eng.start()
    eng._ensure(["x"])
    eng._ensure([])
    assert [t for _, t in started] == [[], ["x"]] and eng.server is started[0][0]
    eng._ensure(["y"])  # pool full: the least recently used ("x") goes
    assert [t for _, t in started] == [[], ["x"], ["y"]]
    assert started[1][0].stopped and not started[0][0].stopped
    assert sorted(eng._pool) == [(), ("y",)]
    eng.close()
    assert all(srv.stopped for srv, _ in started) and eng.server is None
    gpu = ServerEngine(EngineConfig(), options=ServerOptions(device="cuda"))
    assert gpu.max_servers == 1


def test_run_rejects_unknown_engine_kind():
    import subprocess

    p = subprocess.run([sys.executable, "-m", "kvfuzz", "run", "--engine", "nope", "--traces", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--engine: unknown engine 'nope'" in p.stderr


def test_redact_url_drops_credentials():
    assert wire.redact_url("http://u:pw@host:8000/v1") == "http://host:8000/v1"
    assert wire.redact_url("https://host/x") == "https://host/x"


def test_managed_server_runs_niced_and_its_children_inherit(tmp_path):
    """The server's process tree runs at the configured niceness, so the client's sends are
    not queued behind it; children spawned later (vLLM's EngineCore, workers) inherit it."""
    port = free_port()
    srv = ManagedServer([sys.executable, "-c", FAKE_SERVER, str(port)], dict(os.environ), tmp_path / "s.log", port,
                        nice=7)
    srv.start(timeout_s=30)
    try:
        assert os.getpriority(os.PRIO_PROCESS, srv.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
        kids = subprocess.run(["pgrep", "-P", str(srv.pid)], capture_output=True, text=True).stdout.split()
        assert kids and all(os.getpriority(os.PRIO_PROCESS, int(k)) == os.getpriority(os.PRIO_PROCESS, 0) + 7
                            for k in kids)
    finally:
        srv.stop(grace_s=1.0)


def test_server_nice_defaults_by_device():
    from kvfuzz.harness.server import SERVER_NICE, ServerOptions

    assert ServerOptions().server_nice() == SERVER_NICE > 0
    assert ServerOptions(device="cuda").server_nice() == 0
    assert ServerOptions(nice=3).server_nice() == 3


def test_send_priority_restores_policy_and_gc(monkeypatch):
    import gc

    from kvfuzz.harness import priority

    before = os.sched_getscheduler(0)
    with priority.send_priority() as got:
        assert not gc.isenabled()
        assert got == ("fifo" if os.sched_getscheduler(0) == os.SCHED_FIFO else "normal")
        if os.geteuid() == 0:  # root may always raise itself: the replay must get it
            assert got == "fifo"
    assert gc.isenabled() and os.sched_getscheduler(0) == before
    monkeypatch.setenv(priority.ENV, "0")
    with priority.send_priority() as got:
        assert got == "normal" and os.sched_getscheduler(0) == before
    assert gc.isenabled()


def test_send_priority_restores_after_an_exception():
    import gc

    from kvfuzz.harness import priority

    before = os.sched_getscheduler(0)
    with pytest.raises(RuntimeError):
        with priority.send_priority():
            raise RuntimeError("boom")
    assert gc.isenabled() and os.sched_getscheduler(0) == before
