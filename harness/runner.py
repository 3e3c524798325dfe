"""Run a trace K times (per arm) and compute its references: the recording the oracle checks."""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

from kvfuzz.traces import Divergence, EngineConfig, History, RequestRecord, Scoring, SendEvent, Trace, expand
from kvfuzz.traces.history import TopLogprobs
from kvfuzz.traces.result import Recording
from kvfuzz.traces.timing import FUZZED, REF_COMPUTED, REF_STORE, REF_VERIFY, REF_WAIT, SCORES, Ledger
from kvfuzz.traces.trace import Binding

from .base import Engine, reference_config
from .environment import stamp
from .refstore import (DiskTiers, ReferenceMismatch, complete, reference_key, reference_key_for, same_reference,
                       sampling_key)

if TYPE_CHECKING:
    from .refengine import ReferenceEngine


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
        # The reference engine beside the fuzzed one (harness/refengine.py; ``--reference-engines
        # 1``), which computes a trace's references while it runs; None: computed here, in turn.
        self.ahead: ReferenceEngine | None = None

    @staticmethod
    def key(engine: Engine, send: SendEvent, binding: Binding | None) -> tuple[str, str | None, str]:
        return ReferenceStore.key_for(engine.config, engine.reference_toggles, send, binding)

    @staticmethod
    def key_for(config: EngineConfig, toggles: list[str], send: SendEvent,
                binding: Binding | None) -> tuple[str, str | None, str]:
        """The memo key of ``send``'s reference on an engine of ``config`` (the reference's
        configuration) whose references run with ``toggles``."""
        digest = hashlib.sha256(repr(expand(send.prompt)).encode()).hexdigest()[:20]
        # References run with the engine's reference toggles (the clean arm's fixes). The
        # adapter is named by the weights bound at admission, not by its name: a name rebound
        # by a lifecycle event is other weights, and two names bound to one source are one.
        return (config.engine_key() + "/" + ",".join(toggles), binding.source if binding is not None else None,
                digest + "/" + json.dumps(sampling_key(send), sort_keys=True))

    def prefetch(self, engine: Engine, trace: Trace, *, upcoming: bool = False) -> None:
        """Hand ``trace``'s references that neither memory nor disk holds to the reference
        engine (``ahead``), to be computed while the fuzzed engine replays it; nothing without
        one. Per key, the longest request is asked for (it serves the shorter ones).
        ``upcoming``: a trace not yet run (``engine`` may not be its engine: its own
        configuration is asked for; only its reference toggles are ``engine``'s, the device's)."""
        ahead = self.ahead
        if ahead is None or ahead.off is not None:
            return
        config = reference_config(trace.engine if upcoming else engine.config)
        if (config.model, config.dtype) != (engine.config.model, engine.config.dtype):
            return  # another store namespace: asked for once it runs
        toggles = list(engine.reference_toggles)
        bindings = trace.bindings_at_admission()
        longest: dict[tuple[str, str | None, str], tuple[SendEvent, Binding | None]] = {}
        for s in trace.sends:
            k = self.key_for(config, toggles, s, bindings.get(s.request_id))
            if k not in longest or s.max_tokens > longest[k][0].max_tokens:
                longest[k] = (s, bindings.get(s.request_id))
        with self.ledger.span(REF_STORE):
            # Answers nobody claimed (a trace asked for ahead that ran otherwise) join the store.
            for done, tag, rec in ahead.take_answered(set(longest)) if not upcoming else ():
                self._keep_ahead(done, rec, tag)  # type: ignore[arg-type]
            ns = self.tiers.namespace(engine) if self.tiers is not None else None
            for k, (s, b) in longest.items():
                scored_prompt = s.sampling.prompt_logprobs is not None
                have = self._memo.get(k)
                if have is not None and complete(have, s.max_tokens, prompt_logprobs=scored_prompt):
                    continue
                disk_key = reference_key_for(engine, config, s, b) if self.tiers is not None else None
                if self.tiers is not None and ns is not None and disk_key is not None and self.tiers.load_reference(
                        ns, disk_key, s.max_tokens, prompt_logprobs=scored_prompt) is not None:
                    continue
                ahead.submit(k, config, engine.device, s, b, tag=(ns, disk_key) if ns is not None else None)

    def _keep_ahead(self, k: tuple[str, str | None, str], rec: RequestRecord, tag: object) -> None:
        """A reference the reference engine computed joins the store (memory, and disk under
        ``tag``: its (namespace, key), or None), counted as computed."""
        self.computed += 1
        self.ledger.count("references_computed")
        self.ledger.count("references_ahead")
        if self.tiers is not None and isinstance(tag, tuple):
            self.tiers.save_reference(tag[0], tag[1], rec)
        self._remember(k, rec)

    def ahead_status(self, engine: Engine, send: SendEvent, binding: Binding | None) -> str | None:
        """Where the reference engine is with ``send``'s reference (``ReferenceEngine.status``);
        None without one."""
        if self.ahead is None:
            return None
        return self.ahead.status(self.key_for(reference_config(engine.config), list(engine.reference_toggles), send,
                                              binding))

    def get(self, engine: Engine, send: SendEvent, binding: Binding | None) -> RequestRecord:
        """The reference of ``send`` admitted with ``binding`` (``Trace.bindings_at_admission``)."""
        # The reference's engine (speculative decoding off: a twin) is started only when a
        # reference is computed or verified here, not for a hit or one the reference engine made.
        fuzzed = engine
        config = reference_config(engine.config)
        k = self.key_for(config, list(engine.reference_toggles), send, binding)
        have = self._memo.get(k)
        scored_prompt = send.sampling.prompt_logprobs is not None
        if have is not None and complete(have, send.max_tokens, prompt_logprobs=scored_prompt):
            with self.ledger.span(REF_STORE):
                self._hit(fuzzed, send, binding, have, shared=False)
                self._memo.move_to_end(k)
            return have.model_copy(update={"request_id": send.request_id})
        disk_key = None
        if self.tiers is not None:
            with self.ledger.span(REF_STORE):
                disk_key = reference_key_for(engine, config, send, binding)
                got = self.tiers.load_reference(self.tiers.namespace(engine), disk_key, send.max_tokens,
                                                prompt_logprobs=scored_prompt)
                if got is not None:
                    self._hit(fuzzed, send, binding, got[0], shared=got[1] != self.tiers.writer)
                    self._remember(k, got[0])
                    return got[0].model_copy(update={"request_id": send.request_id})
        if self.ahead is not None and self.ahead.pending(k):
            # Computed by the reference engine: the fuzzed run waits only for what it needs now.
            with self.ledger.span(REF_WAIT):
                rec = self.ahead.wait(k)
            if rec is not None and complete(rec, send.max_tokens, prompt_logprobs=scored_prompt):
                with self.ledger.span(REF_STORE):
                    self._keep_ahead(k, rec, (self.tiers.namespace(engine), disk_key)
                                     if self.tiers is not None and disk_key is not None else None)
                # Computed elsewhere: checked like a hit (``--verify-references``), on the fuzzed engine.
                self._verify(fuzzed, send, binding, rec)
                return rec.model_copy(update={"request_id": send.request_id})
        engine = engine.reference_engine()
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
        self._verify(engine, send, binding, have)

    def _verify(self, engine: Engine, send: SendEvent, binding: Binding | None, have: RequestRecord) -> None:
        """With probability ``verify``: ``send``'s reference computed again on ``engine``'s
        reference engine and compared with ``have``."""
        if self.verify <= 0 or self._verify_rng.random() >= self.verify:
            return
        engine = engine.reference_engine()
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
           on_run: Callable[[History], None] | None = None, fuzzed: bool = False,
           upcoming: Sequence[Trace] = ()) -> Recording:
    """Replay ``trace`` ``runs`` times in each arm (arm name -> toggles; default: the trace's
    own toggles), then compute a reference for every request. ``fuzzed``: these replays are a
    campaign's fuzzed runs (their time is counted as such in the store's ledger). With a
    reference engine (``store.ahead``), ``trace``'s references and then ``upcoming``'s are
    handed to it first, and computed while the runs replay."""
    arms = {a: list(t) for a, t in arms.items()} if arms else {"default": list(trace.engine.toggles)}
    histories: list[History] = []
    store = store if store is not None else ReferenceStore()
    store.prefetch(engine, trace)  # the reference engine, if any, computes them meanwhile
    for u in upcoming:
        store.prefetch(engine, u, upcoming=True)
    for arm, toggles in arms.items():
        for k in range(runs):
            with store.ledger.span(FUZZED) if fuzzed else nullcontext():
                h = stamp(engine.replay(trace, arm=arm, run_index=k, toggles=toggles), engine.kind)
            histories.append(h)
            if on_run:
                on_run(h)
    bindings = trace.bindings_at_admission()
    refs = {s.request_id: store.get(engine, s, bindings.get(s.request_id)) for s in _reference_order(engine, trace, store)}
    references: dict[str, RequestRecord] = {}
    for s in trace.sends:
        ref = refs[s.request_id]
        # Every completion of its n is judged by it, under its own id.
        references.update({cid: ref.model_copy(update={"request_id": cid}) for cid in s.completion_ids})
    env = engine.environment()
    env.toggles = sorted({t for ts in arms.values() for t in ts})
    return Recording(trace=trace, histories=histories, references=references, environment=env, arms=arms)


def _reference_order(engine: Engine, trace: Trace, store: ReferenceStore) -> Iterator[SendEvent]:
    """``trace``'s sends in the order their references are fetched: the trace's, except that
    while the reference engine is busy with the next one, the fuzzed engine takes the last one
    it has not begun (which ``ReferenceStore.get`` then computes here) instead of waiting."""
    bindings = trace.bindings_at_admission()
    rest = list(trace.sends)
    if store.ahead is None or not store.ahead.steal:
        yield from rest
        return
    while rest:
        first = rest[0]
        if store.ahead_status(engine, first, bindings.get(first.request_id)) == "begun":
            last = next((s for s in reversed(rest[1:])
                         if store.ahead_status(engine, s, bindings.get(s.request_id)) == "queued"), None)
            if last is not None:
                rest.remove(last)
                yield last
                continue
        yield rest.pop(0)


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
