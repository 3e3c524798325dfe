"""Faults kvfuzz has never seen: vLLM patches that no built-in toggle implements, installed in
every vLLM process through ``KVFUZZ_PLUGIN_MODULES`` (harness/toggles/plugin.py). Once installed
a fault is always on: to kvfuzz it is a vLLM bug that no toggle explains, as a user's own bug
would be. They try the oracle, the post-conditions and the bucket rule on corruption those were
not written for. Run one, or several separated by commas::

    PYTHONPATH=tests KVFUZZ_PLUGIN_MODULES=unseen_faults.evict_keeps_hash kvfuzz run ...

The engine tests switch faults on in their own process instead, and off again exactly
(``faults_on`` below): every ``install()`` sets its attributes through ``patch``, which records
what was there, and the engines that run under the faults are started under them and closed
with them (never pooled).

(docs/benchmarks.md, "Buckets on faults kvfuzz has never seen": the full command and each
fault's buckets). One entry per module: its letter, the vLLM component it breaks and how, and
the post-condition (harness/postconditions.py) that names its victims; a fault that breaks none
is keyed by the ablation's verdict. Each leaves a request alone unhit (most fire only in a
batch of two requests or more), so its reference, the same request alone, stays right.

- P ``evict_keeps_hash`` (the allocator): reusing a free block drops its hash metadata but leaves
  the prefix-cache map pointing at it. Names its victims: ``map-entry-orphaned``.
- Q ``short_hash_lookup`` (the prefix-cache lookup): a lookup miss falls back to a cached block
  whose hash agrees in its first 8 bits. ``held-block-foreign``.
- R ``hit_last_block_repeated`` (the prefix-cache hit's block list): a hit of two blocks or more
  lists its second-to-last block twice, its last never. ``held-block-foreign``.
- S ``register_overwrites`` (prefix-cache registration): a block registered right after another
  in one request's registration also takes over the earlier block's hash (when its own hash's
  first byte is a multiple of 4). ``map-entry-stolen``.
- T ``row_move_drops_last_block`` (the worker's persistent-batch block table): a row moved by
  ``InputBatch.condense`` keeps its length but loses its last block id. ``worker-row``.
- U ``hit_takes_no_reference`` (a prefix hit's reference count): a request whose hit ends on a
  block another running request holds takes no reference on it; the block is freed under it and
  handed to another request while it still reads it. ``held-block-undercounted`` (it needs KV
  pressure: a small KV cache).
- V ``append_repeats_first_block`` (the persistent batch's block table on append): two or more
  block ids appended to a non-empty row are written with the first one twice. ``worker-row``.
- W ``new_block_slot_in_previous`` (the worker's slot mapping): in a batch of two requests or
  more, a decode token that opens a new block is written to offset 0 of the request's previous
  block. ``worker-slot``.
- X ``decode_reads_past_row_end`` (the CPU attention metadata): in a batch of two requests or
  more, a decode whose context fills its last block exactly attends one block past its row's end
  (a stale block-table entry). ``worker-seq-len``; it may flip no token (its drift is measured:
  tests/test_explain_engine.py).
- Y ``decode_reads_neighbours_last_block`` (the CPU attention metadata's block table): in a batch
  of two or more, a decode whose last block is full reads that block from the row above (another
  request's KV). None.
- Z ``chunk_start_slot_before`` (the worker's slot mapping for prefills): in a batch of two or
  more, a prefill that starts past position 0 (a continuing chunk, or after a prefix-cache hit)
  writes its first token's KV into the slot before it. ``worker-slot``.
- AA ``moved_row_keeps_stale_last_token`` (the persistent batch's token ids): a row moved by
  ``InputBatch.condense`` is copied one token short, so its next decode feeds the model the
  departed request's token: wrong KV content in correctly recorded blocks. None in
  docs/benchmarks.md's runs; the token it feeds is the shape ``worker-token`` checks.
- AB ``hash_covers_half_block`` (the prefix cache's block hash): a full block's hash covers only
  the first half of its tokens, so prompts that agree up to a block's middle share the block.
  Requests' and blocks' hashes agree (both wrong alike). None.
- AC ``hit_counts_one_block_more`` (the prefix-cache hit's token count): a hit of two blocks or
  more reports one block more computed tokens than its blocks hold; that block's KV is never
  computed, and it is registered in the prefix cache for later hits. ``held-block-unwritten``.
- AD ``window_drops_one_block_early`` (the sliding window's block release; the hybrid model
  only): once the window slides, the oldest block still inside it is freed too, while the
  request's next tokens attend to it through the worker's row. ``held-block-released``.
- AE ``moved_row_drops_adapter`` (the persistent batch's LoRA mapping; LoRA campaigns only): a
  row moved by ``InputBatch.condense`` loses its adapter, so the moved request's remaining
  tokens run through the base model. Every block record agrees. ``worker-adapter``.
- AF ``moved_row_count_one_short`` (the persistent batch's computed-token count): a row moved by
  ``InputBatch.condense`` gets its count one short for the step after the move, so that step
  computes the moved request's token at the position before its own. ``worker-slot``; its
  findings are ``engine-crash`` hangs.
- AG ``abort_caches_partial_block`` (prefix-cache registration on abort): a request aborted in
  the middle of its prompt registers every block it was given, its partly computed last block
  too, so a retry of its prefix reads that block's unwritten tail. ``held-block-unwritten``.
- AH ``mixed_decode_misses_own_key`` (the CPU attention metadata): in a batch that mixes a
  prefill with decodes, each decode's sequence length is one short, so its query leaves out its
  own newest key. ``worker-seq-len``.
- AI ``continuing_prefill_positions_early`` (the model's positions; the default model only): in
  a batch of two or more, a prefill that starts past position 0 is handed positions one early
  after its slots were computed, so its KV lands in the right slots, rotated wrong.
  ``worker-position``.
- AJ ``write_drops_batch_last_token`` (the KV cache write): in a batch of two or more, the cache
  write covers one token fewer than the batch holds, so the batch's last token keeps its slot's
  old content. Every record and every kernel input agrees. None.
- AK ``prefill_samples_neighbours_row`` (the sampler's row index): in a batch of two or more, a
  request whose prompt ends in this step, below the first row, samples its first token from the
  row above's hidden state. No KV, record or kernel input is wrong. ``worker-sample-row``.
- AL ``readded_row_keeps_stale_tokens`` (the persistent batch's token ids): a request added back
  to the batch with output tokens (resumed after a preemption, or left out of a step) keeps its
  row's previous content where those tokens belong, so it recomputes or continues from another
  request's tokens. ``worker-token``.
- AM ``prefill_first_token_neighbours_adapter`` (the LoRA token mapping; LoRA campaigns only):
  in a batch of two or more, the first token of a multi-token row below the first runs through
  the row above's adapter, so its KV is computed with other weights. The row's adapter and every
  record agree: no post-condition checks the per-token mapping. None.
- AO ``mixed_batch_loses_causal_mask`` (the attention kernel's causal flag): a batch whose first
  row is a decode and another row computes several tokens runs without the causal mask, so those
  tokens attend to the rest of their own chunk. Every record and kernel input but the flag
  agrees. None.
- AP ``block_opening_decode_takes_neighbours_token`` (the model's input token ids): in a batch of
  two or more, a decode below the first row whose token opens a new KV block is handed the row
  above's last token. ``worker-token``, through another path than AL's.
- AQ ``returning_adapter_skips_its_weights`` (the LoRA slots' weights; LoRA campaigns with more
  adapters than slots): an adapter activated into the slot its weights were last copied to skips
  the copy, though another adapter has used the slot since, so its requests run through that
  adapter's weights. The slot table, every row's adapter and every record agree. None.
- AR ``preempting_step_drops_first_write`` (the KV cache write under KV pressure): in a step whose
  scheduling preempted a request, the cache write skips the first row's last token, so its slot
  keeps its old content. Every record and every kernel input agrees. None.
- AS ``finished_output_swaps_with_next`` (the output processor): when a request finishes in a
  step, its output and the next one carrying tokens trade them, so each request is handed the
  other's token; the engine's own state is right. None.
- AT ``batched_rows_lose_precision`` (the attention kernel's precision): in a batch of two or
  more, every row below the first has its attention output rounded to a coarser precision than
  the dtype's. Systematic drift far past the noise; nothing recorded is wrong. None.
- AU ``newest_running_left_out`` (the scheduler's running queue): while two or more requests
  run, the newest is left out of every step (its blocks kept): no token changes, the request
  just starves while the others are served. None; the liveness check names it ``stall``.
- AV ``rejected_draft_stays_counted`` (speculative decoding's rollback; speculative traces only):
  the scheduler takes a request's rejected drafts back one short, so the first rejected draft's
  KV stays counted in the slot of the token sampled in its place, and is cached under that
  token's hash once its block fills. ``held-block-token`` (its request, and a later prefix hit
  on the block), ``map-entry-unbacked`` (the block).

There is no AN: a fault in the copy of block ids to the device block table cannot fire on CPU,
where the runner's "device" buffers are its host buffers (``CPUModelRunner`` sets each ``.gpu``
to ``.cpu``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfuzz.harness.inprocess import InProcessEngine
    from kvfuzz.traces import EngineConfig

_ABSENT = object()  # the owner had no entry of its own (the attribute was inherited, or none)
# Inside ``faults_on``: the patches the ``install()`` being run makes (one list per fault).
_RECORDING: list[list[Patch]] = []


@dataclass(frozen=True)
class Patch:
    """``owner.name`` set to ``replacement``; ``before``: the owner's own entry it replaced (the
    raw one: a staticmethod, classmethod or property object as it was), or ``_ABSENT``."""

    owner: Any
    name: str
    before: Any
    replacement: Any

    def undo(self) -> str | None:
        """Put back exactly what was there (or delete the entry, when the owner had none); why
        not, when something replaced the patch since (then it is left as it is)."""
        now = vars(self.owner).get(self.name, _ABSENT)
        if now is not self.replacement:
            return (f"{_qualname(self.owner)}.{self.name} was replaced again while the fault was on "
                    f"(by {getattr(now, '__qualname__', now)!r}): its patch cannot be undone exactly")
        if self.before is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.before)
        return None


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__qualname__


def patch(owner: Any, name: str, replacement: Any) -> None:
    """``owner.name = replacement`` (a class's or a module's attribute). How every fault's
    ``install()`` changes vLLM: inside ``faults_on`` the change is recorded, and undone exactly
    when the fault goes off; through ``KVFUZZ_PLUGIN_MODULES`` it stays for the process."""
    before = vars(owner).get(name, _ABSENT)
    setattr(owner, name, replacement)
    if _RECORDING:
        _RECORDING[-1].append(Patch(owner, name, before, replacement))


def wrap(owner: Any, attr: str, tag: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace ``owner.attr`` (a function: a method or a module's function) by
    ``make(original)`` once (``install`` runs in every vLLM process and may run twice); the
    original stays reachable as ``__wrapped__``."""
    raw = vars(owner).get(attr)
    if isinstance(raw, (staticmethod, classmethod, property)):
        raise TypeError(f"{_qualname(owner)}.{attr} is a {type(raw).__name__}: wrap a function only")
    original = getattr(owner, attr)
    if getattr(original, "__unseen_tag__", None) == tag:
        return
    patched = make(original)
    patched.__unseen_tag__ = tag  # type: ignore[attr-defined]
    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patch(owner, attr, patched)


class Faults:
    """Faults switched on in this process by ``faults_on``, and the engines that run under them.

    An engine that has run under a fault holds state the fault made (block records, hashes,
    rows, adapter slots), and one started before it may have bound what the fault patches (the
    scheduler's ``schedule``, bound by the replay's hooks at the engine's start). So
    under the faults every engine that runs was started under them, and each is closed when
    they go off: ``engine(config)`` starts one, and the process's engine pool (when there is
    one) hands out only such engines, keeping its own (started before, unused meanwhile) for
    after. An engine started before that replays under the faults is an error (a ``Session``
    made before keeps its engine: make one under the faults)."""

    def __init__(self) -> None:
        self._on: dict[str, list[Patch]] = {}  # fault -> the patches its install made, in order
        self._guard: list[Patch] = []  # the engine guard's (kvfuzz's engine and pool)
        self._started: set[InProcessEngine] = set()
        self._engines: dict[tuple[str, str], InProcessEngine] = {}  # handed out, by configuration
        self._logs: list[tuple[logging.Logger, list[logging.Handler], int, bool]] = []

    @property
    def names(self) -> list[str]:
        return list(self._on)

    def patches(self, name: str) -> list[Patch]:
        """What the fault ``name`` (on) patched, in order."""
        return list(self._on[name])

    def on(self, *names: str) -> None:
        """Install the faults ``names`` (modules of this package) in this process."""
        for name in names:
            if name in self._on:
                continue
            module = importlib.import_module(f"{__name__}.{name}")
            _RECORDING.append([])
            try:
                module.install()
            finally:
                self._on[name] = _RECORDING.pop()

    def off(self, *names: str) -> None:
        """Switch the faults ``names`` off now (their engines go on, as after a fix in place);
        raises when one cannot be undone exactly."""
        problems = [p for name in names for p in self._undo(name)]
        if problems:
            raise RuntimeError("; ".join(problems))

    def _undo(self, name: str) -> list[str]:
        patches = self._on.pop(name)
        problems = [why for p in reversed(patches) if (why := p.undo())]
        reset = getattr(importlib.import_module(f"{__name__}.{name}"), "reset", None)
        if patches and reset is not None:  # state the fault keeps beside its patches (none: it was on already)
            reset()
        return [f"fault {name}: {why}" for why in problems]

    def engine(self, config: EngineConfig, *, device: str = "cpu", **options: Any) -> InProcessEngine:
        """An engine of ``config`` started under the faults (one per configuration and device:
        asked again, the same), closed when they go off. ``options``: ``InProcessEngine``'s
        (``log_file``, ``trace_deadline_s``; its defaults otherwise)."""
        from kvfuzz.harness.inprocess import InProcessEngine

        key = (config.key(), device)
        engine = self._engines.get(key)
        if engine is None or engine._llm is None:
            engine = InProcessEngine(config, device=device, **options)
            engine.start()
            self._engines[key] = engine
        elif "trace_deadline_s" in options:
            engine.trace_deadline_s = options["trace_deadline_s"]
        return engine

    def _guard_engines(self) -> None:
        from kvfuzz.harness.inprocess import InProcessEngine, engine_pool
        from kvfuzz.harness.logs import ENGINE_LOGGERS

        # An engine start routes the process's vLLM log records to its log file: put them back.
        for name in ENGINE_LOGGERS:
            lg = logging.getLogger(name)
            self._logs.append((lg, list(lg.handlers), lg.level, lg.propagate))
        _RECORDING.append(self._guard)
        try:
            start, replay, score = (vars(InProcessEngine)[n] for n in ("start", "replay", "score"))
            started, faults = self._started, self

            def start_(engine: InProcessEngine) -> InProcessEngine:
                fresh = engine._llm is None
                out = start(engine)
                if fresh:
                    started.add(engine)
                return out

            def guarded(run: Callable[..., Any]) -> Callable[..., Any]:
                def call(engine: InProcessEngine, *args: Any, **kwargs: Any) -> Any:
                    if engine not in started:
                        raise RuntimeError(f"an engine started before the faults {faults.names} runs under them "
                                           "(its state would carry the fault; use Faults.engine or the pool)")
                    return run(engine, *args, **kwargs)

                return call

            patch(InProcessEngine, "start", start_)
            patch(InProcessEngine, "replay", guarded(replay))
            patch(InProcessEngine, "score", guarded(score))
            pool = engine_pool()
            if pool is not None:
                release, discard = pool.release, pool.discard

                def acquire(config: EngineConfig, *, device: str, log_file: Any, trace_deadline_s: float | None,
                            keep: Any = None) -> InProcessEngine:
                    return faults.engine(config, device=device, log_file=log_file, trace_deadline_s=trace_deadline_s)

                def release_(engine: InProcessEngine) -> None:
                    if engine not in started:
                        release(engine)  # the faults' own are closed with them

                def discard_(engine: InProcessEngine) -> None:
                    if engine in started:
                        engine.close()
                    else:
                        discard(engine)

                patch(pool, "acquire", acquire)  # on the instance: undone by deleting the entry
                patch(pool, "release", release_)
                patch(pool, "discard", discard_)
        finally:
            _RECORDING.pop()

    def close(self) -> None:
        """Close every engine started under the faults, then switch the faults off and the
        engine guard with them; raises when something cannot be undone exactly."""
        problems: list[str] = []
        try:
            for engine in list(self._started):
                try:
                    engine.close()
                except Exception as e:  # noqa: BLE001 - every engine is closed, every patch undone
                    problems.append(f"closing an engine failed: {type(e).__name__}: {e}")
        finally:
            self._started.clear()
            self._engines.clear()
            for name in reversed(list(self._on)):
                problems += self._undo(name)
            problems += [f"engine guard: {why}" for p in reversed(self._guard) if (why := p.undo())]
            self._guard.clear()
            for lg, handlers, level, propagate in self._logs:
                for h in lg.handlers:
                    if h not in handlers:
                        h.close()
                lg.handlers[:] = handlers
                lg.setLevel(level)
                lg.propagate = propagate
            self._logs.clear()
        if problems:
            raise RuntimeError("; ".join(problems))


@contextlib.contextmanager
def faults_on(*names: str) -> Iterator[Faults]:
    """The faults ``names`` (modules of this package, e.g. ``"evict_keeps_hash"``) on in this
    process for the duration, then off again exactly, the test failed or not: every attribute
    their ``install()`` patched is as it was, and every engine that ran under them is closed.
    ``Faults.engine(config)`` gives an engine started under them; so does the engine pool."""
    faults = Faults()
    try:
        faults._guard_engines()
        faults.on(*names)
        yield faults
    finally:
        faults.close()


def attention_metadata(layer: Any) -> Any:
    """The attention metadata of ``layer`` in the step being run (faults AJ and AR, inside a
    cache write); None on paths that are not the CPU one (micro-batches)."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: not the CPU path
        return None
    return meta.get(layer.layer_name) if isinstance(meta, dict) else meta


def wrap_slot_mapping(tag: str, edit: Callable[[Any, int, int, int, Any], None]) -> None:
    """A fault in the worker's slot mapping (``BlockTable.compute_slot_mapping``, where each
    scheduled token's KV is written): after vLLM computes it, in a batch of two requests or
    more, ``edit(table, row, start, end, positions)`` may rewrite the slots of each request's
    tokens ``start:end``. A request alone is never hit, so its reference stays right."""
    from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def compute_slot_mapping(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
            original(self, num_reqs, query_start_loc, positions)
            if num_reqs < 2 or self.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                return
            starts = query_start_loc[: num_reqs + 1].tolist()
            for r in range(num_reqs):
                edit(self, r, starts[r], starts[r + 1], positions)

        return compute_slot_mapping

    wrap(BlockTable, "compute_slot_mapping", tag, make)


def wrap_attention_metadata(tag: str, edit: Callable[[Any, Any], Any]) -> None:
    """A fault in what the CPU attention kernel is told (``CPUAttentionMetadataBuilder.build``):
    in a decoder batch of two requests or more, ``edit(builder, common_attn_metadata)`` returns
    the metadata the builder is given instead. A request alone is never hit, so its reference
    stays right."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def build(self: Any, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
            m = common_attn_metadata
            if m.num_reqs >= 2 and not self.is_encoder_only_attention and not self.is_cross_attention:
                m = edit(self, m)
            return original(self, common_prefix_len, m, fast_build)

        return build

    wrap(CPUAttentionMetadataBuilder, "build", tag, make)


def wrap_condense(tag: str, moved: Callable[[Any, str, int], None]) -> None:
    """Install a fault on ``InputBatch.condense``: after the original, ``moved(batch, request,
    row)`` runs for each request it moved into a hole (faults AE and AF)."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def condense(self: Any) -> None:
            where = dict(self.req_id_to_index)
            original(self)
            for rid, i in list(self.req_id_to_index.items()):
                if i != where.get(rid):
                    moved(self, rid, i)

        return condense

    wrap(InputBatch, "condense", tag, make)
