"""Fast unit tests of the reliability logic: crash recovery bookkeeping (fake session), bounded
memo and coverage log, atomic writes, and the HTTP client's per-request deadline against a
socket that accepts and never answers (a hung server, as the kernel sees it)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvfuzz.fuzzer import default_engine
from kvfuzz.fuzzer.campaign import thin_log
from kvfuzz.harness.runner import ReferenceStore
from kvfuzz.driver.recovery import Recovering, crash_finding, redact
from kvfuzz.traces import At, Environment, GenPrompt, History, RequestRecord, SendEvent, Trace, atomic_write_text
from kvfuzz.traces.errors import BadInput, EngineDied, EngineHang, InfraError
from kvfuzz.traces.result import Checked, Recording


def _trace(n=1):
    return Trace(engine=default_engine(), events=[
        SendEvent(request_id=f"r{i}", at=At(step=0), prompt=GenPrompt(length=8 + i, seed=i), max_tokens=2)
        for i in range(n)])


class FakeEngine:
    kind = "server"
    config = default_engine()
    device = "cpu"

    def __init__(self):
        self.recovered = 0
        self.closed = 0

    def log_tail(self, n=40):
        return ["INFO starting", "ERROR worker died, key=SECRETKEY"]

    @property
    def log_path(self):
        return "/tmp/server-1.log"

    def environment(self):
        return Environment(kvfuzz_version="test", engine="server")

    def recover(self):
        self.recovered += 1
        return True

    def close(self):
        self.closed += 1


class FakeSession:
    def __init__(self, fail):
        self.engine = FakeEngine()
        self.fail = list(fail)

    def secrets(self):
        return ["SECRETKEY"]

    def engine_for(self, config):
        return self.engine

    def check(self, trace, **kw):
        if self.fail.pop(0):
            h = History(trace_id=trace.trace_id(), engine="server", arm="vanilla",
                        requests={"r0": RequestRecord(request_id="r0", prompt_len=8, max_tokens=2)})
            raise EngineDied("vLLM server (pid 1) died during run 1: killed by SIGKILL", history=h)
        env = Environment(kvfuzz_version="test", engine="server")
        return Checked(Recording(trace=trace, histories=[], references={}, environment=env), [], None)


def test_a_crash_becomes_a_finding_and_the_engine_recovers():
    s = FakeSession([True, False, True])
    guard = Recovering(s)
    f = guard.check(_trace(), arms={"vanilla": []}).finding
    assert f.worst_class() == "engine-crash" and f.divergences[0].request_id == "<engine>"
    assert f.runs[0].crashed and f.runs[0].requests["r0"].prompt_len == 8
    note = f.crash
    assert note is not None and note.kind == "died" and note.log == "/tmp/server-1.log"
    assert note.log_tail[-1] == "ERROR worker died, key=<redacted>"  # the API key never lands in a finding
    assert "SECRETKEY" not in f.model_dump_json()
    assert s.engine.recovered == 1
    assert guard.check(_trace()).finding is None
    guard.check(_trace(2))
    assert guard.crashes == 2 and guard.restarts == 2


def test_an_arm_that_crashes_in_a_re_run_restarts_the_engine():
    """Attribution's re-run of another arm can crash the engine (recorded in its history, as in a
    first run): the next trace must not run on it."""
    s = FakeSession([False])
    guard = Recovering(s)
    first = guard.check(_trace())
    env = Environment(kvfuzz_version="test", engine="server")
    ok = History(trace_id="t", engine="server", arm="clean", requests={})
    crashed = ok.model_copy(update={"arm": "without:x", "crashed": True})
    for new, restarts in (([ok], 0), ([ok, crashed], 1)):
        guard.rerun(first, lambda: Checked(Recording(trace=_trace(), histories=[*first.histories, *new],
                                                     references={}, environment=env), [], None))
        assert guard.restarts == restarts and s.engine.recovered == restarts


def test_consecutive_crashes_stop_the_campaign():
    guard = Recovering(FakeSession([True] * 5), max_consecutive=3)
    guard.check(_trace())
    guard.check(_trace())
    with pytest.raises(InfraError, match="3 traces in a row"):
        guard.check(_trace())


def test_a_hang_is_named_in_the_finding():
    e = EngineHang("vLLM server (pid 1) hang: stopped answering /health during run 1")
    f = crash_finding(_trace(), FakeEngine(), e, arms={"vanilla": []})
    assert f.crash.kind == "hang" and "hang" in f.divergences[0].detail
    assert redact(["a SECRET b"], ["SECRET"]) == ["a <redacted> b"]


def test_bad_input_is_not_swallowed_as_a_crash():
    class S(FakeSession):
        def check(self, trace, **kw):
            raise BadInput("bad", field="engine")

    with pytest.raises(BadInput):
        Recovering(S([])).check(_trace())


def test_reference_memo_is_bounded_lru():
    class E:
        config = default_engine()
        reference_toggles: list[str] = []
        calls = 0

        def reference_engine(self):
            return self

        def run_alone(self, send, binding=None):
            E.calls += 1
            return RequestRecord(request_id=send.request_id, prompt_len=send.prompt.length, max_tokens=send.max_tokens,
                                 token_ids=[1] * send.max_tokens)

    store = ReferenceStore(max_entries=3)
    sends = [SendEvent(request_id=f"r{i}", at=At(step=0), prompt=GenPrompt(length=8, seed=i), max_tokens=2)
             for i in range(5)]
    for s in sends:
        store.get(E(), s, None)
    assert len(store) == 3 and store.evicted == 2
    store.get(E(), sends[2], None)  # still memoised: a hit, and now the most recent
    assert store.hits == 1 and E.calls == 5
    store.get(E(), sends[0], None)  # evicted long ago: computed again
    assert E.calls == 6 and len(store) == 3
    store.get(E(), sends[2], None)
    assert store.hits == 2


def test_coverage_log_is_thinned_not_unbounded():
    log = []
    for i in range(10_000):
        log.append([i, i, i, 0])
        thin_log(log, limit=100)
    assert len(log) <= 100 and log[0][0] == 0 and log[-1][0] == 9999
    assert [r[0] for r in log] == sorted(r[0] for r in log)


def test_atomic_write_keeps_the_old_file_on_failure_and_fsyncs_the_directory(tmp_path, monkeypatch):
    p = tmp_path / "state.json"
    atomic_write_text(p, "old\n")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    atomic_write_text(p, "new\n")
    assert p.read_text() == "new\n"
    assert str(tmp_path) in synced and any(s.startswith(str(tmp_path / ".state.json.")) for s in synced)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(p, "half")
    assert p.read_text() == "new\n" and [x.name for x in tmp_path.iterdir()] == ["state.json"]


def test_corpus_and_campaign_state_use_the_atomic_writer():
    import inspect

    from kvfuzz.fuzzer import campaign, corpus

    src = inspect.getsource(corpus) + inspect.getsource(campaign)
    assert "write_text(" not in src.replace("atomic_write_text(", "")
    assert "save(entry" in inspect.getsource(corpus.Corpus.save)


def test_http_request_deadline_against_a_silent_server():
    """The kernel accepts the connection, nobody answers: the request ends as a hang after the
    per-request deadline, and the trace does not wait forever."""
    from kvfuzz.harness.http import replay as http_replay
    from kvfuzz.harness.http import wire

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c = srv.accept()[0]
            except OSError:
                continue
            conns.append(c)
            c.settimeout(5)
            try:
                if c.recv(4096).startswith(b"GET /metrics"):  # no metrics here; completions hang
                    c.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        target = wire.HttpTarget(f"http://127.0.0.1:{srv.getsockname()[1]}", "m")
        t0 = time.monotonic()
        hist, errors = http_replay.replay_trace(target, _trace(2), timeout_s=1.0, lead_ms=10)
        took = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
        for c in conns:
            c.close()
        srv.close()
    assert all(r.error and r.error.startswith("hang: no complete response within 1 s") for r in hist.requests.values())
    assert len(errors) == 2 and "hang" in errors[0]
    assert took < 10
