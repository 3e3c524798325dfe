"""What vLLM's scheduler held when each recorded step began, rebuilt from an in-process history:
which requests were running and which waiting, where a waiting one stood in the waiting queue,
which adapter slot each needs, how many tokens each could have had, and a floor on free KV
blocks. Pure; the liveness check (oracle/liveness.py) judges from it, docs/oracle.md
("Liveness") says why each fact is read the way it is.

Every estimate leans the same way: towards excusing a request that got no token (fewer free
blocks, more seats held, larger needs than the engine saw), so that a stall is never an
artifact of what the record leaves out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvfuzz.traces import EngineConfig, History, StepRecord, Trace


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Limits:
    """What bounds one step of vLLM's scheduler (vllm/v1/core/sched/scheduler.py ``schedule``)."""

    budget: int  # tokens a step may schedule (max_num_batched_tokens)
    seats: int  # requests that may run at once (max_num_seqs)
    chunked: bool  # a prompt may be split over steps
    max_loras: int | None  # adapter slots a step may use; None: LoRA off
    block_size: int
    lookahead: int  # draft tokens a step may add to a request (speculative decoding)
    policy: Literal["fcfs", "priority"]
    watermark: float  # share of the cache kept free from admissions (vLLM's scheduler watermark)

    @classmethod
    def of(cls, engine: EngineConfig) -> "Limits":
        extra = engine.extra_args

        def tighter(value: int, name: str) -> int:
            # A deployment's pass-through flag can only narrow what the trace's fields allow.
            other = extra.get(name)
            return min(value, other) if isinstance(other, int) and other > 0 else value

        watermark = extra.get("watermark")
        return cls(budget=tighter(engine.max_num_batched_tokens, "max_num_scheduled_tokens"),
                   seats=tighter(engine.max_num_seqs, "max_num_active_seqs"),
                   chunked=engine.enable_chunked_prefill,
                   max_loras=engine.lora.max_loras if engine.lora.enabled else None,
                   block_size=engine.block_size,
                   lookahead=engine.speculative.num_speculative_tokens if engine.speculative else 0,
                   policy=engine.scheduling_policy or "fcfs",
                   watermark=float(watermark) if isinstance(watermark, (int, float)) else 0.0)


@dataclass(frozen=True)
class Entry:
    """One request as vLLM's scheduler knows it (each child of a send's ``n`` is one)."""

    id: str
    send: str  # its send: the children of one send arrive together, in no order among them
    order: int  # its send's place among the sends in the order the harness added them
    priority: int
    prompt_len: int
    produced: int  # tokens it generated in the whole run
    # Its adapter and how many times that name had been loaded before it was sent: the adapter
    # id vLLM counts slots by (a load takes a new id, an in-place reload keeps it).
    slot: tuple[str, int] | None
    first: int  # the step it was sent before
    last: int | None  # the last step it was live in (finished there, or cancelled after it)

    def live(self, step: int) -> bool:
        return self.first <= step and (self.last is None or step <= self.last)


@dataclass(frozen=True)
class Moment:
    """The scheduler's state when one recorded step began, as far as the history shows."""

    record: StepRecord
    live: frozenset[str]
    running: frozenset[str]  # admitted and neither preempted nor ended since
    waiting: frozenset[str]  # live and not running: in vLLM's waiting queue
    # Waiting requests that ran before: the step of their last preemption (FCFS puts them back
    # at the queue's front, the latest first).
    preempted_at: Mapping[str, int]
    # How many earlier steps scheduled each request: at most 1 + lookahead tokens each.
    served_steps: Mapping[str, int]
    # Free KV blocks after the previous step: a floor on those at this step's start (between
    # steps blocks are only freed). None: unknown.
    free_floor: int | None
    admitted: frozenset[str]  # taken from the waiting queue in this step
    ended: int  # requests whose last live step this is (they held their seats through it)


@dataclass(frozen=True)
class Replayed:
    """A history's requests and the scheduler's state at each of its steps."""

    limits: Limits
    entries: Mapping[str, Entry]
    moments: tuple[Moment, ...]
    kv_blocks: int | None
    kv_groups: int

    def tokens_ceiling(self, rid: str, m: Moment) -> int:
        """At most how many tokens ``rid`` carried when ``m`` began: its prompt and the output of
        the steps that had scheduled it (a prefill chunk produces none, a decode 1 + drafts)."""
        e = self.entries[rid]
        out = min(e.produced, m.served_steps.get(rid, 0) * (1 + self.limits.lookahead))
        return e.prompt_len + out

    def blocks_ceiling(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` can hold, in every KV cache group, draft slots included."""
        return self.kv_groups * (_cdiv(tokens + self.limits.lookahead, self.limits.block_size) + 1)

    @property
    def watermark_blocks(self) -> int:
        # vLLM keeps int(watermark * blocks) free from admissions; the ceiling is never less.
        return math.ceil(self.limits.watermark * ((self.kv_blocks or 0) + 1))


def _entries(trace: Trace, hist: History) -> dict[str, Entry]:
    sends = {s.request_id: s for s in trace.sends}
    loads: dict[str, int] = {}
    out: dict[str, Entry] = {}
    order = 0
    for ev in hist.events:
        if ev.kind == "load-adapter" and ev.adapter and ev.error is None:
            loads[ev.adapter] = loads.get(ev.adapter, 0) + 1
        if ev.kind != "send" or ev.request_id not in sends:
            continue
        send = sends[ev.request_id]
        for cid in send.completion_ids:
            rec = hist.requests.get(cid)
            if rec is None or rec.sent_step is None:
                continue
            if rec.finished_step is not None:
                last: int | None = rec.finished_step
            elif rec.cancel_step is not None:
                last = rec.cancel_step - 1  # a cancel lands before its step
            else:
                last = None
            out[cid] = Entry(id=cid, send=send.request_id, order=order, priority=send.priority,
                             prompt_len=rec.prompt_len or send.prompt.length, produced=len(rec.token_ids),
                             slot=(send.adapter, loads.get(send.adapter, 0)) if send.adapter else None,
                             first=rec.sent_step, last=last)
        order += 1
    return out


def _free_after(step: StepRecord, kv_blocks: int | None, remaining: bool) -> int | None:
    """Free blocks after ``step`` from its ``kv_usage`` (vLLM: 1 - free / blocks without the
    null one, rounded to 6 places: nearest is exact below a million blocks). A step after which
    nothing ran reports no scheduler statistics (usage 0 then means unknown) unless nothing is
    left to hold a block."""
    if kv_blocks is None:
        return None
    if step.running + step.waiting == 0:
        return None if remaining else kv_blocks
    return max(0, round((1.0 - step.kv_usage) * kv_blocks))


def replay_schedule(trace: Trace, hist: History) -> Replayed:
    """The scheduler's state at each step of ``hist`` (an in-process history; empty without
    step records)."""
    entries = _entries(trace, hist)
    running: set[str] = set()
    preempted_at: dict[str, int] = {}
    served: dict[str, int] = {}
    free: int | None = hist.kv_blocks  # each run starts on a clean slate: every block free
    moments = []
    for rec in hist.steps:
        live = frozenset(r for r, e in entries.items() if e.live(rec.step))
        run = frozenset(running & live)
        waiting = live - run
        moments.append(Moment(record=rec, live=live, running=run, waiting=waiting,
                              preempted_at={r: s for r, s in preempted_at.items() if r in waiting},
                              served_steps=dict(served), free_floor=free,
                              admitted=frozenset(r for r in rec.scheduled if r in waiting),
                              ended=sum(1 for r in live if entries[r].last == rec.step)))
        # A request both preempted and scheduled in one step was preempted by a prefix-cache
        # reset before the step and admitted again in it: it runs.
        for r in rec.preempted:
            running.discard(r)
            preempted_at[r] = rec.step
        for r in rec.scheduled:
            running.add(r)
            preempted_at.pop(r, None)
            served[r] = served.get(r, 0) + 1
        running &= {r for r, e in entries.items() if e.last is None or e.last > rec.step}
        remaining = any(e.first <= rec.step and (e.last is None or e.last > rec.step) for e in entries.values())
        free = _free_after(rec, hist.kv_blocks, remaining)
    return Replayed(limits=Limits.of(trace.engine), entries=entries, moments=tuple(moments),
                    kv_blocks=hist.kv_blocks, kv_groups=hist.kv_groups or 1)
