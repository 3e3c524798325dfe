"""Nothing lost: a real `kvfuzz run` (in-process engine) SIGKILLed right after it wrote a
finding, then `kvfuzz run --resume`. Every finding written before the kill is intact and valid,
and the resumed campaign ran exactly the traces an uninterrupted one runs (same seed sequence),
checked against the same campaign run uninterrupted on the test session's engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from traces import load_finding, load_trace

pytestmark = pytest.mark.engine

SEED, TRACES = 3, 5
ARGS = ["--lora", "--seed", str(SEED), "--runs", "1", "--no-minimize", "--no-controls", "--no-attribute"]


def _run(out, *extra, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvfuzz", "run", "--traces", str(TRACES), "--out", str(out), *ARGS,
                           *extra], capture_output=True, text=True, timeout=timeout)


def _by_index(out):
    """iteration index -> trace id, from what a campaign leaves on disk (findings, corpus)."""
    seen = {}
    for p in (out / "findings").glob("*.json"):
        f = load_finding(p)
        seen[f.notes["campaign"]["index"]] = f.trace.trace_id()
    for p in (out / "corpus").glob("*.json"):
        e = json.loads(p.read_text())
        seen[e["origin"]["index"]] = load_trace_dict(e["trace"])
    return seen


def load_trace_dict(d):
    from traces import parse_trace

    return parse_trace(d).trace_id()


def test_sigkill_then_resume_loses_nothing_and_keeps_the_sequence(tmp_path, session):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kvfuzz", "run", "--traces", str(TRACES), "--out", str(out), *ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not list((out / "findings").glob("*.json")):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no finding within 10 minutes"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    state = json.loads((out / "campaign.json").read_text())  # valid JSON: written atomically
    assert state["complete"] is False and state["traces"] < TRACES
    before = {p.name: load_finding(p) for p in (out / "findings").glob("*.json")}  # every one loads
    assert before and not list(out.rglob(".*.tmp"))  # no half-written file was left behind
    for p in (out / "corpus").glob("*.json"):
        json.loads(p.read_text())

    r = _run(out, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((out / "campaign.json").read_text())
    assert state["complete"] is True and state["traces"] == TRACES and state["next_index"] == TRACES
    after = {p.name: load_finding(p) for p in (out / "findings").glob("*.json")}
    for name, f in before.items():  # nothing reported before the kill is lost or changed
        assert name in after and after[name].trace == f.trace and after[name].divergences == f.divergences
    assert sorted(state["finding_files"]) == sorted(f"findings/{n}" for n in after)

    # The same campaign, uninterrupted, on the session's engine: same traces at every index.
    from fuzzer import CampaignOptions, default_engine, run_campaign
    from kvfuzz.arms import build_arms
    from kvfuzz.recovery import Recovering

    ref_out = tmp_path / "uninterrupted"
    arms = build_arms(device="cpu")
    guard = Recovering(session)
    seq = {}
    run_campaign(CampaignOptions(seed=SEED, budget_s=None, max_traces=TRACES, runs=1, out=ref_out,
                                 engine=default_engine(lora=True)),
                 lambda t: guard.check(t, runs=1, arms=arms, attribute=False),
                 lambda o, s: seq.__setitem__(o.index, o.trace.trace_id()))
    assert sorted(seq) == list(range(TRACES))
    resumed = _by_index(out)
    assert resumed and all(seq[i] == tid for i, tid in resumed.items())
    assert sorted(p.name for p in (ref_out / "findings").glob("*.json")) == sorted(after)
    assert sorted(p.name for p in (ref_out / "corpus").glob("*.json")) == \
        sorted(p.name for p in (out / "corpus").glob("*.json"))
