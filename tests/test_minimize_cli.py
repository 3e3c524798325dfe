"""`kvfuzz minimize` and the automatic minimization in `kvfuzz run`, as a user runs them (real
subprocesses, real engine, real files)."""

import json
import subprocess
import sys

import pytest

from harness.toggles.builtin import LORA_CPU_MASK, LORA_NS
from oracle.minimize import NotReproduced, minimize_finding
from traces import At, Divergence, Environment, Finding, GenPrompt, SendEvent, Trace, load_finding, save


def kvfuzz(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvfuzz", *args], capture_output=True, text=True, timeout=timeout)


def _s(rid, step, length, max_tokens, adapter=None, group=None, prefix=0, seed=0):
    return SendEvent(request_id=rid, at=At(step=step), adapter=adapter, max_tokens=max_tokens,
                     prompt=GenPrompt(length=length, prefix_group=group, prefix_len=prefix, seed=seed))


@pytest.mark.engine
def test_minimize_command(session, lora_engine_config, tmp_path):
    t = Trace(engine=lora_engine_config.model_copy(update={"toggles": [LORA_NS, LORA_CPU_MASK]}), events=[
        _s("A", 0, 140, 4, "a", "shared", 128, seed=1),
        _s("x", 1, 200, 6, seed=7),
        _s("y", 4, 64, 5, "c", seed=8),
        _s("B", 12, 150, 8, "b", "shared", 128, seed=2),
    ])
    found = session.check(t).finding  # the trace's own toggles: the fault (and the CPU fix)
    assert found is not None and found.signature() == "corruption:B"
    src = tmp_path / "finding.json"
    save(found, src)
    p = kvfuzz("minimize", str(src), "--no-shrink-engine")
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "finding.min.json"
    small = load_finding(out)
    m = small.minimization
    assert m.verified and m.original == found.id and m.signature == "corruption:B"
    assert m.requests <= 3 and small.notes["minimized_from"]["file"] == str(src)
    assert [c.name for c in small.controls] == ["serialized", "batch-invariant"]
    assert small.controls[0].reproduced and not small.controls[1].available
    assert small.notes["reproduced_in"] == ["default", "serialized"]
    assert "verified" in p.stdout and str(out) in p.stdout
    r = kvfuzz("report", str(out), "--markdown")
    assert r.returncode == 0 and "## Trace (minimized)" in r.stdout


def test_minimize_command_bad_input(tmp_path):
    p = kvfuzz("minimize", str(tmp_path / "missing.json"))
    assert p.returncode == 2 and "no such file" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    t = Trace(events=[_s("B", 0, 40, 4)])
    f = Finding(trace=t, environment=Environment(kvfuzz_version="t"),
                divergences=[Divergence(request_id="B", class_="corruption", runs_diverged=1, runs=1)])
    src = tmp_path / "f.json"
    save(f, src)
    p = kvfuzz("minimize", str(src), "--victim", "nobody")
    assert p.returncode == 2 and "--victim" in p.stderr and "Traceback" not in p.stderr
    p = kvfuzz("minimize", str(src), "-k", "2", "-m", "3")
    assert p.returncode == 2 and "--min-hits" in p.stderr
    f.divergences = []
    save(f, src)
    p = kvfuzz("minimize", str(src))
    assert p.returncode == 2 and "no divergence" in p.stderr


@pytest.mark.engine
def test_a_finding_that_does_not_reproduce_is_not_minimized(session, lora_engine_config):
    t = Trace(engine=lora_engine_config, events=[_s("A", 0, 40, 4, "a", seed=1), _s("B", 0, 40, 4, seed=2)])
    clean = session.check(t, runs=1)
    assert clean.finding is None
    # A finding file claiming B diverged, which this engine does not reproduce.
    from oracle import make_finding

    fake = [v.model_copy(update={"class_": "corruption", "runs_diverged": 1}) if v.request_id == "B" else v
            for v in clean.verdicts]
    f = make_finding(t, clean.recording.histories, clean.recording.references, fake, clean.recording.environment)
    with pytest.raises(NotReproduced):
        minimize_finding(session, f)


@pytest.mark.engine
@pytest.mark.slow
def test_run_minimizes_findings_and_keeps_the_originals(tmp_path):
    out = tmp_path / "out"
    # Within 3 traces, seed 1 hits the real CPU LoRA bug (docs/findings.md #1).
    p = kvfuzz("run", "--traces", "3", "--lora", "--seed", "1", "--out", str(out), "--minimize-seconds", "90")
    assert p.returncode == 0, p.stderr[-3000:]
    state = json.loads((out / "campaign.json").read_text())
    files = sorted((out / "findings").glob("*.json"))
    assert state["findings"] == len(files) >= 1
    for path in files:
        small = load_finding(path)
        m = small.minimization
        assert m is not None and m.verified and m.requests < m.original_requests
        orig = load_finding(out / small.notes["minimized_from"]["file"])
        assert orig.id == m.original and orig.notes["minimized_to"] == small.id
        assert orig.minimization is None and len(orig.trace.sends) == m.original_requests
        for f in (small, orig):
            assert [c.name for c in f.controls] == ["serialized", "batch-invariant"]
            assert f.notes["reproduced_in"] == ["vanilla"]  # the CPU LoRA bug needs batching
    p = kvfuzz("run", "--traces", "1", "--no-minimize", "--no-controls", "--near-tie", "-1", "--out", str(out))
    assert p.returncode == 2 and "--near-tie" in p.stderr
