"""`kvfuzz minimize` as a user runs it (the CLI entry point in-process, the real engine, real
files). The minimization inside `kvfuzz run` is checked in test_cli.py."""

import pytest

from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK, LORA_NS
from kvfuzz.traces import At, GenPrompt, SendEvent, Trace, load_finding, save
from kvfuzz.triage.minimize import NotReproduced, minimize_finding


def _s(rid, step, length, max_tokens, adapter=None, group=None, prefix=0, seed=0):
    return SendEvent(request_id=rid, at=At(step=step), adapter=adapter, max_tokens=max_tokens,
                     prompt=GenPrompt(length=length, prefix_group=group, prefix_len=prefix, seed=seed))


@pytest.mark.engine
def test_minimize_command(session, lora_engine_config, tmp_path, kvfuzz_cli):
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
    p = kvfuzz_cli("minimize", src, "--no-shrink-engine")
    assert p.returncode == 0, p.stderr[-3000:]
    out = tmp_path / "finding.min.json"
    small = load_finding(out)
    m = small.minimization
    assert m.verified and m.original == found.id and m.signature == "corruption:B"
    assert m.requests <= 3 and small.provenance.minimized_from.file == str(src)
    assert [c.name for c in small.controls] == ["serialized", "batch-invariant"]
    assert small.controls[0].reproduced and not small.controls[1].available
    assert small.reproduced_in == ["default", "serialized"]
    assert "verified" in p.stdout and str(out) in p.stdout
    r = kvfuzz_cli("report", out, "--markdown")
    assert r.returncode == 0 and "## Trace (minimized)" in r.stdout


@pytest.mark.engine
def test_a_finding_that_does_not_reproduce_is_not_minimized(session, lora_engine_config):
    t = Trace(engine=lora_engine_config, events=[_s("A", 0, 40, 4, "a", seed=1), _s("B", 0, 40, 4, seed=2)])
    clean = session.check(t, runs=1)
    assert clean.finding is None
    # A finding file claiming B diverged, which this engine does not reproduce.
    from kvfuzz.oracle import make_finding

    fake = [v.model_copy(update={"class_": "corruption", "runs_diverged": 1}) if v.request_id == "B" else v
            for v in clean.verdicts]
    f = make_finding(t, clean.recording.histories, clean.recording.references, fake, clean.recording.environment)
    with pytest.raises(NotReproduced):
        minimize_finding(session, f)
