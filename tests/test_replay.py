"""`kvfuzz replay` on the in-process engine: a kvfuzz finding (with a fault arm) and a kvfuzz
trace in one call; per-request verdicts side by side with what the finding expected."""

from __future__ import annotations

import json

import pytest

from kvfuzz.fuzzer import default_engine
from kvfuzz.harness.toggles.builtin import LORA_NS
from kvfuzz.traces import At, Divergence, Environment, Finding, GenPrompt, SendEvent, Trace, save

pytestmark = pytest.mark.engine


def _alias_finding() -> Finding:
    # A on adapter a fills 4 blocks; B on adapter b later sends the same 128-token prefix. With
    # the LoRA namespace dropped from block hashes (fault arm), B reads A's KV.
    cfg = default_engine(lora=True)
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="A", at=At(step=0, offset_ms=0), adapter="a", max_tokens=4,
                  prompt=GenPrompt(length=140, prefix_group="shared", prefix_len=128, seed=1)),
        SendEvent(request_id="B", at=At(step=12, offset_ms=120), adapter="b", max_tokens=8,
                  prompt=GenPrompt(length=150, prefix_group="shared", prefix_len=128, seed=2)),
    ])
    f = Finding(trace=t, environment=Environment(kvfuzz_version="test"), arms={"fault": [LORA_NS]},
                divergences=[Divergence(request_id="B", class_="corruption", arm="fault", runs_diverged=3, runs=3)])
    f.id = f.compute_id()
    return f


def test_replay_finding_and_trace_in_process(tmp_path, kvfuzz_cli):
    finding = tmp_path / "finding.json"
    save(_alias_finding(), finding)
    trace = tmp_path / "clean.json"
    save(Trace(engine=default_engine(lora=True), events=[
        SendEvent(request_id=f"q{i}", at=At(step=i), max_tokens=6, prompt=GenPrompt(length=60, seed=i))
        for i in range(3)]), trace)
    out = tmp_path / "out"
    p = kvfuzz_cli("replay", finding, trace, "--runs", "2", "--out", out)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # the finding reproduced
    text = " ".join(p.stdout.split())
    assert "expected (file)" in text and "expected 1 diverged, reproduced 1" in text
    assert f"{finding}: REPRODUCED" in text and f"{trace}: not reproduced" in text
    fs = json.loads((out / "replays" / "finding.replay.json").read_text())
    v = {(d["arm"], d["request_id"]): d["class"] for d in fs["verdicts"]}
    assert v == {("fault", "A"): "ok", ("fault", "B"): "corruption"}
    assert fs["reproduced"] and fs["expected"] == ["fault:B"] and fs["finding"]
    ts = json.loads((out / "replays" / "clean.replay.json").read_text())
    assert ts["kind"] == "trace" and not ts["reproduced"] and ts["expected"] is None
    assert {d["class"] for d in ts["verdicts"]} == {"ok"}
