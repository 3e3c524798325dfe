"""Run a trace K times (per arm) and compute its references: the recording the oracle checks."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from kvfuzz.traces import History, RequestRecord, SendEvent, Trace, expand
from kvfuzz.traces.result import Recording

from .base import Engine


class ReferenceStore:
    """Memoised references: each request alone on a clean cache, keyed by (engine config,
    adapter, prompt tokens). The longest run is kept; a shorter request uses its prefix
    (greedy decoding makes the first N tokens of a longer run the N-token answer).

    Bounded (least recently used out): a campaign of thousands of traces sees thousands of
    distinct prompts, and an unbounded memo would grow for as long as the campaign runs."""

    DEFAULT_MAX_ENTRIES = 4096

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._memo: OrderedDict[tuple[str, str | None, str], RequestRecord] = OrderedDict()
        self.max_entries = max(1, max_entries)
        self.computed = 0
        self.hits = 0
        self.evicted = 0

    @staticmethod
    def key(engine: Engine, send: SendEvent) -> tuple[str, str | None, str]:
        digest = hashlib.sha256(repr(expand(send.prompt)).encode()).hexdigest()[:20]
        # References run with the engine's reference toggles (the clean arm's fixes).
        config = engine.config.key() + "/" + ",".join(engine.reference_toggles)
        return (config, send.adapter, digest)

    def get(self, engine: Engine, send: SendEvent) -> RequestRecord:
        k = self.key(engine, send)
        have = self._memo.get(k)
        if have is not None and len(have.token_ids) >= send.max_tokens:
            self.hits += 1
            self._memo.move_to_end(k)
            return have.model_copy(update={"request_id": send.request_id})
        rec = engine.run_alone(send)
        self.computed += 1
        self._memo[k] = rec
        self._memo.move_to_end(k)
        while len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
            self.evicted += 1
        return rec.model_copy(update={"request_id": send.request_id})

    def __len__(self) -> int:
        return len(self._memo)


def record(engine: Engine, trace: Trace, *, runs: int = 3, arms: dict[str, list[str]] | None = None,
           store: ReferenceStore | None = None,
           on_run: Callable[[History], None] | None = None) -> Recording:
    """Replay ``trace`` ``runs`` times in each arm (arm name -> toggles; default: the trace's
    own toggles), then compute a reference for every request."""
    arms = {a: list(t) for a, t in arms.items()} if arms else {"default": list(trace.engine.toggles)}
    histories: list[History] = []
    for arm, toggles in arms.items():
        for k in range(runs):
            h = engine.replay(trace, arm=arm, run_index=k, toggles=toggles)
            histories.append(h)
            if on_run:
                on_run(h)
    store = store if store is not None else ReferenceStore()
    references = {s.request_id: store.get(engine, s) for s in trace.sends}
    env = engine.environment()
    env.toggles = sorted({t for ts in arms.values() for t in ts})
    return Recording(trace=trace, histories=histories, references=references, environment=env, arms=arms)
