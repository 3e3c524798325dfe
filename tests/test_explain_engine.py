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


@pytest.mark.slow  # an engine of its own, started under the fault
@pytest.mark.parametrize("fault,victim,max_tokens,owner,attr,cls", NO_BREAK_FAULTS)
def test_wrong_kv_that_flips_no_token_is_measured_by_its_drift(fault, victim, max_tokens, owner, attr, cls,
                                                               tmp_path, monkeypatch):
    """Wrong KV may flip no token: an ablation that only moves the victim off its flip must not
    read as "disappears". On the real engine, W's and X's victims match every reference token
    yet their logprobs drift far past the bound (Y's flips); with the fault undone in the same
    engine each is noise."""
    import importlib

    from unseen_faults import faults_on

    from kvfuzz.driver.session import build_session
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.fuzzer.generate import default_engine
    from kvfuzz.traces import At, GenPrompt, SendEvent, Trace

    monkeypatch.setenv("KVFUZZ_REFERENCE_CACHE", "off")
    cfg = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=8000)
    trace = Trace(engine=cfg, events=[SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=max_tokens,
                                                prompt=GenPrompt(length=20 + 7 * i, seed=i)) for i in range(2)])
    mod, klass = owner.rsplit(".", 1)
    # A session of its own (its references and bounds are this fault's), on an engine the pool
    # starts under the fault and closes with it.
    with faults_on(fault) as on, build_session(SessionSettings(profiles_dir=tmp_path / "profiles"), tmp_path) as s:
        got = {"fault": s.judge_victim(trace, victim=victim, arm="vanilla", toggles=[]).__dict__}
        eng = s.engine_for(cfg)
        h = eng.replay(trace, arm="vanilla", run_index=0, toggles=[])
        got["breaks"] = [b.name for b in h.breaks]  # none: the case where a bucket rests on the verdicts
        on.off(fault)  # the fault undone, same engine
        assert not hasattr(getattr(getattr(importlib.import_module(mod), klass), attr), "__unseen_tag__")
        got["clean"] = s.judge_victim(trace, victim=victim, arm="vanilla", toggles=[]).__dict__
        assert s.engine_for(cfg) is eng
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
