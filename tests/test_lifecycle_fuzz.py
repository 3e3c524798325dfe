"""Lifecycle campaigns without an engine: ``kvfuzz run --lifecycle`` reaches the generator and the
mutation operators in the serial loop and on the many-worker driver, resume refuses a switch,
corpus seeds keep their own LoRA section. (Generation, operators, features and strategies have
their own tests: test_generate.py, test_mutate.py, test_feedback.py, test_strategies.py; the real
engine: test_lifecycle_fuzz_engine.py.)"""

from __future__ import annotations

import pytest

from kvfuzz.fuzzer import CampaignOptions, GenOptions, default_engine, run_campaign
from kvfuzz.fuzzer.mutate import OPERATORS
from kvfuzz.traces import BadInput, History, RequestRecord
from kvfuzz.traces.result import Checked, Recording

LIFECYCLE_OPS = {n for n, o in OPERATORS.items() if o.lifecycle}


def buckets(trace) -> list[str]:
    """Coverage that depends on the trace's shape, so the corpus grows and mutants are made."""
    return [f"sends:{len(trace.sends)}", f"life:{len(trace.lifecycle)}",
            f"slots:{trace.engine.lora.max_loras}/{trace.engine.lora.max_cpu_loras}",
            f"salts:{len({s.cache_salt for s in trace.sends})}"]


def fake_check(trace) -> Checked:
    reqs = {s.request_id: RequestRecord(request_id=s.request_id, adapter=s.adapter) for s in trace.sends}
    h = History(trace_id=trace.trace_id(), engine="inprocess", requests=reqs)
    return Checked(Recording(trace=trace, histories=[h], references={}, environment=None, arms={}), [], None)


def opts(out, n, *, lifecycle=True, resume=False):
    return CampaignOptions(seed=4, budget_s=None, max_traces=n, runs=1, out=out, engine=default_engine(lora=True),
                           gen=GenOptions(lifecycle=lifecycle), resume=resume)


def test_a_lifecycle_campaign_generates_and_mutates_lifecycle_traces(tmp_path, monkeypatch):
    from kvfuzz.fuzzer import feedback

    monkeypatch.setattr(feedback, "signature", lambda h, t=None: frozenset(buckets(t)))
    seen = []
    state = run_campaign(opts(tmp_path, 40), fake_check, on_outcome=lambda o, _s: seen.append(o))
    assert state.lifecycle and state.traces == 40
    fresh = [o.trace for o in seen if o.source == "fresh"]
    assert fresh and all(t.lineage.generator == "lifecycle-v1" for t in fresh)
    mutants = [o.trace for o in seen if o.source == "mutant"]
    assert mutants and all(t.lifecycle or t.sends for t in mutants)
    assert {op for t in mutants for op in t.lineage.operators} & LIFECYCLE_OPS
    # A resume must keep the switch (the trace sequence depends on it).
    with pytest.raises(BadInput, match="lifecycle"):
        run_campaign(opts(tmp_path, 41, lifecycle=False, resume=True), fake_check)


class OneByOne:
    """A one-worker executor finishing tasks in order (fuzzer/distributed.py's protocol)."""

    def __init__(self):
        self.running = {}
        self.tasks = []

    def idle(self):
        return [] if self.running else ["w0"]

    def busy(self):
        return len(self.running)

    def alive(self):
        return True

    def submit(self, worker, task):
        self.running[worker] = task
        self.tasks.append(task)

    def wait(self, timeout_s):
        from kvfuzz.fuzzer.distributed import Result

        task = self.running.pop("w0")
        return [Result(task.index, "w0", buckets=buckets(task.trace))]


def test_the_many_worker_driver_hands_out_lifecycle_traces(tmp_path):
    from kvfuzz.fuzzer.distributed import Driver

    ex = OneByOne()
    state = Driver(opts(tmp_path, 20), ex, window=2).run()
    assert state.lifecycle and state.traces == 20
    traces = [t.trace for t in ex.tasks]
    assert all(t.lineage.generator == "lifecycle-v1" or t.lineage.parent for t in traces)
    assert sum(1 for t in traces if t.lifecycle) >= 18


def test_corpus_seeds_keep_their_own_lora_section(tmp_path):
    from kvfuzz.fuzzer.corpus import rebase
    from kvfuzz.fuzzer.generate import generate

    t = generate(3, default_engine(lora=True), GenOptions(lifecycle=True))
    on = rebase(t, default_engine(lora=True, kv_cache_bytes=32 * 2**20))
    assert on is not None and on.engine.lora == t.engine.lora and on.engine.kv_cache_bytes == 32 * 2**20
    assert rebase(t, default_engine()) is None  # no LoRA: it cannot run there


def test_the_cli_switch(kvfuzz_cli, tmp_path):
    r = kvfuzz_cli("run", "--help")
    assert r.returncode == 0 and "--lifecycle" in r.stdout
    r = kvfuzz_cli("run", "--lifecycle", "--model", "embedded:tiny-hybrid", "--traces", "1", "--out", tmp_path / "o")
    assert r.returncode != 0 and "--lifecycle" in r.stderr
