"""`kvfuzz run --corpus DIR` and `--resume` as a user runs them (real subprocess, real engine)."""

import json
import subprocess
import sys

import pytest

from fuzzer import CorpusEntry


def kvfuzz(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvfuzz", *args], capture_output=True, text=True, timeout=timeout)


def test_bad_corpus_and_resume_arguments_are_one_line_exit_2(tmp_path):
    f = tmp_path / "file.json"
    f.write_text("{}")
    p = kvfuzz("run", "--traces", "1", "--corpus", str(f), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--corpus" in p.stderr
    p = kvfuzz("run", "--traces", "1", "--resume", "--out", str(tmp_path / "empty"))
    assert p.returncode == 2 and "nothing to resume" in p.stderr and "Traceback" not in p.stderr
    p = kvfuzz("run", "--traces", "1", "--operators", "shift,nope", "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "unknown operator 'nope'" in p.stderr


@pytest.mark.engine
def test_run_grows_a_corpus_and_resumes(tmp_path):
    out, corpus = tmp_path / "out", tmp_path / "corpus"
    # Cheap operators keep the test short (long_pressure prefills ~24k tokens per run).
    cheap = ["--operators", "shift,drop,max_tokens,split,cancel_timing"]
    p = kvfuzz("run", "--traces", "2", "--seed", "5", "--runs", "1", "--corpus", str(corpus), "--out", str(out), *cheap)
    assert p.returncode == 0, p.stderr[-2000:]
    state = json.loads((out / "campaign.json").read_text())
    assert state["traces"] == 2 and state["mode"] == "feedback" and state["complete"]
    files = sorted(corpus.glob("*.json"))
    assert len(files) == len(state["corpus"]) >= 1  # the first trace always reaches new buckets
    entries = [CorpusEntry.model_validate_json(f.read_text()) for f in files]
    assert all(e.novel and e.measured_on for e in entries)
    assert state["coverage"] and len(state["coverage"]) >= len(entries[0].buckets)
    assert str(corpus.resolve()) in p.stdout and "coverage buckets" in p.stdout

    p = kvfuzz("run", "--traces", "3", "--seed", "5", "--runs", "1", "--corpus", str(corpus), "--out", str(out),
               "--resume", *cheap)
    assert p.returncode == 0, p.stderr[-2000:]
    resumed = json.loads((out / "campaign.json").read_text())
    assert resumed["traces"] == 3 and resumed["next_index"] == 3
    assert resumed["corpus"][: len(state["corpus"])] == state["corpus"]
    assert set(state["coverage"]) <= set(resumed["coverage"])
