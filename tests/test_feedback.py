"""Coverage signatures from recorded scheduler state (pure: constructed histories)."""

from kvfuzz.fuzzer import default_engine
from kvfuzz.fuzzer.feedback import Coverage, bucket, signature
from kvfuzz.traces import At, GenPrompt, History, RequestRecord, SendEvent, StepRecord, Trace
from kvfuzz.traces.history import EventRecord

ENG = default_engine(lora=True)


def trace(adapters):
    return Trace(engine=ENG, events=[SendEvent(request_id=r, at=At(step=0), adapter=a, max_tokens=4,
                                               prompt=GenPrompt(length=40, seed=i))
                                     for i, (r, a) in enumerate(adapters.items())])


def hist(steps=(), requests=(), events=(), **kw):
    kw.setdefault("engine", "inprocess")
    return History(trace_id="t", steps=list(steps), requests={r.request_id: r for r in requests},
                   events=list(events), **kw)


def test_buckets_are_afl_style():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 20, 100, 1000)] == \
        ["0", "1", "2", "3", "4-7", "4-7", "8-15", "16-31", "32-127", "128+"]


def test_scheduler_state_buckets():
    steps = [
        StepRecord(step=0, running=2, waiting=1, kv_usage=0.55, prefix_queries=100, prefix_hits=64,
                   scheduled={"a": 2048, "b": 1}, partial_prefills=["a"]),
        StepRecord(step=1, running=3, waiting=0, kv_usage=0.97, scheduled={"a": 100, "b": 1, "c": 1},
                   preempted=["b"], evictions=2),
    ]
    sig = signature(hist(steps=steps), trace({"a": None, "b": None, "c": None}))
    assert {"preempt:1", "evict:2", "chunked:1", "prefix-hits:2", "prefix-ratio:50-75", "kv-max:90",
            "batch-max:3-4", "waiting-max:1", "batch:1p+1d", "batch:1p+2d", "chunk-with-decode", "preempt-kv:90",
            "step:run2/wait/chunk/calm/kv50", "step:run3-4/nowait/whole/preempt/kv90"} <= sig
    # The same run without the preemption is a different signature.
    calm = [s.model_copy(update={"preempted": []}) for s in steps]
    assert "preempt:0" in signature(hist(steps=calm)) and "preempt:1" not in signature(hist(steps=calm))


def test_lora_residency_and_swaps_with_two_slots():
    t = trace({"x": "a", "y": "b", "z": "c", "base": None})
    steps = [StepRecord(step=0, scheduled={"x": 1, "y": 1}),
             StepRecord(step=1, scheduled={"z": 1, "base": 1}),  # c evicts a (2 slots)
             StepRecord(step=2, scheduled={"x": 1})]              # a evicts b
    sig = signature(hist(steps=steps), t)
    assert {"lora-running:2", "lora-running:1+base", "lora-resident:2", "lora-swaps:2"} <= sig
    sig1 = signature(hist(steps=steps[:1]), t)
    assert "lora-swaps:0" in sig1


def test_cancel_phases_and_retry_after_cancel():
    reqs = [
        RequestRecord(request_id="w", sent_step=3, cancel_step=3, cancelled=True),               # never ran
        RequestRecord(request_id="p", sent_step=0, cancel_step=2, cancelled=True),               # mid-prefill
        RequestRecord(request_id="f", sent_step=0, cancel_step=2, cancelled=True, token_ids=[5]),
        RequestRecord(request_id="d", sent_step=0, cancel_step=9, cancelled=True, token_ids=[5, 6, 7]),
        RequestRecord(request_id="n", sent_step=0, finish_reason="length", token_ids=[1], num_cached_tokens=64,
                      num_preemptions=2),
    ]
    events = [EventRecord(index=0, kind="cancel", request_id="d", actual_step=9),
              EventRecord(index=1, kind="send", request_id="d_retry", actual_step=10),
              EventRecord(index=2, kind="cancel", request_id="n", actual_step=12, effective=False)]
    sig = signature(hist(requests=reqs, events=events), None)
    assert {"cancel:waiting", "cancel:prefill", "cancel:first-token", "cancel:decode", "cancel:after-finish",
            "send-after-cancel:1", "cached:block-aligned", "req-preempted:2+done", "req-cached-n:1"} <= sig


def test_server_histories_use_metric_deltas():
    h = hist(engine="server", metrics_before={"vllm:num_preemptions_total": 3, "vllm:prefix_cache_hits_total": 0,
                                               "vllm:prefix_cache_queries_total": 10},
             metrics_after={"vllm:num_preemptions_total": 5, "vllm:prefix_cache_hits_total": 64,
                            "vllm:prefix_cache_queries_total": 138})
    assert {"preempt:2", "prefix-hits:2", "prefix-ratio:50-75"} <= signature(h)


def test_coverage_novelty_and_rarity():
    cov = Coverage()
    assert cov.add({"a", "b"}) == ["a", "b"]
    assert cov.add({"a", "c"}) == ["c"]
    assert cov.add({"a"}) == [] and len(cov) == 3
    assert cov.rarity({"b"}) == 1.0 and cov.rarity({"a"}) == 1 / 3
    assert Coverage.from_json(cov.to_json()).hits == cov.hits


def test_lifecycle_buckets_from_a_hand_checked_history():
    """a is reloaded in place while r0 (on a) runs; r2 on a follows with r0's prefix and tenant
    and is served 64 cached tokens; b is unloaded and loaded again while r2 runs; r3 repeats r0's
    prompt under another tenant. The LoRA manager loaded 3 adapters, evicted one (in the step of
    a load), activated slots twice and re-read a in place once."""
    from kvfuzz.traces import LoraSettings, parse_trace

    grp = {"length": 100, "prefix_group": "g", "prefix_len": 64, "seed": 1}

    def send(rid, step, adapter, prompt, salt=None):
        e = {"kind": "send", "request_id": rid, "at": {"step": step}, "adapter": adapter, "prompt": prompt,
             "max_tokens": 4}
        return {**e, "cache_salt": salt} if salt else e

    t = parse_trace({"schema_version": 2, "engine": ENG.model_copy(update={"lora": LoraSettings(
        enabled=True, adapters={"a": "embedded:a", "b": "embedded:b"}, max_cpu_loras=3)}).model_dump(mode="json"),
        "events": [
            send("r0", 0, "a", grp, "t1"),
            send("r1", 0, "b", {"length": 40, "seed": 2}),
            {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2", "same_path": True, "at": {"step": 5}},
            send("r2", 6, "a", {**grp, "seed": 3}, "t1"),
            {"kind": "unload-adapter", "name": "b", "at": {"step": 7}},
            {"kind": "load-adapter", "name": "b", "source": "embedded:c", "at": {"step": 8}},
            send("r3", 8, None, grp, "t2"),
        ]})
    reqs = [RequestRecord(request_id="r0", adapter="a", sent_step=0, finished_step=6, token_ids=[1] * 4),
            RequestRecord(request_id="r1", adapter="b", sent_step=0, finished_step=3, token_ids=[1] * 4),
            RequestRecord(request_id="r2", adapter="a", sent_step=6, finished_step=9, token_ids=[1] * 4,
                          num_cached_tokens=64),
            RequestRecord(request_id="r3", sent_step=8, finished_step=10, token_ids=[1] * 4, num_cached_tokens=0)]
    events = [EventRecord(index=0, kind="send", request_id="r0", actual_step=0),
              EventRecord(index=1, kind="send", request_id="r1", actual_step=0),
              EventRecord(index=2, kind="reload-adapter", adapter="a", actual_step=5),
              EventRecord(index=3, kind="send", request_id="r2", actual_step=6),
              EventRecord(index=4, kind="unload-adapter", adapter="b", actual_step=7),
              EventRecord(index=5, kind="load-adapter", adapter="b", actual_step=8),
              EventRecord(index=6, kind="send", request_id="r3", actual_step=8)]
    steps = [StepRecord(step=0, scheduled={"r0": 100, "r1": 40}, lora_loads=2, lora_slot_changes=2),
             StepRecord(step=5, scheduled={"r0": 1}, lora_reloads=1),
             StepRecord(step=6, scheduled={"r0": 1, "r2": 36}, lora_loads=1, lora_evictions=1)]
    sig = signature(hist(steps=steps, requests=reqs, events=events), t)
    lifecycle = {b for b in sig if b.startswith(("life:", "lora-loads", "lora-evictions", "lora-slot", "lora-reloads",
                                                 "lora-churn", "salt:"))}
    assert lifecycle == {
        "lora-loads:3", "lora-evictions:1", "lora-slot-changes:2", "lora-reloads:1", "lora-churn-step",
        "life:reload-adapter:1", "life:unload-adapter:1", "life:load-adapter:1",
        "life:reload-adapter:own-in-flight",     # r0 on a still ran (it ended in step 6)
        "life:unload-adapter:others-in-flight",  # r2 on a ran, r1 on b had ended
        "life:load-adapter:others-in-flight",
        "life:after-reload-in-place", "life:after-reload-in-place:shares-prefix",
        "life:after-reload-in-place:shares-prefix:same-tenant", "life:after-reload-in-place:cached:shares-prefix",
        "salt:tenants:2+none", "salt:cross-tenant-prefix",
    }, sorted(lifecycle)
    # Without lifecycle events (and no max_cpu_loras) the same counters add no bucket: other
    # campaigns keep their signatures.
    plain = signature(hist(steps=steps, requests=reqs, events=[e for e in events if e.kind == "send"]),
                      trace({"r0": "a", "r1": "b", "r2": "a", "r3": None}))
    assert not {b for b in plain if b.startswith(("life:", "lora-loads", "lora-churn", "salt:"))}
