"""Liveness on the real vLLM CPU engine (docs/oracle.md, "Liveness: how long a request may wait").

Unmodified vLLM never stalls a request: under two seats, priority scheduling, a small KV cache
(preemptions, resets of the prefix cache), one adapter slot, or chunked prefill off, in float32
and bfloat16, no verdict is ``stall`` — and more: every step a request waited is one the model
allows (none unexcused at all, not merely fewer than the bound), while the waits were real (each
excuse occurs). A scheduler that starves one request (test fault AU, in a child process: an
unseen fault is always on once installed) is found, with its witness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvfuzz.fuzzer.generate import GenOptions, default_engine, generate
from kvfuzz.oracle.liveness import spells
from kvfuzz.traces import At, EngineConfig, GenPrompt, SendEvent, Trace

pytestmark = pytest.mark.engine

TESTS = Path(__file__).parent
# Priority scheduling with few seats (two, or four: enough for the generator's KV-pressure shape
# to fill a 2 MiB cache, about 2k tokens, and force preemptions), half of the traces with a
# prefix-cache reset (some preempting every running request).
PRIORITY = default_engine(max_num_seqs=4, scheduling_policy="priority", kv_cache_bytes=2 * 2**20, max_model_len=1024,
                          max_num_batched_tokens=256)
TWO_SEATS = PRIORITY.model_copy(update={"max_num_seqs": 2})
GEN = GenOptions(p_spec=0.0, p_embeds=0.0, p_config=0.0, p_priority=1.0, p_pressure=1.0, p_reset=0.5,
                 max_requests=8, max_tokens=(4, 24), p_long=0.0)


def _two(engine: EngineConfig) -> Trace:
    """An old request decoding 48 tokens and a new one sent two steps later (test fault AU
    leaves the new one out of every step while the old one runs)."""
    return Trace(engine=engine, events=[
        SendEvent(request_id="old", at=At(step=0), max_tokens=48, prompt=GenPrompt(length=64, seed=1)),
        SendEvent(request_id="new", at=At(step=2), max_tokens=8, prompt=GenPrompt(length=40, seed=2))])


def _judge(session, traces: list[Trace]) -> Counter[str]:
    """Each trace checked once: no ``stall`` verdict and no step the model does not allow.
    Returns how many waited steps each excuse allowed."""
    allowed: Counter[str] = Counter()
    for t in traces:
        checked = session.check(t, runs=1)
        stalled = [(v.request_id, v.detail) for v in checked.verdicts if v.class_ == "stall"]
        assert not stalled, (t.name, stalled)
        for h in checked.histories:
            assert not h.crashed, h.crash_detail
            assert h.kv_blocks and h.kv_groups == 1  # the harness recorded the cache's shape
            for sp in spells(t, h):
                assert not sp.unexcused, (t.name, sp.request_id, sp.unexcused[:3])
                allowed.update(sp.excused)
    return allowed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unmodified_vllm_never_stalls_a_request_under_priority_and_pressure(session, dtype):
    engine, two = PRIORITY.with_dtype(dtype), TWO_SEATS.with_dtype(dtype)
    traces = [generate(seed, engine, GEN) for seed in (0, 1, 2, 3)] + [generate(seed, two, GEN) for seed in (1, 2)]
    assert all(t.engine.scheduling_policy == "priority" for t in traces)
    allowed = _judge(session, [*traces, _two(two)])
    assert {"budget", "seats", "queue", "kv", "preemption"} <= set(allowed), allowed


def test_unmodified_vllm_never_stalls_a_request_on_one_adapter_slot_or_without_chunking(session):
    lora = default_engine(lora=True, max_num_seqs=4, max_num_batched_tokens=256)
    lora = lora.model_copy(update={"lora": lora.lora.model_copy(update={"max_loras": 1})})
    one_slot = generate(4, lora, GenOptions(adapters=sorted(lora.lora.adapters), p_spec=0.0, p_embeds=0.0,
                                            p_config=0.0, p_priority=0.0, max_requests=8, p_long=0.0))
    unchunked = default_engine(max_num_seqs=3, enable_chunked_prefill=False, max_num_batched_tokens=2048,
                               kv_cache_bytes=3 * 2**20, max_model_len=2048)
    whole = generate(5, unchunked, GenOptions(p_spec=0.0, p_embeds=0.0, p_config=0.0, p_priority=0.0,
                                              p_pressure=1.0, max_requests=8))
    allowed = _judge(session, [one_slot, whole])
    assert {"lora-slots", "seats"} <= set(allowed), allowed


SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from kvfuzz.driver.session import build_session
from kvfuzz.driver.settings import SessionSettings
from kvfuzz.traces import Trace
trace = Trace.model_validate_json(sys.argv[1])
session = build_session(SessionSettings(runs=1), Path(tempfile.mkdtemp()))
checked = session.check(trace)
print("VERDICTS " + json.dumps({v.request_id: [v.class_, v.detail] for v in checked.verdicts}))
"""


@pytest.mark.slow  # a child process with its own engine: the one test of a fault loaded as a vLLM plugin
def test_a_scheduler_that_starves_a_request_is_found():
    """Fault AU leaves the newest running request out of every step while another runs: "new"
    gets its prefill at step 2, then nothing until "old" has finished, with the budget almost
    free and nothing preempted. Its tokens are right (the fault changes none): only liveness
    can see it. Alone (its reference) it is never left out."""
    trace = _two(default_engine(kv_cache_bytes=8 * 2**20, max_model_len=2048))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVFUZZ_PLUGIN_MODULES": "unseen_faults.newest_running_left_out",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", SCRIPT, trace.model_dump_json()], env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("VERDICTS "))[9:])
    assert got["old"][0] == "ok", got
    cls, detail = got["new"]
    assert cls == "stall", got
    assert "running, 1 of 2048 budget tokens scheduled, nothing preempted" in detail and "served instead: old (1)" in detail
