"""One bug, one bucket on faults kvfuzz has never seen, on the real CPU engine: a test fault
(tests/unseen_faults/, no built-in toggle) gives one complete key per class it shows (its
provisional findings in a related bucket) and no finding without a bucket; ``--resume`` restores
the buckets; an unnamed fault's key is completed by the bounded confirmation. Each test is a
short ``kvfuzz run`` in this process with the fault on (``faults_on``: on engines started under
it and closed with it, never the test run's shared ones): marked slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuzz.traces import load_finding

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # an engine started under the fault each

# Short and small: no controls, the default noise bounds, prompts within 2048 tokens.
ARGS = ["--runs", "1", "--no-controls", "--no-calibrate", "--max-model-len", "2048", "--minimize-seconds", "30"]


@pytest.fixture
def campaign(kvfuzz_cli, monkeypatch):
    """``kvfuzz run`` with a test fault on. References too run under it (as a vLLM with the fault
    would compute them), so none goes to the disk store that other tests read."""
    from unseen_faults import faults_on

    monkeypatch.setenv("KVFUZZ_REFERENCE_CACHE", "off")

    def run(out: Path, fault: str, traces: int, *extra: str):
        with faults_on(fault):
            return kvfuzz_cli("run", "--traces", traces, "--out", out, *ARGS, *extra)

    return run


def check_one_bucket(out: Path, broke: str) -> dict:
    """One complete key per class, every finding in a bucket, each listed in its bucket's file;
    each bucket's key names the post-condition the fault breaks."""
    state = json.loads((out / "campaign.json").read_text())
    buckets = state["bug_buckets"]
    assert state["findings"] >= 2, "the fault gave too few findings to bucket"
    # One cause: one complete key per class it shows (a fault that flips only first tokens at
    # small margins also reads as flipped near ties), never one class split.
    complete = [b["key"]["class"] for b in buckets.values() if not b["key"]["provisional"]]
    assert complete and len(complete) == len(set(complete)), buckets
    assert all(b["key"]["explained_by"] is None for b in buckets.values())  # no toggle explains a fault kvfuzz never saw
    assert {b["key"].get("broke") for b in buckets.values()} == {broke}, buckets
    assert not state["untriaged"] and sum(b["count"] for b in buckets.values()) == state["findings"]
    for rel in state["finding_files"]:
        f = load_finding(out / rel)
        assert f.buckets and {m.bucket for m in f.buckets} <= set(buckets)
        assert all(m.key.digest() == m.bucket for m in f.buckets)  # the id is the key
    for b in buckets.values():
        assert len((out / b["listing"]).read_text().splitlines()) == 1 + b["count"]
    return state


def test_registration_fault_s_gives_one_bucket_and_resume_keeps_it(tmp_path, campaign):
    out = tmp_path / "s"
    p = campaign(out, "register_overwrites", 8, "--seed", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    before = check_one_bucket(out, "map-entry-stolen")
    # The summary speaks in buckets: no row per finding (the old "UNEXPLAINED — candidate vLLM bug" flood).
    assert "UNEXPLAINED by any toggle" in p.stdout and "UNEXPLAINED —" not in p.stdout
    again = campaign(out, "register_overwrites", 11, "--seed", "1", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    after = check_one_bucket(out, "map-entry-stolen")
    assert set(before["bug_buckets"]) <= set(after["bug_buckets"])
    assert after["findings"] >= before["findings"] and after["traces"] == 11


def test_an_unnamed_fault_is_keyed_by_what_its_minimal_witness_needs(tmp_path, campaign):
    """Fault Y breaks no post-condition (a kernel handed a neighbour's block inside the row's
    length): its key is completed by the bounded confirmation, and the bucket's case is the
    minimal witness that measured it. With the whole budget (``--triage-share 1``) every
    finding is confirmed: none is provisional, and each one's key is its own witness's needs."""
    from kvfuzz.oracle.buckets import verdicts_of

    out = tmp_path / "y"
    p = campaign(out, "decode_reads_neighbours_last_block", 6, "--seed", "1", "--triage-share", "1",
                 "--minimize-seconds", "600")
    assert p.returncode == 0, p.stderr[-3000:]
    state = json.loads((out / "campaign.json").read_text())
    bugs = [b for b in state["bug_buckets"].values() if b["key"]["class"] == "corruption"]
    assert bugs and not any(b["key"]["provisional"] for b in bugs), bugs
    for b in bugs:
        assert b["key"]["broke"] is None and b["key"]["explained_by"] is None
        case = load_finding(out / b["case"])
        assert case.minimization is not None and case.minimization.verified and case.minimization.stopped is None
        needs = sorted(m for m, o in verdicts_of(case.explanation).items() if o == "disappears")
        assert sorted(m for m, o in b["key"]["verdicts"].items() if o == "disappears") == needs
    for rel in state["finding_files"]:
        f = load_finding(out / rel)
        assert all(m.key.digest() == m.bucket and m.status in ("opened", "triaged") for m in f.buckets)
