"""Liveness: a request that waited longer than vLLM's scheduler allows while others were served
(docs/oracle.md, "Liveness: how long a request may wait"). Pure, over an in-process history's
step records; a server's history has none, and there the check says nothing.

For every step in which a live request got no token while another request did, the model names
what in vLLM's scheduler allowed it (an ``Excuse``) or, when nothing did, records the step as a
``Wait`` with what the record shows. A request is **stalled** when one of its waits (the steps
between two of its scheduled steps) holds more than ``STALL_STEPS`` steps nothing allowed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from kvfuzz.traces import History, Trace

from .schedule import Moment, Replayed, replay_schedule

# What let the scheduler pass a request by in one step (docs/oracle.md, "Liveness"):
# - preemption: KV ran out in the step (the running loop may stop; nobody is admitted);
# - budget: the step's token budget was spent before the request's turn;
# - seats: max_num_seqs requests held seats (waiting requests only);
# - lora-slots: max_loras other adapters were in the step (waiting requests only);
# - queue: a waiting request ahead of it in policy order was not admitted either;
# - kv: the free blocks could not hold it (waiting requests only).
Excuse = Literal["preemption", "budget", "seats", "lora-slots", "queue", "kv"]

# The model allows no unexcused step at all: each excuse is a necessary condition of vLLM's code,
# read from the record with estimates that lean towards excusing. The margin is for passes the
# record cannot show (vLLM paths outside the model, each documented to last a step or a
# pipeline's depth); a scheduler that starves a request exceeds any constant.
STALL_STEPS = 8


@dataclass(frozen=True)
class Wait:
    """One step in which the request got no token, others were served, and nothing allowed it."""

    step: int
    state: Literal["running", "waiting"]
    served: tuple[tuple[str, int], ...]  # who was scheduled instead, and how many tokens
    why: str  # what the record shows of the step


@dataclass
class Spell:
    """One wait of a request: its steps without a token in which another request was served."""

    request_id: str
    first_step: int
    last_step: int
    waited: int = 0
    excused: Counter[str] = field(default_factory=Counter)
    unexcused: list[Wait] = field(default_factory=list)


@dataclass(frozen=True)
class Stall:
    """A stalled request's witness: its longest unexcused wait."""

    request_id: str
    first_step: int
    last_step: int
    waited: int
    excused: tuple[tuple[str, int], ...]  # excuse -> steps, for the steps that were allowed
    unexcused: tuple[Wait, ...]

    def describe(self) -> str:
        w = self.unexcused[0]
        served = ", ".join(f"{r} ({n})" for r, n in w.served[:4]) + (" …" if len(w.served) > 4 else "")
        allowed = "; allowed: " + ", ".join(f"{n} by {e}" for e, n in self.excused) if self.excused else ""
        return (f"waited {self.waited} steps ({self.first_step}-{self.last_step}) without a token while others were "
                f"served; nothing in vLLM's scheduler allows {len(self.unexcused)} of them (more than {STALL_STEPS}): "
                f"steps {_ranges([u.step for u in self.unexcused])}{allowed}. Step {w.step}: {w.state}, {w.why}; "
                f"served instead: {served}")


def _ranges(steps: list[int]) -> str:
    out: list[str] = []
    for s in steps:
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out[:6]) + (", …" if len(out) > 6 else "")


def behind(rep: Replayed, m: Moment, q: str, r: str) -> bool:
    """Whether waiting request ``q`` stands behind waiting request ``r`` in vLLM's waiting queue
    when ``m`` begins (vllm/v1/core/sched/request_queue.py). False when the record cannot tell."""
    a, b = rep.entries[q], rep.entries[r]
    if a.send == b.send:
        return False  # children of one send arrive together
    if rep.limits.policy == "priority":
        return (a.priority, a.order) > (b.priority, b.order)
    # FCFS: a preempted request is put back at the front (the latest first), the others wait in
    # arrival order behind them.
    pa, pb = m.preempted_at.get(q), m.preempted_at.get(r)
    if pa is None and pb is None:
        return a.order > b.order
    if pa is None or pb is None:
        return pa is None
    return pa < pb


def _lora_busy(rep: Replayed, m: Moment, rid: str) -> bool:
    """The step's batch already used every adapter slot, none of them on ``rid``'s adapter: vLLM
    skips it and goes on (``max_loras``)."""
    slot = rep.entries[rid].slot
    if slot is None or rep.limits.max_loras is None:
        return False
    used = {e.slot for q in m.record.scheduled if (e := rep.entries.get(q)) is not None and e.slot is not None}
    return slot not in used and len(used) >= rep.limits.max_loras


def _seats_held(rep: Replayed, m: Moment) -> int:
    """At most how many requests held a seat when the queue was served: those running when the
    step began and those admitted in it; or the engine's count after the step plus the requests
    that ended in it."""
    return max(len(m.running | m.admitted), m.record.running + m.ended)


def _kv(rep: Replayed, m: Moment, rid: str) -> tuple[int, int] | None:
    """(a floor on the free blocks when ``rid``'s turn came, a ceiling on what it needed), or
    None when the record cannot say: every other request scheduled in the step may have taken
    blocks first, a running one for its new tokens, an admitted one for its whole sequence."""
    if rep.kv_blocks is None or m.free_floor is None:
        return None
    took = 0
    for q, n in m.record.scheduled.items():
        if q == rid or q not in rep.entries:
            continue
        took += rep.blocks_ceiling(n if q in m.running else rep.tokens_ceiling(q, m))
    return m.free_floor - took, rep.blocks_ceiling(rep.tokens_ceiling(rid, m)) + rep.watermark_blocks


def excuse(rep: Replayed, m: Moment, rid: str) -> Excuse | None:
    """What allowed vLLM's scheduler (vllm/v1/core/sched/scheduler.py ``schedule``) to give live
    request ``rid`` no token in the step ``m`` begins, or None when nothing in the record does."""
    rec, lim = m.record, rep.limits
    if rec.preempted:
        return "preemption"
    left = lim.budget - sum(rec.scheduled.values())
    if rid in m.running:
        # Every running request is served, in order, until the budget is spent or KV runs out.
        return "budget" if left < 1 else None
    lora = _lora_busy(rep, m, rid)
    if any(behind(rep, m, q, rid) for q in m.admitted):
        # Someone behind it was admitted: it was skipped, which only the adapter slots allow.
        return "lora-slots" if lora else None
    if left < (1 if lim.chunked else rep.tokens_ceiling(rid, m)):
        return "budget"
    if _seats_held(rep, m) >= lim.seats:
        return "seats"
    if lora:
        return "lora-slots"
    if any(q != rid and q not in rec.scheduled and not behind(rep, m, q, rid) for q in m.waiting):
        return "queue"
    kv = _kv(rep, m, rid)
    if kv is None or kv[0] < kv[1]:
        return "kv"
    return None


def _why(rep: Replayed, m: Moment, rid: str) -> str:
    """What the record shows of a step nothing excused (the witness's words)."""
    rec, lim = m.record, rep.limits
    used = f"{sum(rec.scheduled.values())} of {lim.budget} budget tokens scheduled"
    if rid in m.running:
        return f"{used}, nothing preempted"
    passed = sorted(q for q in m.admitted if behind(rep, m, q, rid))
    if passed:
        return f"{', '.join(passed)} admitted from behind it in {lim.policy} order"
    kv = _kv(rep, m, rid)
    room = f", at least {kv[0]} KV blocks free, it needs at most {kv[1]}" if kv is not None else ""
    return f"nothing ahead of it in the queue; {used}, {_seats_held(rep, m)} of {lim.seats} seats{room}"


def spells(trace: Trace, hist: History) -> list[Spell]:
    """Every wait of every request of ``hist`` (none for a history without step records)."""
    if hist.engine != "inprocess" or not hist.steps:
        return []
    rep = replay_schedule(trace, hist)
    open_: dict[str, Spell] = {}
    done: list[Spell] = []
    for m in rep.moments:
        scheduled = m.record.scheduled
        for rid in sorted(m.live):
            if rid in scheduled:
                if rid in open_:
                    done.append(open_.pop(rid))
                continue
            if not scheduled:
                continue  # nobody progressed: a whole-engine stall, the harness's hang
            sp = open_.setdefault(rid, Spell(rid, m.record.step, m.record.step))
            sp.last_step = m.record.step
            sp.waited += 1
            why = excuse(rep, m, rid)
            if why is not None:
                sp.excused[why] += 1
            else:
                state: Literal["running", "waiting"] = "running" if rid in m.running else "waiting"
                sp.unexcused.append(Wait(m.record.step, state, tuple(scheduled.items()), _why(rep, m, rid)))
    return done + list(open_.values())


def stalls(trace: Trace, hist: History) -> dict[str, Stall]:
    """The stalled requests of one run, each with its longest unexcused wait as the witness."""
    out: dict[str, Stall] = {}
    for sp in spells(trace, hist):
        if len(sp.unexcused) <= STALL_STEPS:
            continue
        old = out.get(sp.request_id)
        if old is None or len(sp.unexcused) > len(old.unexcused):
            out[sp.request_id] = Stall(request_id=sp.request_id, first_step=sp.first_step, last_step=sp.last_step,
                                       waited=sp.waited, excused=tuple(sorted(sp.excused.items())),
                                       unexcused=tuple(sp.unexcused))
    return out
