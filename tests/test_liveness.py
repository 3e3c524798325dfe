"""The liveness check on histories built by hand (pure; no engine): which waits vLLM's scheduler
allows (docs/oracle.md, "Liveness: how long a request may wait") and which make a ``stall``."""

from __future__ import annotations

from dataclasses import dataclass

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import check
from kvfuzz.oracle.liveness import STALL_STEPS, excuse, spells, stalls
from kvfuzz.oracle.schedule import replay_schedule
from kvfuzz.traces import At, EventRecord, GenPrompt, History, RequestRecord, SendEvent, StepRecord, Trace
from kvfuzz.traces.finding import DIVERGENT_CLASSES, SEVERITY


@dataclass
class Req:
    rid: str
    sent: int
    prompt: int = 16
    max_tokens: int = 64
    priority: int = 0
    adapter: str | None = None
    finished: int | None = None


@dataclass
class Step:
    scheduled: dict[str, int]
    preempted: tuple[str, ...] = ()
    kv_usage: float = 0.1


def build(reqs: list[Req], steps: list[Step], *, kv_blocks: int | None = 1000, **engine: object) -> tuple[Trace, History]:
    """A trace of ``reqs`` and the in-process history whose step ``i`` is ``steps[i]``; the
    engine's statistics (running, waiting) follow from the schedule, as vLLM's would."""
    lora = engine.pop("max_loras", None)
    cfg = default_engine(lora=lora is not None, **engine)
    if lora is not None:
        cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"max_loras": lora})})
    sends = [SendEvent(request_id=r.rid, at=At(step=r.sent), prompt=GenPrompt(length=r.prompt, seed=i),
                       max_tokens=r.max_tokens, priority=r.priority, adapter=r.adapter) for i, r in enumerate(reqs)]
    trace = Trace(engine=cfg, events=sends)
    order = sorted(reqs, key=lambda r: (r.sent, reqs.index(r)))
    records = {}
    for r in reqs:
        produced = sum(1 for s in steps if r.rid in s.scheduled)  # enough: the check only bounds it
        records[r.rid] = RequestRecord(request_id=r.rid, adapter=r.adapter, prompt_len=r.prompt, max_tokens=r.max_tokens,
                                       token_ids=[7] * min(produced, r.max_tokens), sent_step=r.sent,
                                       finished_step=r.finished, finish_reason="length" if r.finished is not None else None)
    running: set[str] = set()
    out = []
    for i, s in enumerate(steps):
        running -= set(s.preempted)
        running |= set(s.scheduled)
        running -= {r.rid for r in reqs if r.finished is not None and r.finished <= i}
        live = {r.rid for r in reqs if r.sent <= i and (r.finished is None or r.finished > i)}
        out.append(StepRecord(step=i, scheduled=dict(s.scheduled), preempted=list(s.preempted), running=len(running),
                              waiting=len(live - running), kv_usage=s.kv_usage))
    hist = History(trace_id="t", engine="inprocess", requests=records, steps=out, kv_blocks=kv_blocks, kv_groups=1,
                   events=[EventRecord(index=i, kind="send", request_id=r.rid, actual_step=r.sent)
                           for i, r in enumerate(order)])
    return trace, hist


def excuses(trace: Trace, hist: History, rid: str) -> list[str | None]:
    """The model's excuse for each step in which ``rid`` was live, unserved and others were."""
    rep = replay_schedule(trace, hist)
    return [excuse(rep, m, rid) for m in rep.moments
            if rid in m.live and rid not in m.record.scheduled and any(q != rid for q in m.record.scheduled)]


def test_the_class_is_a_divergence_ranked_after_corruption():
    assert "stall" in DIVERGENT_CLASSES
    assert SEVERITY["corruption"] < SEVERITY["stall"] < SEVERITY["numeric-near-tie"]


def test_fcfs_waiting_behind_a_long_chunked_prefill_is_allowed():
    """A's 1,000-token prompt takes the whole 128-token budget for eight steps: B, sent after it,
    waits (first in the queue, then, once admitted with A's last chunk, running behind it)."""
    long, short = Req("A", 0, prompt=1000, finished=20), Req("B", 1, prompt=16, finished=20)
    steps = [Step({"A": 128}) for _ in range(7)] + [Step({"A": 104, "B": 16})]
    steps += [Step({"A": 1, "B": 1}) for _ in range(13)]
    trace, hist = build([long, short], steps, max_num_batched_tokens=128)
    assert excuses(trace, hist, "B") == ["budget"] * 6
    assert stalls(trace, hist) == {}


def test_a_running_request_behind_a_prefill_that_spends_the_budget_is_allowed():
    a, b = Req("A", 2, prompt=1000), Req("B", 0)
    steps = [Step({"B": 16}), Step({"B": 1})] + [Step({"A": 128}) for _ in range(7)] + [Step({"A": 104, "B": 1})]
    trace, hist = build([a, b], steps, max_num_batched_tokens=128)
    assert excuses(trace, hist, "B") == ["budget"] * 7 and stalls(trace, hist) == {}


def test_priority_waiting_behind_higher_priorities_is_allowed():
    """Two seats and a nearly full cache (3 blocks free). The low-priority request runs first;
    two urgent ones arrive, one takes the second seat, and when its decode needs a block the
    scheduler preempts the lowest priority. From then on the urgent ones run one at a time and
    the low one waits: behind the urgent one at the queue's head, then for blocks."""
    low, hi1, hi2 = Req("low", 0, priority=5), Req("hi1", 1, priority=0, finished=10), Req("hi2", 1, priority=0, finished=25)
    steps = [Step({"low": 16}), Step({"low": 1, "hi1": 16}), Step({"hi1": 1}, preempted=("low",))]
    steps += [Step({"hi1": 1}) for _ in range(8)] + [Step({"hi2": 16})] + [Step({"hi2": 1}) for _ in range(14)]
    steps += [Step({"low": 18})]
    trace, hist = build([low, hi1, hi2], [Step(s.scheduled, s.preempted, kv_usage=0.997) for s in steps],
                        max_num_seqs=2, scheduling_policy="priority")
    got = excuses(trace, hist, "low")
    assert got == ["preemption"] + ["queue"] * 8 + ["kv"] * 15
    assert stalls(trace, hist) == {}
    # hi2 (sent with hi1, after it in the file: behind it) waits for a seat, then for blocks.
    assert excuses(trace, hist, "hi2") == ["seats", "preemption"] + ["kv"] * 8


def test_a_waiting_request_skipped_for_a_busy_adapter_slot_is_allowed():
    """One adapter slot, held by A's requests: B (adapter b) is skipped and C (adapter a), sent
    after it, is admitted past it: vLLM's max_loras rule."""
    a, b, c = Req("A", 0, adapter="a"), Req("B", 1, adapter="b"), Req("C", 2, adapter="a", finished=30)
    steps = [Step({"A": 16}), Step({"A": 1}), Step({"A": 1, "C": 16})] + [Step({"A": 1, "C": 1}) for _ in range(27)]
    trace, hist = build([a, b, c], steps, max_loras=1)
    assert set(excuses(trace, hist, "B")) == {"lora-slots"} and stalls(trace, hist) == {}
    # With two slots nothing kept B out: C overtaking it for 28 steps is a stall.
    trace2, hist2 = build([a, b, c], steps, max_loras=2)
    got = stalls(trace2, hist2)
    assert set(got) == {"B"} and any("C admitted from behind it in fcfs order" in w.why for w in got["B"].unexcused)


def test_a_request_starved_while_the_budget_is_free_is_a_stall():
    """A and B both decode; from step 3 on only A is scheduled, one token a step of 2,048, with
    nothing preempted: the running loop serves every running request while budget remains."""
    a, b = Req("A", 0, finished=40), Req("B", 0)
    steps = [Step({"A": 16, "B": 16}), Step({"A": 1, "B": 1}), Step({"A": 1, "B": 1})]
    steps += [Step({"A": 1}) for _ in range(38)] + [Step({"B": 1})]
    trace, hist = build([a, b], steps)
    (s,) = stalls(trace, hist).values()
    assert (s.request_id, s.first_step, s.last_step, s.waited, len(s.unexcused)) == ("B", 3, 40, 38, 38)
    w = s.unexcused[0]
    assert w.state == "running" and w.served == (("A", 1),) and "1 of 2048 budget tokens" in w.why
    assert "served instead: A (1)" in s.describe() and "steps 3-40" in s.describe()


def test_the_bound_counts_unexcused_steps_of_one_wait():
    a, b = Req("A", 0), Req("B", 0)
    head = [Step({"A": 16, "B": 16})]
    at_bound = head + [Step({"A": 1}) for _ in range(STALL_STEPS)] + [Step({"A": 1, "B": 1})]
    assert stalls(*build([a, b], at_bound)) == {}
    past = head + [Step({"A": 1}) for _ in range(STALL_STEPS + 1)] + [Step({"A": 1, "B": 1})]
    assert set(stalls(*build([a, b], past))) == {"B"}
    # Two short waits are two waits: served in between, B is not stalled.
    split = head + [Step({"A": 1}) for _ in range(STALL_STEPS)] + [Step({"A": 1, "B": 1})] + at_bound[1:]
    assert stalls(*build([a, b], split)) == {}


def test_a_waiting_request_at_the_head_is_allowed_only_by_a_limit_the_record_shows():
    """B waits at the queue's head while A decodes. With the cache nearly full (2 blocks free, A's
    decode may take both, B needs up to 3) that is KV; with 900 blocks free, no seat limit and
    budget left, nothing allows it."""
    a, b = Req("A", 0), Req("B", 1, prompt=40)
    steps = [Step({"A": 16}, kv_usage=0.998)] + [Step({"A": 1}, kv_usage=0.998) for _ in range(20)]
    trace, hist = build([a, b], steps)
    assert set(excuses(trace, hist, "B")) == {"kv"} and stalls(trace, hist) == {}
    full = [Step({"A": 16})] + [Step({"A": 1}, kv_usage=0.1) for _ in range(20)]
    trace, hist = build([a, b], full)
    (s,) = stalls(trace, hist).values()
    assert s.request_id == "B" and "nothing ahead of it in the queue" in s.unexcused[0].why
    # The cache's size unknown (an older history): KV may have been short; nothing is claimed.
    trace, hist = build([a, b], full, kv_blocks=None)
    assert stalls(trace, hist) == {}
    # Seats full: max_num_seqs 1.
    trace, hist = build([a, b], full, max_num_seqs=1)
    assert set(excuses(trace, hist, "B")) == {"seats"}


def test_fcfs_puts_a_preempted_request_back_at_the_front():
    """P was preempted at step 2 and stands at the queue's front; W, sent before it was
    preempted but never admitted, waits behind it while P is not admitted (head of line)."""
    a, p, w = Req("A", 0), Req("P", 0), Req("W", 1, prompt=40)
    steps = [Step({"A": 16, "P": 16}), Step({"A": 1, "P": 1}), Step({"A": 1}, preempted=("P",))]
    steps += [Step({"A": 1}, kv_usage=0.1) for _ in range(20)]
    trace, hist = build([a, p, w], steps)
    got = excuses(trace, hist, "W")
    assert got[:2] == [None, "preemption"] and set(got[2:]) == {"queue"}
    # P itself, at the front with room to spare, is the one the record cannot excuse.
    assert set(stalls(trace, hist)) == {"P"}


def test_a_server_history_has_no_steps_and_no_verdict():
    a, b = Req("A", 0), Req("B", 0)
    trace, hist = build([a, b], [Step({"A": 16, "B": 16})] + [Step({"A": 1}) for _ in range(30)])
    server = hist.model_copy(update={"engine": "server"})
    assert spells(trace, server) == [] and stalls(trace, server) == {}


def test_check_files_a_stall_next_to_the_token_verdicts():
    a, b = Req("A", 0, max_tokens=4, finished=40), Req("B", 0, max_tokens=4, finished=41)
    steps = [Step({"A": 16, "B": 16})] + [Step({"A": 1}) for _ in range(40)] + [Step({"B": 1})]
    trace, hist = build([a, b], steps)
    refs = {}
    for rid in ("A", "B"):
        r = hist.requests[rid]
        r.token_ids, r.logprobs, r.finish_reason = [5, 6, 7, 8], [[(t, -0.1), (t + 1, -3.0)] for t in (5, 6, 7, 8)], "length"
        refs[rid] = r.model_copy()
    verdicts = {v.request_id: v for v in check(trace, [hist], refs)}
    assert verdicts["A"].class_ == "ok"
    v = verdicts["B"]
    assert v.class_ == "stall" and v.runs_diverged == 1 and v.first_divergence is None
    assert v.evidence == ["liveness"] and "served instead: A (1)" in (v.detail or "")
