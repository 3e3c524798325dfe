"""Coverage feedback: which scheduler states a run reached, as a set of named buckets.

AFL counts edge hits in buckets (1, 2, 3, 4-7, ...); kvfuzz counts scheduler events the same
way. A bucket is a string such as ``preempt:2-3`` or ``step:run5-8/wait/chunk/kv50``. A
trace whose runs reach a bucket no earlier trace reached is *novel* and joins the corpus.

The in-process engine records every step (``History.steps``); a server run has no steps, so
its signature comes from the request records and the /metrics deltas (fewer buckets, same
names where they overlap). Everything here is pure data processing: no engine needed.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfuzz.traces import EventRecord, History, RequestRecord, Trace
from kvfuzz.traces.trace import ReloadAdapterEvent

from . import configs
from .lifecycle import shares_prefix
from .shapes import shared_prefix_tokens

Signature = frozenset[str]


def bucket(n: int | float) -> str:
    """AFL-style hit-count buckets: 0, 1, 2, 3, 4-7, 8-15, 16-31, 32-127, 128+."""
    n = int(n)
    if n <= 3:
        return str(max(n, 0))
    for lo, hi in ((4, 7), (8, 15), (16, 31), (32, 127)):
        if n <= hi:
            return f"{lo}-{hi}"
    return "128+"


def _size(n: int) -> str:
    """Batch / queue sizes: 0, 1, 2, 3-4, 5-8, 9-16, 17+."""
    if n <= 2:
        return str(n)
    for lo, hi in ((3, 4), (5, 8), (9, 16)):
        if n <= hi:
            return f"{lo}-{hi}"
    return "17+"


def _decile(x: float) -> int:
    return min(100, int(math.floor(max(0.0, x) * 10)) * 10)


def _ratio(hits: int, queries: int) -> str:
    if queries <= 0:
        return "none"
    r = hits / queries
    if r == 0:
        return "0"
    if r >= 1:
        return "1"
    return f"{min(3, int(r * 4)) * 25}-{min(3, int(r * 4)) * 25 + 25}"


def signature(history: History, trace: Trace | None = None) -> Signature:
    """The coverage buckets one run reached."""
    f: set[str] = set()
    adapters = {rid: r.adapter for rid, r in history.requests.items()}
    if trace is not None:
        adapters.update({s.request_id: s.adapter for s in trace.sends})
    max_loras = trace.engine.lora.max_loras if trace is not None else 2
    bs = trace.engine.block_size if trace is not None else 32

    if history.steps:
        _step_features(history, adapters, max_loras, bs, f)
        _hybrid_features(history, bs, f)
    else:
        _metric_features(history, bs, f)
    _request_features(history, bs, f)
    if trace is not None:
        # The engine's configuration region: the corpus keeps a trace per region.
        f.add(f"config:{configs.region(trace.engine)}")
        _request_state_features(history, trace, f)
        if trace.engine.speculative is not None:
            _speculative_features(history, trace, f)
    _event_features(history, f)
    if any(e.kind == RESET for e in history.events):
        _reset_features(history, trace, f)
    if is_lifecycle_run(history, trace):
        _lifecycle_features(history, trace, f)
    if history.crashed:
        f.add("crash")
    # A broken post-condition of vLLM's KV bookkeeping (harness/postconditions.py) is the
    # sanitizer's report: a trace that breaks one is kept even when no output differs yet.
    for b in history.breaks:
        f.add(f"broke:{b.root or b.name}")  # a harmful break by its block's latent root
    return frozenset(f)


def _step_features(h: History, adapters: dict[str, str | None], max_loras: int, bs: int, f: set[str]) -> None:
    preempt = evict = chunks = queries = hits = 0
    max_kv = 0.0
    max_batch = max_wait = 0
    resident: OrderedDict[str, None] = OrderedDict()  # modelled LoRA slots, least recently used first
    swaps = 0
    prefilling: set[str] = set()
    edges: Counter[str] = Counter()
    for s in h.steps:
        edges.update(s.block_edges)
        n = len(s.scheduled)
        prefills = sum(1 for t in s.scheduled.values() if t > 1)
        decodes = n - prefills
        kv = _decile(s.kv_usage)
        # Per-step state tuple: the analogue of an AFL edge (bounded: ~7*2*2*2*11 values).
        f.add(f"step:run{_size(s.running)}/{'wait' if s.waiting else 'nowait'}/"
              f"{'chunk' if s.partial_prefills else 'whole'}/{'preempt' if s.preempted else 'calm'}/kv{kv}")
        f.add(f"batch:{_size(prefills)}p+{_size(decodes)}d")
        if len(s.partial_prefills) > 1:
            f.add(f"chunk-concurrent:{_size(len(s.partial_prefills))}")
        if s.partial_prefills and decodes:
            f.add("chunk-with-decode")
        if s.preempted:
            f.add(f"preempt-kv:{kv}")
        for rid in s.preempted:
            if rid in prefilling:
                f.add("preempt-mid-prefill")
        prefilling = set(s.partial_prefills)
        preempt += len(s.preempted)
        evict += s.evictions
        chunks += len(s.partial_prefills)
        queries += s.prefix_queries
        hits += s.prefix_hits
        max_kv = max(max_kv, s.kv_usage)
        max_batch = max(max_batch, n)
        max_wait = max(max_wait, s.waiting)
        # LoRA: adapters with requests in this step, base requests beside them, slot swaps.
        live = sorted({a for r in s.scheduled if (a := adapters.get(r))})
        base = any(adapters.get(r) is None for r in s.scheduled)
        if live:
            f.add(f"lora-running:{len(live)}{'+base' if base else ''}")
        for a in live:
            if a in resident:
                resident.move_to_end(a)
            else:
                if len(resident) >= max_loras:
                    resident.popitem(last=False)
                    swaps += 1
                resident[a] = None
    # Block-lifecycle interactions (harness/blocks.py), AFL-style hit counts: the faults of
    # the reports need these (a block freed by a cancel or a preemption and taken by another
    # request), which the state buckets above do not tell apart.
    for name, n in edges.items():
        f.add(f"edge:{name}:{bucket(n)}")
    f.add(f"preempt:{bucket(preempt)}")
    f.add(f"evict:{bucket(evict)}")
    f.add(f"chunked:{bucket(chunks)}")
    f.add(f"prefix-hits:{bucket(hits // bs)}")  # in blocks
    f.add(f"prefix-ratio:{_ratio(hits, queries)}")
    f.add(f"kv-max:{_decile(max_kv)}")
    f.add(f"batch-max:{_size(max_batch)}")
    f.add(f"waiting-max:{_size(max_wait)}")
    if resident:
        f.add(f"lora-resident:{len(resident)}")
        f.add(f"lora-swaps:{bucket(swaps)}")


def _hybrid_features(h: History, bs: int, f: set[str]) -> None:
    """Several KV cache groups and a KV connector (docs/hybrid.md): prefix hits per group,
    connector-supplied tokens, admissions that take both (the vllm#44409 precondition), and
    connector admissions under KV pressure. Adds nothing for runs without either."""
    ext = admits = 0
    hits: list[int] = []
    for s in h.steps:
        for i, n in enumerate(s.group_hits):
            hits += [0] * (i + 1 - len(hits))
            hits[i] += n
        if s.external_tokens:
            ext += s.external_tokens
            admits += 1
            if len(s.group_hits) > 1 and any(s.group_hits):
                f.add("ext:with-local-hits")
            if s.preempted or s.waiting or s.kv_usage >= 0.8:
                f.add(f"ext:pressure:kv{_decile(s.kv_usage)}{'/preempt' if s.preempted else ''}"
                      f"{'/wait' if s.waiting else ''}")
        if s.cross_group_shared:
            f.add("groups:block-in-two-groups")
    if len(hits) > 1:
        for i, n in enumerate(hits):
            f.add(f"group-hits:g{i}:{bucket(n)}")
    if ext:
        f.add(f"ext-tokens:{bucket(ext // bs)}")  # in blocks
        f.add(f"ext-admissions:{bucket(admits)}")


def _metric_features(h: History, bs: int, f: set[str]) -> None:
    def delta(name: str) -> float:
        return h.metrics_after.get(name, 0.0) - h.metrics_before.get(name, 0.0)

    if not h.metrics_after:
        return
    f.add(f"preempt:{bucket(delta('vllm:num_preemptions_total'))}")
    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    f.add(f"prefix-hits:{bucket(hits // bs)}")
    f.add(f"prefix-ratio:{_ratio(int(hits), int(queries))}")
    ext = delta("vllm:external_prefix_cache_hits_total")
    if ext > 0:
        f.add(f"ext-tokens:{bucket(int(ext) // bs)}")


def _speculative_features(h: History, trace: Trace, f: set[str]) -> None:
    """Speculative decoding: its setting, how many draft tokens the run accepted, and steps
    that accepted drafts while another request prefilled or was preempted (rolled-back KV next
    to blocks changing hands)."""
    spec = trace.engine.speculative
    assert spec is not None
    f.add(f"spec:k{spec.num_speculative_tokens}/lookup{spec.prompt_lookup_min}-{spec.prompt_lookup_max}")
    accepted = sum(s.accepted_tokens for s in h.steps)
    f.add(f"{SPEC_ACCEPTED}{bucket(accepted)}")
    for s in h.steps:
        if s.accepted_tokens and (s.partial_prefills or s.preempted):
            f.add(f"spec:accepted-with-{'preempt' if s.preempted else 'prefill'}")
        if s.draft_tokens > s.accepted_tokens:
            f.add("spec:rejected")


# The feature that says how many draft tokens a run accepted (``bucket`` of the count).
SPEC_ACCEPTED = "spec-accepted:"


def _request_state_features(h: History, trace: Trace, f: set[str]) -> None:
    """Per-request state (fuzzer/requests.py): which fields a trace sets, how its requests
    finished (EOS or a stop rule, their budget, a cancel) with or without state of their own,
    and the persistent-batch rows that moved or were taken over while such requests ran."""
    state = {cid: s.per_request_fields for s in trace.sends for cid in s.completion_ids}
    for fields in state.values():
        f.update(f"field:{name}" for name in fields)
    stops = 0
    for rid, r in h.requests.items():
        if r.finish_reason is not None:
            f.add(f"finish:{r.finish_reason}/{'state' if state.get(rid) else 'plain'}")
            stops += r.finish_reason == "stop"
    f.add(f"finishes-stop:{bucket(stops)}")
    moved = [r for s in h.steps for r in s.rows_moved]
    reused = sum(s.rows_reused for s in h.steps)
    f.add(f"rows-moved:{bucket(len(moved))}")
    f.add(f"rows-reused:{bucket(reused)}")
    if moved:
        f.update(f"row-move:{'state' if state.get(r) else 'plain'}" for r in moved)
    if trace.engine.scheduling_policy == "priority" and any(s.preempted for s in h.steps):
        f.add("preempt:priority")
    for s in trace.sends:
        if s.sampling.n > 1 and any(h.requests.get(c) is not None and h.requests[c].cancelled
                                    for c in s.completion_ids):
            f.add("n-cancelled")


def _request_features(h: History, bs: int, f: set[str]) -> None:
    preempted = cached = 0
    for r in h.requests.values():
        if r.num_preemptions:
            preempted += 1
            f.add(f"req-preempted:{bucket(r.num_preemptions)}{'+done' if r.finish_reason and not r.cancelled else ''}")
        if r.num_cached_tokens:
            cached += 1
            f.add("cached:" + ("block-aligned" if r.num_cached_tokens % bs == 0 else "partial"))
            if r.adapter:
                f.add("cached:lora")
        if r.cancelled:
            f.add(f"cancel:{cancel_phase(r)}")
        if r.error:
            f.add("request-error")
    f.add(f"req-preempted-n:{bucket(preempted)}")
    f.add(f"req-cached-n:{bucket(cached)}")


def cancel_phase(r) -> str:
    """Where in its life a cancel landed: waiting (never scheduled), prefill (no token yet),
    first-token, or decode."""
    n = len(r.token_ids)
    if n == 0:
        sent = r.sent_step if r.sent_step is not None else -1
        return "prefill" if r.cancel_step is not None and r.cancel_step > sent else "waiting"
    return "first-token" if n == 1 else "decode"


def _event_features(h: History, f: set[str]) -> None:
    # A send that lands within a few steps after an effective cancel reuses the freed blocks.
    last_cancel: int | None = None
    for e in sorted(h.events, key=lambda e: (e.actual_step if e.actual_step is not None else -1, e.index)):
        if e.kind == RESET:
            continue  # _reset_features
        if e.kind == "cancel":
            if not e.effective:
                f.add("cancel:after-finish")
            elif e.actual_step is not None:
                last_cancel = e.actual_step
        elif last_cancel is not None and e.actual_step is not None and e.actual_step - last_cancel <= 4:
            f.add(f"send-after-cancel:{e.actual_step - last_cancel}")
            last_cancel = None


RESET = "reset-prefix-cache"


def _reset_features(h: History, trace: Trace | None, f: set[str]) -> None:
    """Prefix-cache resets (``reset-prefix-cache`` events; only runs with one get these, so other
    signatures are unchanged): how each landed, with or without ``reset_running_requests`` —
    done, declined (blocks still held), unreported or refused by a server — how many requests
    were in flight and how many it preempted (in-process), and requests admitted after it that
    were served cached blocks, sharing a prefix with a request admitted before it: a hit on
    blocks computed after the reset, which is where a reset's bookkeeping can go wrong."""
    events = trace.events if trace is not None else []
    sends = {s.request_id: s for s in trace.sends} if trace is not None else {}
    bs = trace.engine.block_size if trace is not None else 32
    admitted: list[str] = []
    resets: list[tuple[EventRecord, list[str]]] = []  # (reset, requests admitted before it)
    for e in h.events:  # in the order the harness applied them
        if e.kind == "send":
            admitted.append(e.request_id)
        if e.kind != RESET:
            continue
        ev = events[e.index] if 0 <= e.index < len(events) else None
        mode = "running" if getattr(ev, "reset_running_requests", False) else "plain"
        f.add(f"reset:{mode}:{'refused' if e.error else e.reset or ('done' if e.effective else 'declined')}")
        inflight = [rid for rid, r in h.requests.items() if _in_flight(e, r, rid.split("#")[0] in admitted)]
        f.add(f"reset:{mode}:in-flight:{_size(len(inflight))}")
        if e.preempted:
            f.add(f"reset:preempted:{_size(len(e.preempted))}")
        resets.append((e, list(admitted)))
    for e, before in resets:
        if not e.effective:
            continue
        for rid in admitted[len(before):]:
            r = h.requests.get(rid)
            if r is None or not r.num_cached_tokens:
                continue
            s = sends.get(rid)
            shared = s is not None and any(b in sends and min(shared_prefix_tokens(sends[b], s), s.prompt.length - 1) >= bs
                                           for b in before)
            f.add("reset:after:cached" + (":shares-prefix" if shared else ""))


LIFECYCLE_KINDS = ("load-adapter", "unload-adapter", "reload-adapter")
# A send admitted this many steps after a rebinding of its adapter counts as right after it.
AFTER_REBIND_STEPS = 8


def is_lifecycle_run(h: History, trace: Trace | None) -> bool:
    """Runs with adapter lifecycle events or an explicit CPU adapter cache (``kvfuzz run
    --lifecycle``). Only they get the lifecycle buckets, so the signatures of other campaigns
    (and with them their corpus and trace sequence) are unchanged."""
    if any(e.kind in LIFECYCLE_KINDS for e in h.events):
        return True
    return trace is not None and (bool(trace.lifecycle) or trace.engine.lora.max_cpu_loras is not None)


def _in_flight(e: EventRecord, r: RequestRecord, admitted: bool) -> bool:
    """Whether request ``r`` (already ``admitted`` when ``e`` was applied) had not ended."""
    if not admitted:
        return False
    end = r.finished_step if r.finished_step is not None else r.cancel_step
    if e.actual_step is not None and end is not None:
        return e.actual_step <= end  # an event at step s is applied before engine step s
    end_ms = r.finished_ms if r.finished_ms is not None else r.cancel_ms
    if e.actual_offset_ms is not None and end_ms is not None:
        return e.actual_offset_ms <= end_ms
    return end is None and end_ms is None


def _lifecycle_features(h: History, trace: Trace | None, f: set[str]) -> None:
    """Adapter churn: what the LoRA manager did (in-process step counters), where each
    lifecycle event landed relative to the requests in flight, requests admitted right after a
    rebinding of their adapter that share a prefix with one served under the previous weights
    (and whether they were served cached blocks), and tenants (cache_salt) sharing prompts."""
    # The LoRA manager (in-process): disk loads, CPU-LRU evictions, slot activations, in-place
    # re-reads; a step that evicts and loads is LRU churn.
    if h.steps:
        tot: Counter[str] = Counter()
        for s in h.steps:
            tot.update(loads=s.lora_loads, evictions=s.lora_evictions, slots=s.lora_slot_changes,
                       reloads=s.lora_reloads)
            if s.lora_evictions and s.lora_loads:
                f.add("lora-churn-step")
        f.add(f"lora-loads:{bucket(tot['loads'])}")
        f.add(f"lora-evictions:{bucket(tot['evictions'])}")
        f.add(f"lora-slot-changes:{bucket(tot['slots'])}")
        f.add(f"lora-reloads:{bucket(tot['reloads'])}")
    events = list(h.events)  # in the order the harness applied them
    had_weights: set[str] = set(trace.engine.lora.adapters) if trace is not None else set()
    kinds: Counter[str] = Counter()
    admitted: set[str] = set()
    rebinds: list[tuple[EventRecord, str]] = []  # (event, label)
    for e in events:
        if e.kind == "send":
            admitted.add(e.request_id)
            continue
        if e.kind not in LIFECYCLE_KINDS or e.adapter is None:
            continue
        kinds[e.kind] += 1
        if e.error:
            f.add(f"life:{e.kind}:refused")
        inflight = [r for rid, r in h.requests.items() if _in_flight(e, r, rid in admitted)]
        own = [r for r in inflight if r.adapter == e.adapter]
        if own:
            f.add(f"life:{e.kind}:own-in-flight")
        if any(r.adapter not in (None, e.adapter) for r in inflight):
            f.add(f"life:{e.kind}:others-in-flight")
        if any(r.adapter is None for r in inflight):
            f.add(f"life:{e.kind}:base-in-flight")
        if not inflight:
            f.add(f"life:{e.kind}:idle")
        if e.kind == "reload-adapter":
            ev = trace.events[e.index] if trace is not None and e.index < len(trace.events) else None
            same = ev.same_path if isinstance(ev, ReloadAdapterEvent) else None
            rebinds.append((e, "reload" if same is None else "reload-in-place" if same else "reload-new-path"))
        elif e.kind == "load-adapter" and e.adapter in had_weights:
            rebinds.append((e, "unload+load"))  # the name had weights earlier in this run
        if e.kind != "unload-adapter":
            had_weights.add(e.adapter)
    for k, n in kinds.items():
        f.add(f"life:{k}:{bucket(n)}")
    if rebinds:
        _after_rebind(h, trace, rebinds, f)
    if trace is not None:
        _salt_features(h, trace, f)


def _after_rebind(h: History, trace: Trace | None, rebinds: list[tuple[EventRecord, str]], f: set[str]) -> None:
    """Requests of a name admitted within AFTER_REBIND_STEPS steps after its rebinding; with a
    prompt prefix shared with a request of that name admitted before it (the trace says), in
    the same tenant; and served cached blocks (the run says) — a stale hit if the cache kept
    the previous weights' KV (vllm#42125, #30931)."""
    sends = {s.request_id: s for s in trace.sends} if trace is not None else {}
    for e, label in rebinds:
        if e.actual_step is None:
            continue
        before = [r for r in h.requests.values() if r.adapter == e.adapter and r.sent_step is not None
                  and r.sent_step < e.actual_step]
        for r in h.requests.values():
            if (r.adapter != e.adapter or r.sent_step is None
                    or not 0 <= r.sent_step - e.actual_step <= AFTER_REBIND_STEPS):
                continue
            if any(x is not e and x.adapter == e.adapter and x.actual_step is not None
                   and e.actual_step < x.actual_step <= r.sent_step for x, _ in rebinds):
                continue  # a later rebinding is the one this request follows
            f.add(f"life:after-{label}")
            s = sends.get(r.request_id)
            shared = [] if s is None else [b for b in before
                                           if b.request_id in sends and shares_prefix(sends[b.request_id], s)]
            if s is not None and shared:
                f.add(f"life:after-{label}:shares-prefix")
                if any(sends[b.request_id].cache_salt == s.cache_salt for b in shared):
                    f.add(f"life:after-{label}:shares-prefix:same-tenant")
            if r.num_cached_tokens:
                f.add(f"life:after-{label}:cached" + (":shares-prefix" if shared else ""))


def _salt_features(h: History, trace: Trace, f: set[str]) -> None:
    """Tenants: how many salts a run mixes, and prompts (prefixes) sent under two salts — the
    later one served cached blocks or not."""
    salted = [s for s in trace.sends if s.request_id in h.requests]
    salts = {s.cache_salt for s in salted}
    if salts == {None}:
        return
    f.add(f"salt:tenants:{len(salts - {None})}{'+none' if None in salts else ''}")
    order = sorted(salted, key=lambda s: (h.requests[s.request_id].sent_step or 0))
    for i, b in enumerate(order):
        for a in order[:i]:
            if a.cache_salt != b.cache_salt and shares_prefix(a, b):
                f.add("salt:cross-tenant-prefix" + (":cached" if h.requests[b.request_id].num_cached_tokens else ""))
                break


def trace_signature(histories: Iterable[History], trace: Trace | None = None) -> Signature:
    """Union over the runs of a trace (in-process runs are identical; server runs vary)."""
    out: set[str] = set()
    for h in histories:
        out |= signature(h, trace)
    return frozenset(out)


@dataclass
class Coverage:
    """Buckets seen so far and how many traces reached each (for rarity)."""

    hits: Counter[str] = field(default_factory=Counter)

    def novel(self, sig: Iterable[str]) -> list[str]:
        return sorted(b for b in sig if b not in self.hits)

    def add(self, sig: Iterable[str]) -> list[str]:
        """Record a trace's signature; returns the buckets it reached first."""
        new = self.novel(sig)
        self.hits.update(set(sig))
        return new

    def rarity(self, sig: Iterable[str]) -> float:
        """Sum of 1/hits over the buckets: high for traces that own rare states."""
        # Sorted: float sums must not depend on set order (string hashing is salted per process).
        return sum(1.0 / self.hits[b] for b in sorted(sig) if self.hits.get(b))

    def __len__(self) -> int:
        return len(self.hits)

    def to_json(self) -> dict[str, int]:
        return dict(sorted(self.hits.items()))

    @classmethod
    def from_json(cls, data: dict[str, int]) -> "Coverage":
        return cls(Counter({str(k): int(v) for k, v in data.items()}))
