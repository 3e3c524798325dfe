"""Causal ablation (``kvfuzz explain FINDING``; also run on each new bucket's witness in a
campaign): replay a finding with one engine mechanism taken away at a time and record which
removals make the victim's divergence disappear. kvfuzz has no stack to bucket by, but it can
switch mechanisms off and watch.

The mechanisms (``ABLATIONS``; docs/oracle.md "Causal ablation") are named as toggles name what
they need (harness/toggles, ``needs``); one the trace does not use is ``n/a``. Each ablation is
one replay judged on the victim (``Replayer.judge_victim``, ``_still_diverges``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from kvfuzz.fuzzer.shapes import embedded_bytes_per_token
from kvfuzz.oracle.buckets import CHEAP_MECHANISMS, same_key_victims
from kvfuzz.oracle.controls import primary_arm
from kvfuzz.traces import (EMBEDDED_MODEL, Ablation, CancelEvent, Divergence, Explanation, Finding, SendEvent,
                           Trace)
from kvfuzz.traces.buckets import KEY_MECHANISMS
from kvfuzz.traces.errors import BadInput, InfraError
from kvfuzz.traces.finding import SEVERITY
from kvfuzz.traces.result import Judged
from kvfuzz.traces.trace import ADAPTER_EVENT_TYPES

from .controls import one_at_a_time, replay_seconds
from .minimize import Target, choose_target
from .probe import Replayer

def _engine(trace: Trace, **update: object) -> Trace:
    return trace.model_copy(update={"engine": trace.engine.model_copy(update=update)})


def no_prefix_caching(trace: Trace) -> tuple[Trace | None, str]:
    if not trace.engine.enable_prefix_caching:
        return None, "prefix caching is already off"
    return _engine(trace, enable_prefix_caching=False), "prefix caching off"


def no_chunked_prefill(trace: Trace) -> tuple[Trace | None, str]:
    e = trace.engine
    longest = max((s.prompt.length for s in trace.sends), default=0)
    if not e.enable_chunked_prefill and longest <= e.max_num_batched_tokens:
        return None, "no prompt is split"
    budget = max(e.max_model_len, e.max_num_batched_tokens)
    return (_engine(trace, enable_chunked_prefill=False, max_num_batched_tokens=budget),
            f"chunked prefill off, token budget {budget}")


def no_kv_pressure(trace: Trace) -> tuple[Trace | None, str]:
    e = trace.engine
    if e.kv_cache_bytes is None:
        return None, "the KV cache is sized by vLLM (gpu_memory_utilization), not by the trace"
    demand = sum(s.prompt.length + s.max_tokens for s in trace.sends) + e.block_size * (len(trace.sends) + 2)
    per_token = embedded_bytes_per_token(e) if e.model == EMBEDDED_MODEL else None
    size = max(2 * demand * per_token if per_token else 8 * e.kv_cache_bytes, e.kv_cache_bytes)
    # Rounded up to a power of two: a cache size per trace would start an engine for every
    # replay of this removal; a few sizes stay in the engine pool.
    size = 1 << (size - 1).bit_length()
    return _engine(trace, kv_cache_bytes=size), f"KV cache {size / 2**20:.0f} MiB (every request fits at once)"


def no_concurrency(trace: Trace) -> tuple[Trace | None, str]:
    if len(trace.sends) < 2:
        return None, "one request"
    return (trace.model_copy(update={"events": one_at_a_time(trace, offsets=False, relative_cancels=True)}),
            "requests one at a time, in send order")


def no_cancels(trace: Trace) -> tuple[Trace | None, str]:
    if not trace.cancels:
        return None, "no cancels"
    return (trace.model_copy(update={"events": [e for e in trace.events if not isinstance(e, CancelEvent)]}),
            "every cancel removed")


def no_adapters(trace: Trace) -> tuple[Trace | None, str]:
    if not any(s.adapter for s in trace.sends):
        return None, "no adapter requests"
    # Adapter lifecycle events go too: without LoRA there is nothing to load.
    events = [e.model_copy(update={"adapter": None}) if isinstance(e, SendEvent) else e for e in trace.events
              if not isinstance(e, ADAPTER_EVENT_TYPES)]
    lora = trace.engine.lora.model_copy(update={"enabled": False, "adapters": {}})
    return _engine(trace, lora=lora).model_copy(update={"events": events}), "every request on the base model, LoRA off"


def resident_adapters(trace: Trace) -> tuple[Trace | None, str]:
    used = {s.adapter for s in trace.sends if s.adapter}
    lora = trace.engine.lora
    if not used or len(used) <= lora.max_loras:
        return None, "no more adapters than slots"
    return (_engine(trace, lora=lora.model_copy(update={"max_loras": len(used)})),
            f"{len(used)} adapter slots for {len(used)} adapters")


def float32(trace: Trace) -> tuple[Trace | None, str]:
    if trace.engine.dtype == "float32":
        return None, "already float32"
    return trace.model_copy(update={"engine": trace.engine.with_dtype("float32")}), "float32"


ABLATIONS: dict[str, Callable[[Trace], tuple[Trace | None, str]]] = {
    "prefix-caching": no_prefix_caching, "chunked-prefill": no_chunked_prefill, "preemption": no_kv_pressure,
    "concurrency": no_concurrency, "cancels": no_cancels, "lora": no_adapters, "lora-swaps": resident_adapters,
    "numerics": float32,
}


def _valid(trace: Trace) -> Trace:
    return Trace.model_validate(trace.model_dump(mode="json"))  # an ablation must still be a valid trace


def explain(replayer: Replayer, finding: Finding, *, victim: str | None = None,
            mechanisms: list[str] | None = None, deadline: float | None = None) -> Explanation:
    """Replay ``finding`` once per mechanism taken away, judged on its victim (default: the
    one minimization would keep). Past ``deadline`` (time.monotonic()), the mechanisms left are
    recorded as skipped."""
    t0 = time.monotonic()
    target = choose_target(finding, victim)
    arm, toggles = primary_arm(finding)
    out = Explanation(victim=target.victim, cls=target.cls, arm=arm)
    names = mechanisms or list(ABLATIONS)
    # Against a deadline, the mechanisms a key is made of go first, the ones that keep the engine
    # (no restart) first within each group; the record keeps the canonical order either way.
    order = (sorted(names, key=lambda m: (m not in KEY_MECHANISMS, m not in CHEAP_MECHANISMS))
             if deadline is not None else names)
    # The other victims of the same unexplained corruption, judged when the victim no longer corrupts.
    me = next((d for d in finding.divergences if d.request_id == target.victim and d.class_ == target.cls), None)
    others: list[str] = []
    if target.cls == "corruption" and me is not None and me.explained_by is None:
        others = sorted({d.request_id for d in same_key_victims(finding, "corruption", me.broke)
                         if d.arm == arm and d.request_id != target.victim})
    done: dict[str, Ablation] = {}
    # What one replay costs: the longest recorded run up to where the victim ended (the replay
    # stops there), then the longest ablation replay so far. None is started past the deadline.
    cost = replay_seconds(finding, [target.victim])
    for name in order:
        ablated, change = ABLATIONS[name](finding.trace)
        if ablated is None:
            done[name] = Ablation(mechanism=name, change=change, outcome="n/a")
            continue
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < cost:
            done[name] = Ablation(mechanism=name, change=change, outcome="skipped",
                                  detail="triage time box spent" if left <= 0 else
                                  f"triage time box: {left:.1f} s left, a replay takes about {cost:.1f} s")
            continue
        t_replay = time.monotonic()
        try:
            j = replayer.judge_victim(_valid(ablated), victim=target.victim, arm=arm, toggles=toggles, others=others,
                                      settle=True)
        except (BadInput, InfraError, ValueError) as e:  # e.g. vLLM rejects the changed engine
            done[name] = Ablation(mechanism=name, change=change, outcome="failed", detail=str(e).splitlines()[0][:300])
            continue
        cost = max(cost, time.monotonic() - t_replay)
        out.replays += 1
        persists = _still_diverges(j, target)
        detail = (f"no token flipped, but the logprobs drifted by {j.drift:.3g} (> {j.bound:.3g}): still wrong KV"
                  if persists and j.drifted else None)
        outcome: Literal["disappears", "persists", "moved"] = "persists" if persists else "disappears"
        # Only another victim the same cause still hits counts (the same post-condition broken,
        # or none): one corrupted by another bug in the trace is no evidence this one acts.
        still = [r for r, o in j.others if o.corrupt and o.broke == (me.broke if me is not None else None)]
        if not persists and still:
            outcome = "moved"
            detail = f"the victim is right without it, but {', '.join(still)} still corrupt(s): the cause moved"
        done[name] = Ablation(mechanism=name, change=change, victim_class=j.cls, detail=detail, outcome=outcome)
    gone = [n for n, a in done.items() if a.outcome == "disappears"]
    if gone and replayer.step_exact and (why := _unreliable(replayer, finding, target, me, arm, toggles, out)):
        for n in gone:
            done[n] = done[n].model_copy(update={"outcome": "flaky", "detail": f"{why}: no evidence"})
    out.ablations = [done[n] for n in names]
    out.seconds = round(time.monotonic() - t0, 1)
    return out


def _still_diverges(j: Judged, target: Target) -> bool:
    """The victim diverges at least as badly as in the finding, or, for corruption, flipped no
    token but drifted past noise: the removal only moved the run off the near tie it flipped at,
    the KV is as wrong as before."""
    return SEVERITY[j.cls] <= SEVERITY[target.cls] or (target.cls == "corruption" and j.drifted)


def _unreliable(replayer: Replayer, finding: Finding, target: Target, me: Divergence | None, arm: str,
                toggles: list[str], out: Explanation) -> str | None:
    """Why each "disappears" is no evidence (flaky), or None. On a step-exact engine (a wall-clock
    one's runs differ anyway) it is evidence only if the victim diverges in every replay with nothing
    removed: its own runs say so when there were several, else one control replay does. A trigger
    that depends on state earlier runs left in the engine diverges in only some runs of its witness,
    and any removal would seem to cure it."""
    if me is not None and me.runs >= 2:
        if me.runs_diverged >= me.runs:
            return None
        return f"the victim diverged in only {me.runs_diverged} of its {me.runs} runs with nothing removed"
    try:
        j = replayer.judge_victim(_valid(finding.trace), victim=target.victim, arm=arm, toggles=toggles, settle=True)
    except (BadInput, InfraError, ValueError):
        return None  # no control: the removals stand as measured
    out.replays += 1
    return None if _still_diverges(j, target) else f"replayed with nothing removed, the victim is {j.cls} too"
