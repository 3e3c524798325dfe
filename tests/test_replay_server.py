"""`kvfuzz replay --engine server` as a user runs it: the CLI starts its own vLLM server,
replays one file, and then the server is killed in the middle of the second file's run:
exit 3, one clear line, the first file's result kept, no server process left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvfuzz.fuzzer import default_engine
from kvfuzz.traces import At, CancelEvent, GenPrompt, SendEvent, Trace, save

pytestmark = pytest.mark.server


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_managed_server_replay_then_server_dies_mid_trace(tmp_path):
    cfg = default_engine()
    first = tmp_path / "first.json"
    save(Trace(engine=cfg, events=[
        # r2 is long: under load tokens arrive in bursts, and a 12-token r2 could finish before
        # the cancel lands (then it is "ok", not "truncation").
        SendEvent(request_id=f"r{i}", at=At(offset_ms=3.0 * i), max_tokens=300 if i == 2 else 12,
                  prompt=GenPrompt(length=90, seed=i))
        for i in range(3)] + [CancelEvent(request_id="r2", at=At(after_tokens=3))]), first)
    second = tmp_path / "second.json"  # long enough to be mid-run when the server is killed
    save(Trace(engine=cfg, events=[
        SendEvent(request_id=f"long{i}", at=At(offset_ms=0), max_tokens=3000, prompt=GenPrompt(length=64, seed=i))
        for i in range(3)]), second)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kvfuzz", "replay", str(first), str(second), "--engine", "server",
                             "--runs", "1", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    deadline = time.monotonic() + 600
    while True:
        try:
            ln = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail("the replay of the second file never started:\n" + "".join(seen) + proc.stderr.read())
        seen.append(ln)
        if ln.startswith(f"replaying {second}"):
            break
    time.sleep(2.0)  # into the second file's run
    pid = int((out / "server.pid").read_text())
    os.kill(pid, signal.SIGKILL)  # the API server process dies
    rc = proc.wait(timeout=300)
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    stdout = "".join(seen) + "".join(iter(lambda: lines.get() if not lines.empty() else "", ""))
    assert rc == 3, stdout[-3000:] + stderr[-3000:]
    msg = stderr.strip().splitlines()
    assert len(msg) == 1 and "Traceback" not in stderr, stderr
    assert f"vLLM server (pid {pid}) died during run 1" in msg[0] and "killed by SIGKILL" in msg[0]
    assert str(out / "server-1.log") in msg[0]
    # The first file was replayed and reported before the server died.
    s1 = json.loads((out / "replays" / "first.replay.json").read_text())
    assert s1["engine"] == "server" and s1["reproduced"] is False
    assert {d["request_id"]: d["class"] for d in s1["verdicts"]} == {"r0": "ok", "r1": "ok", "r2": "truncation"}
    assert not (out / "replays" / "second.replay.json").exists()
    # Nothing of the server outlives kvfuzz (its EngineCore and worker were in its group).
    for _ in range(50):
        if not _group_alive(pid):
            break
        time.sleep(0.1)
    assert not _group_alive(pid)
