"""Calibration, teacher forcing, and 16-bit verdicts on the real engine."""

from __future__ import annotations

import json

import pytest

from kvfuzz.fuzzer import default_engine
from kvfuzz.oracle.noise import resolution
from kvfuzz.traces import At, GenPrompt, SendEvent
from kvfuzz.traces.calibration import load_profile

pytestmark = pytest.mark.engine


def test_teacher_forcing_scores_the_request_s_own_tokens(session):
    """Scoring a request's reference tokens alone gives back its decode logprobs, up to what
    prefill vs decode adds (float32: ~1e-5), with the scored token first at every position."""
    cfg = default_engine()
    engine = session.engine_for(cfg)
    send = SendEvent(request_id="q", at=At(step=0), max_tokens=16, prompt=GenPrompt(length=300, seed=4))
    ref = engine.run_alone(send)
    scored = engine.score(send, ref.token_ids)
    assert [p[0][0] for p in scored] == ref.token_ids and all(len(p) == 2 for p in scored)
    assert max(abs(a[0][1] - b[0][1]) for a, b in zip(scored, ref.logprobs)) < 1e-4
    # Other tokens are scored as they are: the 2nd-best token of position 0 forced there.
    other = [ref.logprobs[0][1][0], *ref.token_ids[1:]]
    forced = engine.score(send, other)
    assert forced[0][0] == (other[0], pytest.approx(ref.logprobs[0][1][1], abs=1e-4))


def test_calibrate_command_writes_a_profile_that_judges_a_campaign(kvfuzz_cli, tmp_path):
    out = tmp_path / "profile.json"
    p = kvfuzz_cli("calibrate", "--requests", "8", "--max-tokens", "8", "--budget", "120", "--out", out,
                   "--markdown")
    assert p.returncode == 0, p.stderr[-3000:]
    profile = load_profile(out)
    assert profile.key.dtype == "float32" and profile.key.model_hash and profile.requests == 8
    names = [c.name for c in profile.contexts]
    assert names[0].startswith("batched") and any("preempted" in n for n in names)
    ctx = {c.name.split(" ")[0]: c for c in profile.contexts}
    # Each context did what it claims to the measured requests.
    assert ctx["batched"].chunked_requests >= 1 and ctx["preempted"].preempted_requests >= 1
    assert any(c.prefix_hit_requests for c in profile.contexts)
    # Every context measures every request, but KV pressure: the prompts one step prefills.
    assert all(c.positions > 0 for c in profile.contexts)
    assert all(c.requests == 8 for c in profile.contexts if not c.name.startswith("preempted"))
    assert 1 <= ctx["preempted"].requests < 8  # the 3,000-7,000-token prompt is left out there
    b = profile.bounds
    assert b["near_tie"] >= 2 * resolution("float32") and b["teacher"] >= profile.prefill_vs_decode
    assert "max teacher-forced" in " ".join(p.stdout.split()) and str(out) in p.stdout
    # A campaign judged by it says so, and so do its findings.
    run = kvfuzz_cli("run", "--traces", "1", "--calibration", out, "--no-minimize", "--no-controls",
                     "--out", tmp_path / "o")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"calibration profile {profile.id}" in " ".join(run.stdout.split())
    assert json.loads((tmp_path / "o" / "campaign.json").read_text())["traces"] == 1
