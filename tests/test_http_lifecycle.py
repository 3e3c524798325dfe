"""Adapter lifecycle events over HTTP (fast tier, no vLLM): the request bodies per event kind,
their order with the sends, the bindings recorded, the clean slate that restores a server's
adapters, references on rebound weights, cache-salt joining, and the one-line refusal of a
server without runtime adapter endpoints. A small fake of vLLM's OpenAI server models the
endpoints' semantics (vllm/entrypoints/openai/models/serving.py in 0.32); the real server is
tests/test_server.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from http_fakes import JsonHandler, serve

from kvfuzz.harness.embedded import adapter_hash
from kvfuzz.harness.http import replay as http_replay
from kvfuzz.harness.http import wire
from kvfuzz.harness.url import UrlEngine
from kvfuzz.harness.vllm_args import engine_args, server_command, server_env
from kvfuzz.traces import At, EngineConfig, GenPrompt, LoraSettings, SendEvent, Trace, save
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

BASE = "base-model"


class FakeVllm:
    """vLLM's serving semantics for adapters: a name loaded twice without ``load_inplace`` is
    400, unloading an unknown name 404, a completion on an unknown model 404; without runtime
    updating the two endpoints do not exist (FastAPI's 404). ``log`` keeps every call in the
    order the server handled it, with what a load found at its path (content hash)."""

    def __init__(self, adapters: dict[str, str], *, runtime: bool = True, reset: bool = True,
                 refuse: tuple[str, ...] = (), delay_s: float = 0.0):
        self.loras = {n: {"path": p, "inplace": False} for n, p in adapters.items()}
        self.runtime, self.reset, self.refuse, self.delay_s = runtime, reset, refuse, delay_s
        self.log: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class H(JsonHandler):

            def do_GET(self):
                if self.path == "/v1/models":
                    with fake.lock:
                        data = [{"id": BASE, "root": "/m"}] + [{"id": n, "root": v["path"], "parent": BASE}
                                                               for n, v in fake.loras.items()]
                    self._json(200, {"data": data})
                elif self.path == "/health":
                    self._json(200, {})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                path = self.path.split("?")[0]
                if path == "/reset_prefix_cache" and fake.reset:
                    self._json(200, {})
                elif path in (wire.LOAD_ADAPTER_PATH, wire.UNLOAD_ADAPTER_PATH) and fake.runtime:
                    code, obj = fake.adapter(path, body)
                    self._json(code, obj) if isinstance(obj, dict) else self._text(obj)
                elif path == "/v1/completions":
                    self.complete(body)
                else:
                    self._json(404, {"detail": "Not Found"})

            def _text(self, text):
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def complete(self, body):
                model = body["model"]
                with fake.lock:
                    lora = fake.loras.get(model)
                    fake.log.append({"call": "completion", "model": model, "salt": body.get("cache_salt"),
                                     "path": lora["path"] if lora else None, "prompt": body["prompt"]})
                    known = model == BASE or lora is not None
                if not known:
                    self._json(404, {"error": {"message": f"The model `{model}` does not exist.", "code": 404}})
                    return
                self._complete(body, fake.delay_s)

        self.httpd, self.url = serve(H)

    def adapter(self, path: str, body: dict):
        name, lpath = body.get("lora_name"), body.get("lora_path")
        if path == wire.LOAD_ADAPTER_PATH and (not name or not lpath):  # (kvfuzz's probe; not logged)
            return 400, {"error": {"message": "Both 'lora_name' and 'lora_path' must be provided.", "code": 400}}
        with self.lock:
            entry = {"call": "load" if path == wire.LOAD_ADAPTER_PATH else "unload", "name": name, "body": body}
            self.log.append(entry)
            if path == wire.UNLOAD_ADAPTER_PATH:
                if name not in self.loras:
                    return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}
                del self.loras[name]
                return 200, f"Success: LoRA adapter '{name}' removed successfully."
            if name in self.refuse:
                return 400, {"error": {"message": f"refused {name}", "code": 400}}
            if name in self.loras and not body.get("load_inplace"):
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.", "code": 400}}
            entry["hash"] = adapter_hash(lpath)  # what the server reads from the path now
            self.loras[name] = {"path": lpath, "inplace": bool(body.get("load_inplace"))}
            return 200, f"Success: LoRA adapter '{name}' added successfully."

    def calls(self, call: str) -> list[dict]:
        return [e for e in self.log if e["call"] == call]

    def close(self):
        self.httpd.shutdown()


def _adapter_dir(root: Path, name: str) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "name": name}))
    (d / "adapter_model.safetensors").write_bytes(name.encode() * 64)
    return str(d)


@pytest.fixture
def dirs(tmp_path):
    return {n: _adapter_dir(tmp_path, n) for n in ("a", "b", "a2", "b2", "x")}


def _send(rid, adapter, ms, **kw):
    return SendEvent(request_id=rid, adapter=adapter, at=At(offset_ms=ms), max_tokens=3,
                     prompt=GenPrompt(length=20, seed=hash(rid) % 1000), **kw)


def _lifecycle_trace(dirs) -> Trace:
    engine = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": dirs["a"], "b": dirs["b"]}))
    return Trace(engine=engine, events=[
        _send("s1", "a", 0),
        LoadAdapterEvent(name="x", source=dirs["x"], at=At(offset_ms=0)),
        _send("s2", "x", 0),  # same instant, planned after the load: waits for it
        ReloadAdapterEvent(name="a", source=dirs["a2"], at=At(offset_ms=30)),
        _send("s3", "a", 30),
        UnloadAdapterEvent(name="x", at=At(offset_ms=30)),  # after s2: waits for its answer
        ReloadAdapterEvent(name="b", source=dirs["b2"], same_path=True, at=At(offset_ms=60)),
        _send("s4", "b", 60),
    ])


def test_adapter_request_bodies_per_event_kind():
    assert wire.adapter_request("load-adapter", "x", "/p/x") == \
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p/x"})
    # A reload is vLLM's in-place load: same name (and adapter id), new path.
    assert wire.adapter_request("reload-adapter", "a", "/p/a2") == \
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p/a2", "load_inplace": True})
    assert wire.adapter_request("unload-adapter", "x") == ("/v1/unload_lora_adapter", {"lora_name": "x"})
    with pytest.raises(ValueError):
        wire.adapter_request("load-adapter", "x")
    with pytest.raises(ValueError):
        wire.adapter_request("send", "x", "/p")


def test_salts_join_isolation_and_tenant():
    iso = "kvfuzz-run-" + "0" * 24
    assert wire.combine_salts(None, None) is None
    assert wire.combine_salts(iso, None) == iso
    assert wire.combine_salts(None, "tenant-1") == "tenant-1"
    assert wire.combine_salts(iso, "tenant-1") == iso + ":tenant-1"
    # Tenants stay apart within a run, a reference's salt shares nothing with a run's.
    assert wire.combine_salts(iso, "t1") != wire.combine_salts(iso, "t2")
    assert wire.combine_salts(iso, "t1") != wire.combine_salts("kvfuzz-ref-" + "1" * 24, "t1")
    # What vLLM would refuse over HTTP (> 128 characters once joined, '/', '@') is hashed:
    # still one salt per tenant, and a valid one.
    for own in ("a/b", "x@y", "t" * 120, "t" * 256):
        got = wire.combine_salts(iso, own)
        assert len(got) <= wire.SALT_MAX and not set(got) & wire.SALT_FORBIDDEN
        assert got == wire.combine_salts(iso, own) and got.startswith(iso + ":~")
    assert wire.combine_salts(iso, "a/b") != wire.combine_salts(iso, "a/c")
    assert wire.combine_salts(None, "t" * 128) == "t" * 128
    send = SendEvent(request_id="r", at=At(offset_ms=0), prompt=GenPrompt(length=8), cache_salt="tenant-1")
    assert wire.completion_payload(send, "m", stream=False, cache_salt=iso)["cache_salt"] == iso + ":tenant-1"
    assert wire.completion_payload(send, "m", stream=False)["cache_salt"] == "tenant-1"


def test_server_env_and_flags_for_runtime_adapters():
    lora = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "embedded:a"}, max_cpu_loras=3))
    assert server_env({}, runtime_lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env({})
    assert engine_args(lora, "/m")["max_cpu_loras"] == 3
    assert "max_cpu_loras" not in engine_args(EngineConfig(lora=LoraSettings(enabled=True)), "/m")
    cmd = server_command(lora, model_path="/m", adapter_paths={"a": "/m/a"}, port=1,
                         launcher=("python", "-m", "vllm.entrypoints.openai.api_server"))
    assert cmd[cmd.index("--max-cpu-loras") + 1] == "3"


def test_lifecycle_replay_order_bindings_and_restore(dirs):
    fake = FakeVllm({"a": dirs["a"], "b": dirs["b"]}, delay_s=0.05)
    t = _lifecycle_trace(dirs)
    eng = UrlEngine(t.engine, fake.url)
    try:
        eng.start()
        assert eng.adapters == {"a": dirs["a"], "b": dirs["b"]}
        fake.log.clear()
        h = eng.replay(t)
        log = fake.log
        # Before the clock: b (reloaded in place by the trace) is served from a working copy
        # with b's bytes, loaded fresh (not in place).
        work_b = log[1]["body"]["lora_path"]
        assert [(e["call"], e["name"]) for e in log[:2]] == [("unload", "b"), ("load", "b")]
        assert work_b != dirs["b"] and log[1]["hash"] == adapter_hash(dirs["b"])
        assert "load_inplace" not in log[1]["body"]

        def at(pred):
            return next(k for k, e in enumerate(log) if pred(e))

        load_x = at(lambda e: e["call"] == "load" and e["name"] == "x")
        reload_a = at(lambda e: e["call"] == "load" and e["name"] == "a")
        unload_x = at(lambda e: e["call"] == "unload" and e["name"] == "x")
        reload_b = at(lambda e: e["call"] == "load" and e["name"] == "b" and e["body"].get("load_inplace"))
        comp = {e["model"] + ":" + str(e["path"]): k for k, e in enumerate(log) if e["call"] == "completion"}
        # Sends follow the lifecycle events planned before them; an unload waits for the
        # server's answer to the sends on its adapter planned before it.
        assert load_x < comp[f"x:{dirs['x']}"] < unload_x
        assert comp[f"a:{dirs['a']}"] < reload_a < comp[f"a:{dirs['a2']}"]
        assert reload_b < comp[f"b:{work_b}"]
        assert log[reload_a]["body"] == {"lora_name": "a", "lora_path": dirs["a2"], "load_inplace": True}
        # The same-path reload overwrote the working copy before asking the server to reload it.
        assert log[reload_b]["body"] == {"lora_name": "b", "lora_path": work_b, "load_inplace": True}
        assert log[reload_b]["hash"] == adapter_hash(dirs["b2"])

        life = {e.index: e for e in h.events if e.kind != "send"}
        assert [(life[i].kind, life[i].adapter) for i in sorted(life)] == [
            ("load-adapter", "x"), ("reload-adapter", "a"), ("unload-adapter", "x"), ("reload-adapter", "b")]
        assert all(e.error is None and e.actual_offset_ms >= e.planned_offset_ms for e in life.values())
        assert life[1].adapter_hash == adapter_hash(dirs["x"]) and life[3].adapter_hash == adapter_hash(dirs["a2"])
        assert life[5].adapter_hash is None and life[6].adapter_hash == adapter_hash(dirs["b2"])
        # Each request records the binding it was admitted with: the plan's.
        plan = t.bindings_at_admission()
        for rid, rec in h.requests.items():
            assert rec.error is None and rec.token_ids == [100, 101, 102], (rid, rec.error)
            assert rec.adapter_source == plan[rid].source
            assert rec.adapter_hash == adapter_hash(plan[rid].source), rid
        # History order: events by when they happened (each send after what it waited for).
        order = [(e.kind, e.request_id or e.adapter) for e in h.events]
        assert order.index(("load-adapter", "x")) < order.index(("send", "s2"))
        assert order.index(("send", "s1")) < order.index(("reload-adapter", "a")) < order.index(("send", "s3"))

        # Clean slate: x gone, a and b fresh from their original paths (not in place).
        fake.log.clear()
        eng._before_run()
        assert fake.loras == {"a": {"path": dirs["a"], "inplace": False}, "b": {"path": dirs["b"], "inplace": False}}
        assert eng._touched() == set()
        fake.log.clear()
        eng._before_run()
        assert [e["call"] for e in fake.log] == []  # nothing left to restore: no calls

        # A reference on weights the name does not serve now: a temporary adapter.
        fake.log.clear()
        ref = eng.run_alone(t.send("s3"), binding=plan["s3"])
        temp = "kvfuzz-ref-" + adapter_hash(dirs["a2"])
        assert [(e["call"], e.get("name") or e.get("model")) for e in fake.log] == [
            ("unload", temp), ("load", temp), ("completion", temp), ("unload", temp)]
        assert ref.adapter_source == dirs["a2"] and ref.adapter_hash == adapter_hash(dirs["a2"])
        assert set(fake.loras) == {"a", "b"}
        # ...and on the weights it does serve: the name itself, no adapter call.
        fake.log.clear()
        eng.run_alone(t.send("s1"), binding=plan["s1"])
        assert [e["call"] for e in fake.log] == ["completion"] and fake.log[0]["model"] == "a"
    finally:
        eng.close()  # removes the working copies
        fake.close()
    assert not Path(work_b).exists()


def test_refused_lifecycle_call_is_recorded(dirs):
    fake = FakeVllm({"a": dirs["a"]}, refuse=("x",))
    try:
        engine = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": dirs["a"]}))
        t = Trace(engine=engine, events=[LoadAdapterEvent(name="x", source=dirs["x"], at=At(offset_ms=0)),
                                         _send("s", "x", 5), UnloadAdapterEvent(name="x", at=At(offset_ms=10))])
        eng = UrlEngine(engine, fake.url).start()
        h = eng.replay(t)
        ev = {e.kind: e for e in h.events}
        assert ev["load-adapter"].error == "HTTP 400: refused x"
        assert ev["unload-adapter"].error.startswith("HTTP 404: The lora adapter 'x' cannot be found")
        assert h.requests["s"].error.startswith("HTTP 404") and h.requests["s"].adapter_hash == adapter_hash(dirs["x"])
    finally:
        fake.close()


def test_lifecycle_needs_the_book():
    t = Trace(engine=EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "/nowhere/a"})),
              events=[UnloadAdapterEvent(name="a", at=At(offset_ms=0))])
    with pytest.raises(ValueError, match="AdapterBook"):
        http_replay.replay_trace(wire.HttpTarget("http://127.0.0.1:9", "m"), t)


def test_tenant_salts_within_isolation_salts(dirs):
    fake = FakeVllm({}, reset=False)  # no /reset_prefix_cache: isolation by a salt per run
    try:
        t = Trace(engine=EngineConfig(), events=[
            SendEvent(request_id=f"r{i}", at=At(offset_ms=0), max_tokens=2, cache_salt=f"t{i % 2}",
                      prompt=GenPrompt(length=20, seed=i)) for i in range(3)])
        eng = UrlEngine(t.engine, fake.url).start()
        assert eng.reference_isolation == "cache_salt"
        fake.log.clear()
        eng.replay(t)
        salts = sorted(e["salt"] for e in fake.calls("completion"))
        run = salts[0].split(":")[0]
        assert run.startswith("kvfuzz-run-") and salts == [f"{run}:t0", f"{run}:t0", f"{run}:t1"]
        eng.run_alone(t.send("r1"))
        ref = fake.calls("completion")[-1]["salt"]
        assert ref.endswith(":t1") and ref.split(":")[0] not in (run, None)
    finally:
        fake.close()


def test_server_without_runtime_updating_refuses_lifecycle(dirs, tmp_path, kvfuzz_cli):
    fake = FakeVllm({"a": dirs["a"]}, runtime=False)
    try:
        t = _lifecycle_trace(dirs)
        eng = UrlEngine(t.engine, fake.url).start()
        with pytest.raises(BadInput) as e:
            eng.replay(t)
        msg = str(e.value)
        assert e.value.code == 2 and "\n" not in msg
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in msg and "HTTP 404" in msg
        assert fake.calls("completion") == []  # refused before any request
        # A trace without lifecycle events runs as before on the same server.
        plain = Trace(engine=t.engine, events=[_send("p", "a", 0)])
        assert eng.replay(plain).requests["p"].error is None
        # The CLI: exit 2, that one line.
        save(t, tmp_path / "t.json")
        p = kvfuzz_cli("replay", tmp_path / "t.json", "--base-url", fake.url, "--runs", "1", "--out", tmp_path / "o",
                       cwd=tmp_path)  # the adapter directories are allowed paths from there
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in lines[0], lines
    finally:
        fake.close()
