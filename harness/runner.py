"""Run a trace K times (per arm) and compute its references: the recording the oracle checks."""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext

from kvfuzz.traces import Divergence, History, RequestRecord, Scoring, SendEvent, Trace, expand
from kvfuzz.traces.history import TopLogprobs
from kvfuzz.traces.result import Recording
from kvfuzz.traces.timing import FUZZED, REF_COMPUTED, REF_STORE, REF_VERIFY, SCORES, Ledger
from kvfuzz.traces.trace import Binding

from .base import Engine
from .environment import stamp
from .refstore import DiskTiers, ReferenceMismatch, complete, reference_key, same_reference, sampling_key


class ReferenceStore:
    """Memoised references: each request alone on a clean cache, keyed by (engine config,
    adapter, prompt tokens). The longest run is kept; a shorter request uses its prefix
    (greedy decoding makes the first N tokens of a longer run the N-token answer).

    Bounded (least recently used out): a campaign of thousands of traces sees thousands of
    distinct prompts, and an unbounded memo would grow for as long as the campaign runs."""

    DEFAULT_MAX_ENTRIES = 4096

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, tiers: DiskTiers | None = None,
                 verify: float = 0.0, ledger: Ledger | None = None, verify_seed: int = 0) -> None:
        self._memo: OrderedDict[tuple[str, str | None, str], RequestRecord] = OrderedDict()
        self.max_entries = max(1, max_entries)
        self.computed = 0
        self.hits = 0
        self.evicted = 0
        # Disk tiers behind the memo (harness/refstore.py; None: the memo alone,
        # ``--no-reference-store``'s).
        self.tiers = tiers
        # The share of hits computed again and compared (``--verify-references``).
        self.verify = verify
        self.verified = 0
        self._verify_rng = random.Random(f"kvfuzz/verify/{verify_seed}")
        self.ledger = ledger if ledger is not None else Ledger()

    @staticmethod
    def key(engine: Engine, send: SendEvent, binding: Binding | None) -> tuple[str, str | None, str]:
        digest = hashlib.sha256(repr(expand(send.prompt)).encode()).hexdigest()[:20]
        # References run with the engine's reference toggles (the clean arm's fixes). The
        # adapter is named by the weights bound at admission, not by its name: a name rebound
        # by a lifecycle event is other weights, and two names bound to one source are one.
        config = engine.config.engine_key() + "/" + ",".join(engine.reference_toggles)
        return (config, binding.source if binding is not None else None,
                digest + "/" + json.dumps(sampling_key(send), sort_keys=True))

    def get(self, engine: Engine, send: SendEvent, binding: Binding | None) -> RequestRecord:
        """The reference of ``send`` admitted with ``binding`` (``Trace.bindings_at_admission``)."""
        engine = engine.reference_engine()
        k = self.key(engine, send, binding)
        have = self._memo.get(k)
        scored_prompt = send.sampling.prompt_logprobs is not None
        if have is not None and complete(have, send.max_tokens, prompt_logprobs=scored_prompt):
            with self.ledger.span(REF_STORE):
                self._hit(engine, send, binding, have, shared=False)
                self._memo.move_to_end(k)
            return have.model_copy(update={"request_id": send.request_id})
        disk_key = None
        if self.tiers is not None:
            with self.ledger.span(REF_STORE):
                disk_key = reference_key(engine, send, binding)
                got = self.tiers.load_reference(self.tiers.namespace(engine), disk_key, send.max_tokens,
                                                prompt_logprobs=scored_prompt)
                if got is not None:
                    self._hit(engine, send, binding, got[0], shared=got[1] != self.tiers.writer)
                    self._remember(k, got[0])
                    return got[0].model_copy(update={"request_id": send.request_id})
        with self.ledger.span(REF_COMPUTED):
            rec = engine.run_alone(send, binding=binding)
            self.computed += 1
            self.ledger.count("references_computed")
            if self.tiers is not None and disk_key is not None:
                self.tiers.save_reference(self.tiers.namespace(engine), disk_key, rec)
            self._remember(k, rec)
        return rec.model_copy(update={"request_id": send.request_id})

    def _remember(self, k: tuple[str, str | None, str], rec: RequestRecord) -> None:
        self._memo[k] = rec
        self._memo.move_to_end(k)
        while len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
            self.evicted += 1

    def _hit(self, engine: Engine, send: SendEvent, binding: Binding | None, have: RequestRecord, *,
             shared: bool) -> None:
        """Count a hit, and now and then check it: the same reference computed again must agree
        (to the bit on a step-exact engine), else the store's key misses something."""
        self.hits += 1
        self.ledger.count("references_from_store")
        if shared:
            self.ledger.count("references_shared")
        if self.verify <= 0 or self._verify_rng.random() >= self.verify:
            return
        with self.ledger.span(REF_VERIFY):
            fresh = engine.run_alone(send, binding=binding)
        self.verified += 1
        self.ledger.count("references_verified")
        why = same_reference(have, fresh, exact=engine.step_exact)
        if why is not None:
            raise ReferenceMismatch(f"reference store: the stored reference of {send.request_id!r} differs from "
                                    f"the same reference computed again ({why}); rerun with --no-reference-store "
                                    f"and report it")

    def __len__(self) -> int:
        return len(self._memo)


def record(engine: Engine, trace: Trace, *, runs: int = 3, arms: dict[str, list[str]] | None = None,
           store: ReferenceStore | None = None,
           on_run: Callable[[History], None] | None = None, fuzzed: bool = False) -> Recording:
    """Replay ``trace`` ``runs`` times in each arm (arm name -> toggles; default: the trace's
    own toggles), then compute a reference for every request. ``fuzzed``: these replays are a
    campaign's fuzzed runs (their time is counted as such in the store's ledger)."""
    arms = {a: list(t) for a, t in arms.items()} if arms else {"default": list(trace.engine.toggles)}
    histories: list[History] = []
    store = store if store is not None else ReferenceStore()
    for arm, toggles in arms.items():
        for k in range(runs):
            with store.ledger.span(FUZZED) if fuzzed else nullcontext():
                h = stamp(engine.replay(trace, arm=arm, run_index=k, toggles=toggles), engine.kind)
            histories.append(h)
            if on_run:
                on_run(h)
    bindings = trace.bindings_at_admission()
    references: dict[str, RequestRecord] = {}
    for s in trace.sends:
        ref = store.get(engine, s, bindings.get(s.request_id))
        # Every completion of its n is judged by it, under its own id.
        references.update({cid: ref.model_copy(update={"request_id": cid}) for cid in s.completion_ids})
    env = engine.environment()
    env.toggles = sorted({t for ts in arms.values() for t in ts})
    return Recording(trace=trace, histories=histories, references=references, environment=env, arms=arms)


class ScoreStore:
    """Memoised teacher-forced scorings: a request's prompt plus a run's tokens, alone on a
    clean cache, keyed like references (engine configuration and reference toggles, adapter,
    prompt) plus the tokens. Runs that diverged the same way are scored once. Bounded like
    the reference memo."""

    def __init__(self, max_entries: int = ReferenceStore.DEFAULT_MAX_ENTRIES, *, tiers: DiskTiers | None = None,
                 ledger: Ledger | None = None) -> None:
        self._memo: OrderedDict[tuple[str, str | None, str, str], list[TopLogprobs]] = OrderedDict()
        self.max_entries = max(1, max_entries)
        self.computed = 0
        self.tiers = tiers
        self.ledger = ledger if ledger is not None else Ledger()

    def get(self, engine: Engine, send: SendEvent, tokens: list[int], binding: Binding | None) -> list[TopLogprobs]:
        engine = engine.reference_engine()  # teacher forcing is the reference's scoring
        config, adapter, prompt = ReferenceStore.key(engine, send, binding)
        k = (config, adapter, prompt, hashlib.sha256(repr(tokens).encode()).hexdigest()[:20])
        have = self._memo.get(k)
        if have is not None:
            self._memo.move_to_end(k)
            return have
        with self.ledger.span(SCORES):
            disk_key = None
            got = None
            if self.tiers is not None:
                disk_key = {**reference_key(engine, send, binding), "scored": [int(t) for t in tokens]}
                got = self.tiers.load_score(self.tiers.namespace(engine), disk_key)
            if got is None:
                got = engine.score(send, tokens, binding=binding)
                self.computed += 1
                if self.tiers is not None and disk_key is not None:
                    self.tiers.save_score(self.tiers.namespace(engine), disk_key, got)
        self._memo[k] = got
        while len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return got


def score_diverged(engine: Engine, rec: Recording, verdicts: list[Divergence], store: ScoreStore,
                   *, per_request: int = 3,
                   classes: tuple[str, ...] = ("corruption", "numeric-near-tie")) -> list[Scoring]:
    """Teacher-forced scorings of the runs whose tokens differ from their reference, for every
    request with a verdict of ``classes`` (at most ``per_request`` distinct token sequences each:
    enough to see how a run differs, without scoring every repeat)."""
    have = {(s.arm, s.run_index, s.request_id) for s in rec.scores}
    bindings = rec.trace.bindings_at_admission()
    out: list[Scoring] = []
    for v in verdicts:
        if v.class_ not in classes or v.request_id not in rec.references:
            continue
        ref = rec.references[v.request_id]
        send = rec.trace.send(v.request_id)
        if send.sampling.processes_logits or send.alone().embeds is not None:
            # Its run's logprobs are processed, or its prompt is no token ids: a teacher-forced
            # scoring (the model's own logits over token ids) is not comparable.
            continue
        seen: set[tuple[int, ...]] = set()
        for h in rec.histories:
            r = h.requests.get(v.request_id)
            if h.arm != v.arm or r is None or (h.arm, h.run_index, v.request_id) in have:
                continue
            toks = tuple(r.token_ids[: send.max_tokens])
            if not toks or list(toks) == ref.token_ids[: len(toks)] or toks in seen or len(seen) >= per_request:
                continue
            seen.add(toks)
            out.append(Scoring(request_id=v.request_id, arm=h.arm, run_index=h.run_index, token_ids=list(toks),
                               logprobs=store.get(engine, send, list(toks), bindings.get(v.request_id))))
    return out
