"""Causal ablation on the real engine: for every built-in toggle that changes outputs on CPU,
`explain` names the mechanism the toggle's code path needs (its declared ``needs``), and a
mechanism it does not need keeps the divergence."""

from __future__ import annotations

import pytest
from test_toggles import OUTPUT_CHANGING, SMALL, send

from kvfuzz.harness import toggles as reg
from kvfuzz.harness.toggles.builtin import LORA_NS, PREEMPT_STALE
from kvfuzz.triage.explain import explain

pytestmark = pytest.mark.engine


def _preempt_trace(_cfg):
    from kvfuzz.traces import Trace

    return Trace(engine=SMALL, events=[send("X", 0, 1000, seed=1, mt=160), send("Y", 1, 1900, seed=2, mt=100)])


CASES = [*OUTPUT_CHANGING,
         pytest.param(PREEMPT_STALE, _preempt_trace, "Y", [], [PREEMPT_STALE], id="preempt-resume-stale")]


@pytest.mark.parametrize("toggle,make,victim,good,bad", CASES)
def test_explain_names_what_the_toggle_needs(session, lora_engine_config, toggle, make, victim, good, bad):
    finding = session.check(make(lora_engine_config), runs=1, arms={"bad": bad}).finding
    assert finding is not None and victim in {d.request_id for d in finding.divergences}
    needs = list(reg.get(toggle).needs)
    # The LoRA-namespace fault reproduces with the requests one at a time (adapter b reads the
    # blocks adapter a cached earlier): concurrency is a mechanism it does not need.
    extra = ["concurrency"] if toggle == LORA_NS else []
    ex = explain(session, finding, victim=victim, mechanisms=[*needs, *extra])
    outcome = {a.mechanism: a.outcome for a in ex.ablations}
    assert all(outcome[m] == "disappears" for m in needs), outcome
    assert all(outcome[m] == "persists" for m in extra), outcome
    assert ex.needs == needs and ex.victim == victim
    assert ex.summary().startswith("needs: ")


DRIFT_SCRIPT = """
import importlib, json, sys, tempfile
from pathlib import Path
from kvfuzz.driver.session import build_session
from kvfuzz.driver.settings import SessionSettings
from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.traces import At, GenPrompt, SendEvent, Trace
victim, max_tokens, owner, attr = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tmp = Path(tempfile.mkdtemp())
cfg = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000)
trace = Trace(engine=cfg, events=[SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=max_tokens,
                                            prompt=GenPrompt(length=20 + 7 * i, seed=i)) for i in range(2)])
s = build_session(SessionSettings(profiles_dir=tmp / "profiles"), tmp)
out = {"fault": s.judge_victim(trace, victim=victim, arm="vanilla", toggles=[]).__dict__}
h = s.engine_for(cfg).replay(trace, arm="vanilla", run_index=0, toggles=[])
out["breaks"] = [b.name for b in h.breaks]  # none: the case where a bucket rests on the verdicts
mod, cls = owner.rsplit(".", 1)
klass = getattr(importlib.import_module(mod), cls)
setattr(klass, attr, getattr(klass, attr).__wrapped__)  # the fault undone, same engine
out["clean"] = s.judge_victim(trace, victim=victim, arm="vanilla", toggles=[]).__dict__
s.close()
print("J " + json.dumps(out))
"""

# Faults whose wrong KV shows in no record of the scheduler's (W breaks only ``worker-slot``,
# X only ``worker-seq-len``, Y none), in two mechanisms: W writes a decode token's KV into the
# previous block (r1, 27 prompt tokens, opens its second block at its 6th token); X and Y let a
# decode read the block past its row's end (X: no token flips) or its neighbour's last block
# (Y: r1 reads r0's first block at its 6th token).
NO_BREAK_FAULTS = [
    pytest.param("new_block_slot_in_previous", "r1", 14, "vllm.v1.worker.block_table.BlockTable",
                 "compute_slot_mapping", "ok", id="W"),
    pytest.param("decode_reads_past_row_end", "r1", 40,
                 "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder", "build", "ok", id="X"),
    pytest.param("decode_reads_neighbours_last_block", "r1", 14,
                 "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder", "build", "corruption", id="Y"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fault,victim,max_tokens,owner,attr,cls", NO_BREAK_FAULTS)
def test_wrong_kv_that_flips_no_token_is_measured_by_its_drift(fault, victim, max_tokens, owner, attr, cls):
    """Wrong KV may flip no token: an ablation that only moves the victim off its flip must not
    read as "disappears". On the real engine, W's and X's victims match every reference token
    yet their logprobs drift far past the bound (Y's flips); with the fault undone in the same
    engine each is noise."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVFUZZ_PLUGIN_MODULES": f"unseen_faults.{fault}",
           "KVFUZZ_REFERENCE_CACHE": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", DRIFT_SCRIPT, victim, str(max_tokens), owner, attr], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("J "))[2:])
    fault_, clean = got["fault"], got["clean"]
    assert fault_["cls"] == cls, got
    if cls == "ok":
        assert fault_["drift"] > 10 * fault_["bound"], got
    assert clean["cls"] == "ok" and clean["drift"] <= clean["bound"], got
    # W's wrong slots break ``worker-slot`` (on r0 and r1; the slot W left unwritten is read at a
    # later step, a consequence); X's kernel is told a block more than r0's and r1's rows hold
    # (``worker-seq-len``); Y reads a wrong block that no record of vLLM's shows.
    w = fault == "new_block_slot_in_previous"
    name = {"new_block_slot_in_previous": "worker-slot", "decode_reads_past_row_end": "worker-seq-len"}.get(fault)
    assert [b for b in got["breaks"] if b != "held-block-unwritten"] == ([name, name] if name else []), got
    assert got["breaks"].count("held-block-unwritten") <= (2 if w else 0), got
    assert fault_["broke"] == name, got
