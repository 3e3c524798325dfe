"""vLLM's KV bookkeeping, checked every engine step (in-process harness): which post-condition
broke, and on what (docs/oracle.md "Broken post-conditions").

An ablation says which engine mechanism a witness needs; that depends on the witness's schedule
(removing chunked prefill can make two requests finish in the same step, and then nothing is
moved at all). What a cause does to the engine's state does not: an allocator that forgets to
drop a map entry leaves an orphaned entry in every witness. So each step, right after the
scheduler's ``schedule()`` (and, for the worker's rows, once the step has run), the harness
compares vLLM's own records with each other, the way vLLM's invariants say they must agree:

- the prefix-cache map (``BlockPool.cached_block_hash_to_block``) finds a block under a hash
  only if the block carries that hash (its ``block_hash``, or one of the extra hashes of
  ``cached_block_hashes_by_block``); an entry that breaks this is *stolen* when another block
  carries the hash and the map no longer finds it there, else *orphaned*;
- a request's block at a full position carries the request's own hash for that position
  (``Request.block_hashes``), or none only while no other request holds it; it holds no block
  twice; a block's ``ref_cnt`` is at least the number of requests holding it;
- the worker's persistent-batch row of a request (``InputBatch.block_table``) lists the
  scheduler's blocks for it (``req_to_blocks``), in order; and its LoRA adapter
  (``InputBatch.request_lora_mapping``) is the request's own (``Request.lora_request``, 0 for
  none), else its tokens run through another adapter's weights (``worker-adapter``);
- each token the step computed had its KV written where its row says (the slot mapping,
  ``BlockTable.slot_mapping``): block ``row[position // block_size]``, offset
  ``position % block_size``. A token written elsewhere breaks ``worker-slot`` on its request,
  and both blocks (the one written, the one left stale) are *tainted* until their content is
  replaced: every other request that holds one (shares it, or hits it in the prefix cache
  later) breaks ``worker-slot`` too, since it reads that wrong KV;
- each position a request computed before this step (below its ``num_computed_tokens``) lies
  in a slot some token's KV was written to since its block was handed out for new content
  (``BlockPool.get_new_blocks``; the harness reports each via ``handed_out``). A request whose
  count claims a position nothing wrote reads KV never computed for it: whatever the block held
  before, zeros on a fresh one. That breaks ``held-block-unwritten`` on each such reader (the
  request itself, or a later prefix hit on the block). Each run starts on a clean slate, so
  every block a run holds was handed out in it; a block not seen handed out is not judged;
- each position a request counts as computed, before the step and after it (once
  ``update_from_output`` took its rejected drafts back), was last written with the request's
  own token there: each write is booked with the token the scheduler scheduled at its position,
  its own or a draft (``SchedulerOutput.scheduled_spec_decode_tokens``). A rejected draft's KV
  stays in its slot until the accepted token's overwrites it; a count that keeps it reads KV
  computed from a token the request does not have, and breaks ``held-block-token``;
- each block the prefix-cache map finds under a hash holds, in every slot written, the KV of the
  token the hash covers there (a request's ``block_hashes[i]`` covers its tokens in block
  ``i``): judged after the step's writes, since vLLM registers a block as the step that writes
  its last slots is scheduled. A block that holds another token's KV (a rejected draft's,
  cached under the accepted tokens' hash) breaks ``map-entry-unbacked``, latent until a hit
  reads it (that reader's ``held-block-token`` then names it, or the writer's own break that
  put the other token there: a count that kept a draft, a write sent elsewhere);
- each position the step's tokens attend to lies in a block the scheduler holds for the request:
  every earlier position under full attention, the last ``sliding_window`` positions under a
  sliding window (a token at ``p`` attends to ``p - sliding_window + 1 .. p``). A sliding-window
  group releases the blocks that left the window (``remove_skipped_blocks``: the null block in
  their place, free for others); one released while still inside it is read through the
  worker's row, which keeps its id: once another request holds it, the reader reads that
  request's KV, and breaks ``held-block-released``. A first allocation (after a prefix hit, or
  external KV) puts the null block where the skipped blocks were, in the worker's row too: one
  inside the window is read as the null block's content, and breaks it as well;
- the sequence length each attention kernel is handed for a row (the ``seq_lens`` of the
  metadata its builder returns; the harness reports each via ``kernel_built``) is the request's
  computed tokens before the step plus its scheduled ones: a kernel told fewer positions leaves
  keys out, told more it attends past the row's end (stale block-table entries). That breaks
  ``worker-seq-len`` on the row's request;
- each token the step computed was handed to the model at its own position (the runner's
  ``positions``, from which RoPE rotates its query and key): ``start .. start + n - 1`` for a
  request whose count was ``start`` before the step. A position path apart from the slot
  mapping (M-RoPE's, for one) can hand the model other positions while the KV still lands in
  the right slots, rotated wrong. That breaks ``worker-position`` on the request (not checked
  with M-RoPE, whose positions are three rows);
- each token the step computed was handed to the model as the request's own token at that
  position (the runner's ``input_ids`` against the scheduler's ``Request.all_token_ids``): a
  row whose token ids were not refreshed (a request added back after a preemption, a moved row
  copied short) feeds the model another request's token, and its KV is computed from it. That
  breaks ``worker-token`` on the request (a draft judged against the draft scheduled there;
  with prompt embeddings only the positions embedded from token ids);
- each request's next token is sampled from the hidden state of its own last scheduled token
  (the runner's ``logits_indices``; the harness reports them via ``sampled``): a runner whose
  sampled rows are counted apart from its scheduled ones (padding, a reordered batch) hands a
  request its neighbour's next token. That breaks ``worker-sample-row`` on the request (not
  checked with speculative decoding, which samples several rows a request);
- each request's row of the persistent batch carries the request's own sampling state
  (``Request.sampling_params`` against ``InputBatch``): its allowed-token mask, its logit bias
  and ``min_tokens`` entries (the built-in logits processors' per-row state), its bad words, its
  penalties and the output tokens they count, its temperature and top-k, and a generator only
  when it has a seed. A row that moved (``condense``, ``swap_states``) without its state, or a
  reused row that kept its previous request's, breaks ``worker-sampling`` on the request: it
  chooses its tokens by another request's rules (on right KV, so nothing derives from it);
- a block is read by one request only as the KV of the tokens it holds: once a request broke a
  harmful post-condition (it read wrong KV, or was handed a wrong position, token, length,
  adapter or slot), the KV it computes from that step on is wrong past the first layer, and the blocks it
  writes carry that break. Another request that holds one while it keeps its hash (a retry's
  prefix hit) reads it, and breaks ``held-block-derived``, rooted in the writer's first break
  (without this check such a reader reaches the writer's damage and breaks nothing). A wrong
  sampled row derives nothing: the KV after it is right for the tokens it follows.

Each break is recorded once (per block for the map; per request and name otherwise) into the
history; the oracle (oracle/postconditions.py) names the first harmful one on a diverging
request's own path, by its block's latent root where it has one. Read-only and duck-typed: a vLLM release whose layout differs records nothing (the key
then falls back to the ablation verdicts), never a false break.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfuzz.traces.history import BREAKS, Break, BreakName

log = logging.getLogger(__name__)

# Breaks kept per run: the first ones carry the evidence; the rest are their consequences. A
# request's own breaks and the allocator's are capped apart (one faulty eviction orphans every
# block of a request; those must not crowd out the victim's break that points back to them).
MAX_BREAKS = 64
MAX_MAP_BREAKS = 8
# A request's breaks that say its KV read is wrong (a block of other content, one block twice)
# and so carry the latent break of their block as their root.
ROOTED: tuple[BreakName, ...] = ("held-block-foreign", "held-block-repeated", "held-block-unwritten",
                                  "held-block-token")
# A request's breaks after which its KV is not wrong: a latent count (nothing read yet), and a
# wrong sampled row (the tokens after it are computed right for what they follow).
UNDERIVED: tuple[BreakName, ...] = ("held-block-undercounted", "worker-sample-row", "worker-sampling")
# A slot's last write (per offset of a block handed out in the run): the token id the scheduler
# scheduled there, its own or a draft, whose KV the step computed. The rest are markers.
UNWRITTEN = -1  # nothing since the block was handed out
ANY = -2  # written, token unknown (not in the scheduler's records): matches any token
PAD = -3  # a padding draft (vLLM's -1): no request's token
NO_TOKEN = -4  # read side only: a position past the request's tokens
_EMPTY: np.ndarray = np.empty(0, dtype=np.int64)


def _map_blocks(value: Any) -> Iterable[Any]:
    """A map value: one block, or {block_id: block} (vLLM's BlockHashToBlockMap)."""
    return value.values() if isinstance(value, dict) else (value,)


def _hex(h: Any) -> str:
    return h[:4].hex() if isinstance(h, bytes) else str(h)[:8]


def _wrote_other(b: Break) -> bool:
    """A writer's break that explains another token's KV in its block: its writes sent elsewhere
    (``misdirects``: another position's token landed there), or its count kept a draft."""
    return BREAKS[b.name].misdirects or b.name == "held-block-token"


def _token(t: int) -> str:
    """A slot's or a position's token, as a break's detail says it."""
    return {PAD: "a padding draft", NO_TOKEN: "none (past its tokens)"}.get(t, f"token {t}")


@dataclass
class _Taint:
    """A block one of whose slots holds the wrong token's KV (or a stale one): written wrongly by
    ``writer`` at ``step``. ``hash`` is the block's prefix-cache hash once it has one; the taint
    lasts while the block keeps it (or, hashless, while only the writer holds it)."""

    writer: str
    step: int
    detail: str
    hash: Any = None
    # What a reader breaks: the slot (KV written to the wrong slot), or KV computed after the
    # writer's own break (``root``: that break's name, or its root).
    name: BreakName = "worker-slot"
    root: BreakName | None = None


class Monitor:
    """One run's post-condition checks: ``after_schedule`` right after the scheduler's
    ``schedule()`` (a request that finishes in this step is freed before the step ends, and its
    state must be seen while it is alive), ``after_step`` once the step is done (the worker's
    rows against the blocks that step was scheduled with). ``step`` is the engine
    step being run; ``ext`` maps vLLM's request ids to the trace's."""

    def __init__(self, ext: Callable[[str], str] = str, *, enabled: bool = True, writes: bool = True) -> None:
        """``writes``: judge reads of unwritten slots (``held-block-unwritten``). Off with a KV
        connector, which writes the KV it loads outside the step's slot mapping."""
        self.breaks: list[Break] = []
        self.disabled = not enabled
        self.step = 0
        self.ext = ext
        self._map_broken: set[int] = set()  # blocks whose map entry broke (checked once)
        # Block -> its first latent break (a map entry, a short count), or the root that break
        # took from its writer: the root of a later request break on that block.
        self._roots: dict[int, BreakName] = {}
        self._map_recorded = 0
        self._seen: set[tuple[str, str]] = set()
        self._rows: dict[str, list[list[int]]] = {}  # request -> its block ids per group, at schedule
        self._null = 0  # the pool's null block id (vLLM's is 0), read with the rows
        # Request -> (first position, tokens) scheduled this step; the slot check's positions.
        self._spans: dict[str, tuple[int, int]] = {}
        # Request -> its own token ids at those positions, drafts included (the token check's,
        # only where all are known; a padding draft is -1, not judged), and the same as written
        # to its slots (``ANY`` where unknown, ``PAD`` for a padding draft).
        self._want_tokens: dict[str, np.ndarray] = {}
        self._write_tokens: dict[str, np.ndarray] = {}
        self._taints: dict[int, _Taint] = {}
        self._slots_off = False  # the slot check alone found another layout
        self._blocks_of: Any = ()  # the pool's blocks (by id), for a tainted block's hash
        # Block -> its slots' last writes since it was handed out (token ids, ``UNWRITTEN``...;
        # shorter than the block: the rest unwritten), and the step it was.
        self._written: dict[int, np.ndarray] = {}
        self._handed: dict[int, int] = {}
        # Block -> the request first seen holding it since it was handed out: the one whose
        # tokens should write it. A reader of a slot it never wrote, after a break that sent its
        # writes elsewhere (``BreakKind.misdirects``), reads that writer's loss. ``_unowned``:
        # blocks handed out whose first holder is not seen yet.
        self._writer: dict[int, str] = {}
        self._unowned: set[int] = set()
        # (request, group) -> its blocks already found written wherever it read them: each step
        # reads only what is new (a block's written slots only grow until it is handed out again).
        self._read_ok: dict[tuple[str, int], list[int]] = {}
        self._ok_by_block: dict[int, set[tuple[str, int]]] = {}  # block -> the entries above listing it
        self._writes_off = not writes  # a step's writes went unseen: no evidence from then on
        # The prefix-cache map's entries whose block was found holding the KV of its hash's
        # tokens (key -> block), by block (a write or a handing out undoes it); the entries to
        # judge after this step's writes; the blocks already broken; and what each hash covers
        # (a request's block hash -> its tokens, from the requests' own records).
        self._backed: dict[Any, Any] = {}
        self._backed_by_block: dict[int, set[Any]] = {}
        self._to_back: list[tuple[Any, Any]] = []
        self._unbacked: set[int] = set()
        self._hash_tokens: dict[Any, np.ndarray] = {}
        self._hashed: dict[str, int] = {}  # request -> its block hashes indexed so far
        self._hash_size = 0  # tokens a request's block hash covers (``hash_block_size``)
        self._group_sizes: list[int] = []  # block size per KV cache group
        self._pool: Any = None  # the block pool (its extra hashes per block)
        # Per group: the positions a token attends to back from itself (None: all of them), or
        # absent for a kind of attention this check does not know (chunked local, Mamba, ...).
        self._windows: dict[int, int | None] = {}
        self._held_ids: Counter[int] = Counter()
        self._adapters: dict[str, int] = {}  # request scheduled this step -> its LoRA id (0: none)
        self._requests: dict[str, Any] = {}  # ... -> the scheduler's Request (its sampling state)
        self._sampling_off = False  # the sampling-state check alone found another layout
        self._kernel: list[np.ndarray] = []  # the step's kernels' sequence lengths, per row
        self._sampled: np.ndarray | None = None  # the step's sampled hidden-state row, per request
        # Request (trace id) -> its first break after which its KV is wrong, and the step's
        # written slots per request (its blocks carry that break).
        self._derives: dict[str, Break] = {}
        self._step_slots: dict[str, list[tuple[np.ndarray, int]]] = {}

    def after_schedule(self, scheduler: Any, scheduled: Mapping[str, int] | None = None,
                       drafts: Mapping[str, Iterable[int]] | None = None) -> None:
        """``scheduled``: the step's tokens per request (``SchedulerOutput.num_scheduled_tokens``),
        whose positions the slot check needs; without it slots are not checked. ``drafts``: the
        draft tokens scheduled past a request's own (``scheduled_spec_decode_tokens``), whose KV
        the step writes too; without them a draft's token is unknown (matches any)."""
        self._guarded(lambda: self._scheduler(scheduler, scheduled or {}, drafts or {}))

    def after_step(self, batch: Any | None, positions: Any | None = None, input_ids: Any | None = None) -> None:
        """The worker's rows, kernels, positions and slots only: the scheduler's state was
        checked after ``schedule()``, where blocks are allocated, hit, evicted and registered;
        the rest of a step only frees (a break it leaves is still there at the next
        ``schedule()``). ``positions``, ``input_ids``: the model runner's buffers, as the step
        left them."""
        if batch is not None:
            self._guarded(lambda: self._check_rows(self.step, batch, self.ext))
            self._guarded(lambda: self._check_lens(self.step, batch, self.ext))
            if positions is not None:
                self._guarded(lambda: self._check_positions(self.step, batch, positions, self.ext))
            if input_ids is not None:
                self._guarded(lambda: self._check_tokens(self.step, batch, input_ids, self.ext))
            if self._sampled is not None:
                self._guarded(lambda: self._check_sampled(self.step, batch, self.ext))
            if not (self._sampling_off or self.disabled or self._full):
                try:
                    self._check_sampling(self.step, batch, self.ext)
                except (AttributeError, TypeError, IndexError, KeyError, ValueError):
                    # Another layout of the batch's sampling state: only this check stops.
                    log.debug("sampling state not checked on this vLLM layout", exc_info=True)
                    self._sampling_off = True
            if not self._slots_off and not self.disabled and not self._full:
                try:
                    self._check_slots(self.step, batch, self.ext)
                except (AttributeError, TypeError, IndexError, KeyError, ValueError):
                    log.debug("slots not checked on this vLLM layout", exc_info=True)
                    self._slots_off = self._writes_off = True
            self._guarded(lambda: self._derive(self.step, self.ext))

    def kernel_built(self, metadata: Any) -> None:
        """Attention metadata a builder returned this step (what its kernel is handed)."""
        lens = getattr(metadata, "seq_lens", None)
        if self.disabled or lens is None:
            return
        try:
            self._kernel.append(_ints(lens).copy())
        except (TypeError, ValueError):
            log.debug("kernel sequence lengths not read on this layout", exc_info=True)

    def sampled(self, indices: Any) -> None:
        """The hidden-state rows the runner samples each request's next token from this step
        (``logits_indices``, one per request in the batch's order; not with speculative
        decoding, which samples several a request)."""
        if self.disabled:
            return
        try:
            self._sampled = _ints(indices).copy()
        except (TypeError, ValueError):
            log.debug("sampled rows not read on this layout", exc_info=True)

    def handed_out(self, blocks: Iterable[Any]) -> None:
        """Blocks the pool just handed out for new content (``BlockPool.get_new_blocks``): no
        slot of theirs holds KV of this content until a step writes it."""
        if self._writes_off or self.disabled:
            return
        for b in blocks:
            self._written[b.block_id] = _EMPTY
            self._handed[b.block_id] = self.step
            self._writer.pop(b.block_id, None)
            self._unowned.add(b.block_id)
            self._unbacked.discard(b.block_id)
            # A request that found it written before reads it afresh (a preempted request may be
            # handed its own old block again, at the same position).
            self._forget(b.block_id)

    def _forget(self, bid: int) -> None:
        """What was found right about block ``bid``'s content is judged again (it changed)."""
        for key in self._ok_by_block.pop(bid, ()):
            self._read_ok.pop(key, None)
        for h in self._backed_by_block.pop(bid, ()):
            self._backed.pop(h, None)

    def check(self, step: int, scheduler: Any, batch: Any | None, scheduled: Mapping[str, int] | None = None,
              *, kernels: Iterable[Any] = (), positions: Any | None = None, sampled: Any | None = None,
              input_ids: Any | None = None, drafts: Mapping[str, Iterable[int]] | None = None,
              update: Callable[[], None] | None = None) -> None:
        """Every check at once (unit tests): ``kernels``, the attention metadata the step's
        builders returned; ``sampled``, the runner's sampled rows; ``update``, what the
        scheduler's ``update_from_output`` does to its requests between the step and its
        checks (a rejected draft's rollback)."""
        self.step = step
        self.after_schedule(scheduler, scheduled, drafts)
        for metadata in kernels:
            self.kernel_built(metadata)
        if sampled is not None:
            self.sampled(sampled)
        if update is not None:
            update()
        self.after_step(batch, positions, input_ids)

    @property
    def _full(self) -> bool:
        """The requests' breaks are capped (the map's apart, ``MAX_MAP_BREAKS``)."""
        return len(self.breaks) - self._map_recorded >= MAX_BREAKS

    def _guarded(self, fn: Callable[[], None]) -> None:
        if self.disabled or self._full:
            return
        try:
            fn()
        except (AttributeError, TypeError, IndexError, KeyError, ValueError):
            # Another vLLM layout: no evidence rather than a wrong one.
            log.debug("post-conditions not checked on this vLLM layout", exc_info=True)
            self.disabled = True

    def _scheduler(self, scheduler: Any, scheduled: Mapping[str, int], drafts: Mapping[str, Iterable[int]]) -> None:
        # After ``schedule()`` a request's computed tokens already count this step's.
        self._kernel = []  # built during the step to come
        self._sampled = None
        self._step_slots = {}
        self._spans = {rid: (scheduler.requests[rid].num_computed_tokens - n, n)
                       for rid, n in scheduled.items() if rid in scheduler.requests}
        self._requests = {rid: scheduler.requests[rid] for rid in self._spans}
        self._scheduled_tokens(drafts)
        self._adapters = {rid: int(getattr(getattr(req, "lora_request", None), "lora_int_id", 0) or 0)
                          for rid, req in self._requests.items()}
        mgr = scheduler.kv_cache_manager
        pool, managers = mgr.block_pool, mgr.coordinator.single_type_managers
        if not self._windows:
            for g, m in enumerate(managers):
                kind = type(m).__name__
                if kind == "FullAttentionManager" or (kind == "SlidingWindowManager" and m.sliding_window):
                    self._windows[g] = int(m.sliding_window) if kind == "SlidingWindowManager" else None
        self._blocks_of = pool.blocks
        if pool.enable_caching:
            self._check_map(self.step, pool)
        self._check_requests(self.step, scheduler, pool, managers, self.ext)
        self._to_back = []
        if pool.enable_caching and not self._writes_off:
            self._hash_size = int(getattr(pool, "hash_block_size", 0) or 0)
            self._group_sizes = [int(m.block_size) for m in managers]
            self._index_hashes(scheduler)
            self._to_back = self._unjudged_entries(pool)

    def _scheduled_tokens(self, drafts: Mapping[str, Iterable[int]]) -> None:
        """Each scheduled request's tokens at its scheduled positions: its own, then the drafts
        scheduled past them (whose KV the step writes too, and which a rejection takes back)."""
        self._want_tokens, self._write_tokens = {}, {}
        for rid, (start, n) in self._spans.items():
            own = list(self._requests[rid].all_token_ids[start:start + n])
            extra = [int(t) if t >= 0 else PAD for t in list(drafts.get(rid, ()))[:n - len(own)]]
            got: np.ndarray = np.full(n, ANY, dtype=np.int64)
            got[:len(own) + len(extra)] = own + extra
            if len(own) + len(extra) == n:
                self._want_tokens[rid] = np.where(got == PAD, -1, got)
            self._write_tokens[rid] = got

    def _add(self, step: int, name: BreakName, *, request: str | None = None, block: int | None = None,
             detail: str = "", root: BreakName | None = None) -> None:
        if request is None:
            if self._map_recorded >= MAX_MAP_BREAKS:
                return
            self._map_recorded += 1
        elif self._full:
            return
        if root is None and name in ROOTED and block is not None:
            root = self._roots.get(block)
        b = Break(step=step, name=name, request=request, block=block, root=root, detail=detail)
        self.breaks.append(b)
        if request is not None and name not in UNDERIVED:
            self._derives.setdefault(request, b)

    # -- the prefix-cache map ------------------------------------------------------------------
    def _check_map(self, step: int, pool: Any) -> None:
        extra: dict[int, set[Any]] = getattr(pool, "cached_block_hashes_by_block", None) or {}
        table = pool.cached_block_hash_to_block
        entries: dict[Any, Any] = table._cache if hasattr(table, "_cache") else table
        # Fast path first (a lone block carrying its own key, the common case), every step.
        suspects = [(key, value) for key, value in entries.items()
                    if isinstance(value, dict) or value.block_hash != key]
        orphans = [(key, b) for key, value in suspects for b in _map_blocks(value)
                   if b.block_id not in self._map_broken and b.block_hash != key
                   and key not in extra.get(b.block_id, ())]
        if not orphans:
            return
        carriers: dict[Any, set[int]] = {}
        for b in pool.blocks:
            if b.block_hash is not None:
                carriers.setdefault(b.block_hash, set()).add(b.block_id)
        for bid, hashes in extra.items():
            for h in hashes:
                carriers.setdefault(h, set()).add(bid)
        for key, b in orphans:
            mapped = {x.block_id for x in _map_blocks(entries.get(key, ()))}
            robbed = sorted(carriers.get(key, set()) - mapped - {b.block_id})
            self._map_broken.add(b.block_id)
            self._roots.setdefault(b.block_id, "map-entry-stolen" if robbed else "map-entry-orphaned")
            if robbed:
                self._add(step, "map-entry-stolen", block=b.block_id,
                          detail=f"hash {_hex(key)} finds block {b.block_id}; block {robbed[0]} carries it")
            else:
                self._add(step, "map-entry-orphaned", block=b.block_id,
                          detail=f"hash {_hex(key)} finds block {b.block_id}, which carries "
                                 f"{_hex(b.block_hash) if b.block_hash is not None else 'no hash'}")

    # -- each request's own blocks -------------------------------------------------------------
    def _once(self, step: int, name: BreakName, rid: str, block: int, detail: str,
              root: BreakName | None = None) -> None:
        if (name, rid) not in self._seen:
            self._seen.add((name, rid))
            self._add(step, name, request=rid, block=block, detail=detail, root=root)

    def _check_requests(self, step: int, scheduler: Any, pool: Any, managers: Any, ext: Callable[[str], str]) -> None:
        """Each request's blocks; also snapshots them (``_rows``) for the worker-row check. One
        pass with list-level fast paths: this runs every step over every held block."""
        extra: dict[int, set[Any]] = getattr(pool, "cached_block_hashes_by_block", None) or {}
        null = self._null = pool.null_block.block_id
        blocks_of = pool.blocks
        holders: Counter[int] = Counter()
        rows: dict[str, list[list[int]]] = {}
        held: list[tuple[int, str, Any, list[int]]] = []
        for g, m in enumerate(managers):
            for rid, blocks in m.req_to_blocks.items():
                ids = [b.block_id for b in blocks]
                rows.setdefault(rid, []).append(ids)
                real = [i for i in ids if i != null]
                for i in self._unowned.intersection(real) if self._unowned else ():
                    self._writer[i] = ext(rid)
                    self._unowned.discard(i)
                holders.update(real)
                held.append((g, rid, blocks, ids))
                if len(set(real)) != len(real):
                    twice = next(i for n, i in enumerate(real) if i in real[:n])
                    self._once(step, "held-block-repeated", ext(rid), twice, f"group {g}: block {twice} held twice")
        self._rows = rows
        self._held_ids = holders  # block -> how many requests hold it, at this schedule
        if self._taints:
            self._check_taints(step, blocks_of, held, ext)
        # Latent first: a short count is harmless until the block is handed out again, and then
        # it is the root of the reader's foreign block (below).
        for bid, n in sorted(holders.items()):
            if blocks_of[bid].ref_cnt < n:
                self._roots.setdefault(bid, "held-block-undercounted")
                for _, rid, _, ids in held:
                    if bid in ids:
                        self._once(step, "held-block-undercounted", ext(rid), bid,
                                   f"block {bid}: ref_cnt {blocks_of[bid].ref_cnt}, {n} holders")
        if not pool.enable_caching:
            return
        hash_size = getattr(pool, "hash_block_size", None)
        for g, rid, blocks, ids in held:
            req = scheduler.requests.get(rid)
            if req is None or managers[g].block_size != hash_size:
                continue
            suffix = g.to_bytes(4, "big", signed=False)  # vLLM's BlockHashWithGroupId
            wants = [h + suffix for h in req.block_hashes[:len(blocks)]]
            if [b.block_hash for b in blocks[:len(wants)]] == wants:
                continue  # the common case: every full block carries the request's own hash
            for i, (b, want) in enumerate(zip(blocks, wants)):
                if b.is_null or b.block_hash == want:
                    continue
                if b.block_hash is None:
                    # A full block is shared only through a prefix hit, i.e. cached: one that
                    # carries no hash and another holder is being written by that holder.
                    if holders[b.block_id] > 1:
                        other = next((r for _, r, _, xs in held if r != rid and b.block_id in xs), "?")
                        self._once(step, "held-block-foreign", ext(rid), b.block_id,
                                   f"group {g} position {i}: block {b.block_id} carries no hash and is also "
                                   f"held by {ext(other)}")
                elif want not in extra.get(b.block_id, ()):
                    self._once(step, "held-block-foreign", ext(rid), b.block_id,
                               f"group {g} position {i}: block {b.block_id} carries {_hex(b.block_hash)}, "
                               f"the request's hash is {_hex(want)}")

    def _check_taints(self, step: int, blocks_of: Any, held: list[tuple[int, str, Any, list[int]]],
                      ext: Callable[[str], str]) -> None:
        """Each tainted block: kept while its content is the one written wrongly (it keeps the
        hash it had, or got while its writer held it; hashless, only its writer holds it);
        dropped once replaced or uncertain (no false break). Each other holder reads it."""
        owners: dict[int, set[str]] = {}
        for _, rid, _, ids in held:
            for i in ids:
                if i in self._taints:
                    owners.setdefault(i, set()).add(ext(rid))
        for bid, t in list(self._taints.items()):
            h = blocks_of[bid].block_hash
            holders = owners.get(bid, set())
            if t.hash is None:
                if h is None and holders == {t.writer}:
                    continue  # still being written by its writer alone
                if h is None or t.writer not in holders:
                    del self._taints[bid]  # freed hashless (handed out afresh), or uncertain
                    continue
                t.hash = h  # its writer filled and registered it
            if h != t.hash:
                del self._taints[bid]  # evicted: its next content is written afresh
                continue
            for r in sorted(holders - {t.writer}):
                self._tainted_read(step, r, bid, t)

    def _tainted_read(self, step: int, reader: str, block: int, t: _Taint) -> None:
        """``reader`` (a trace request id) holds ``block`` while it is tainted: it reads that KV."""
        if t.name == "worker-slot":
            detail = f"block {block} holds KV {t.writer} wrote to the wrong slot at step {t.step} ({t.detail})"
        else:
            detail = f"block {block} holds KV {t.writer} computed at step {t.step}, after its own {t.detail}"
        self._once(step, t.name, reader, block, detail, root=t.root)

    def _derive(self, step: int, ext: Callable[[str], str]) -> None:
        """The blocks a request wrote this step, once a break says its KV is wrong,
        carry that break for a later holder (``_check_taints``)."""
        if not self._derives:
            return
        for rid, parts in self._step_slots.items():
            writer = ext(rid)
            first = self._derives.get(writer)
            if first is None:
                continue
            for got, bs in parts:
                for blk in np.unique(got[got >= 0] // bs).tolist():
                    if 0 < blk < len(self._blocks_of) and blk not in self._taints:
                        self._taints[blk] = _Taint(writer=writer, step=step, hash=self._blocks_of[blk].block_hash,
                                                   detail=f"{first.name} at step {first.step}",
                                                   name="held-block-derived", root=first.root or first.name)

    # -- the worker's persistent batch -----------------------------------------------------------
    def _step_ids(self, batch: Any) -> list[str] | None:
        """The batch's requests in row order, or None when the batch is not this step's (a
        request it lists was not scheduled: another layout, no evidence)."""
        if not self._spans:
            return None
        ids = list(batch.req_ids[: batch.num_reqs])
        return None if any(r not in self._spans for r in ids) else ids

    def _check_lens(self, step: int, batch: Any, ext: Callable[[str], str]) -> None:
        """Each kernel's sequence length of each row against the request's computed plus
        scheduled tokens (rows in the batch's order, as the metadata was built)."""
        ids = self._step_ids(batch) if self._kernel else None
        if ids is None:
            return
        for lens in self._kernel:
            for row, rid in enumerate(ids[: len(lens)]):
                start, n = self._spans[rid]
                got = int(lens[row])
                if got != start + n:
                    self._once(step, "worker-seq-len", ext(rid), -1,
                               f"row {row}: the attention kernel is told {got} positions; the request has "
                               f"{start + n} ({start} computed before the step, {n} scheduled)")

    def _row_spans(self, ids: list[str]) -> Iterator[tuple[int, str, int, int, int]]:
        """The step's per-token buffers laid out by row: (row, request, its first position, its
        first token's offset in the buffer, its scheduled tokens), rows in the batch's order."""
        off = 0
        for row, rid in enumerate(ids):
            start, n = self._spans[rid]
            yield row, rid, start, off, n
            off += n

    def _token_rows(self, batch: Any, values: Any) -> Iterator[tuple[int, str, int, np.ndarray]]:
        """A per-token buffer of the step (positions, token ids) split by row: (row, request,
        its first position, its tokens' values), rows in the batch's order, each with its
        scheduled tokens (as for the slots). Nothing on another layout."""
        ids = self._step_ids(batch)
        if ids is None:
            return
        got_all = _ints(values[:sum(self._spans[r][1] for r in ids)])
        for row, rid, start, off, n in self._row_spans(ids):
            yield row, rid, start, got_all[off:off + n]

    def _check_positions(self, step: int, batch: Any, positions: Any, ext: Callable[[str], str]) -> None:
        """Each token's position as the model was handed it against its request's count."""
        for row, rid, start, got in self._token_rows(batch, positions):
            bad = np.nonzero(got != np.arange(start, start + len(got)))[0]
            if len(bad):
                i = int(bad[0])
                self._once(step, "worker-position", ext(rid), -1,
                           f"row {row}: the model is handed position {int(got[i])} for the token at position "
                           f"{start + i}")

    def _check_tokens(self, step: int, batch: Any, input_ids: Any, ext: Callable[[str], str]) -> None:
        """Each token the model was handed against its request's own token at that position."""
        for row, rid, start, got in self._token_rows(batch, input_ids):
            want = self._want_tokens.get(rid)
            if want is None:
                continue  # drafts scheduled beyond its tokens, not reported: not judged
            # got -1: an embedding, not a token id; want -1: a padding draft.
            bad = np.nonzero((got != want) & (got >= 0) & (want >= 0))[0]
            if len(bad):
                i = int(bad[0])
                self._once(step, "worker-token", ext(rid), -1,
                           f"row {row}: the model is handed token {int(got[i])} at position {start + i}; the "
                           f"request's token there is {int(want[i])}")

    def _check_sampled(self, step: int, batch: Any, ext: Callable[[str], str]) -> None:
        """Each request's next token is sampled from its own last scheduled token's hidden
        state (rows in the batch's order, each with its scheduled tokens, as for the positions).
        A partial prefill's sample is dropped, but vLLM takes it from the same row."""
        ids = self._step_ids(batch)
        if ids is None or self._sampled is None or len(self._sampled) != len(ids):
            return
        ends = np.cumsum([self._spans[rid][1] for rid in ids])  # one past each row's last token
        for row, rid in enumerate(ids):
            got, want = int(self._sampled[row]), int(ends[row]) - 1
            if got != want:
                owner = int(np.searchsorted(ends, got, side="right"))
                whose = f"a token of row {owner}" if owner < len(ids) else "no scheduled token"
                self._once(step, "worker-sample-row", ext(rid), -1,
                           f"row {row}: its next token is sampled from hidden state {got} ({whose}); its last "
                           f"scheduled token's is {want}")

    def _check_rows(self, step: int, batch: Any, ext: Callable[[str], str]) -> None:
        """Each request's row against the blocks it was scheduled with this step (a request
        that finished in this step is still in the batch, and its row was read)."""
        tables = batch.block_table.block_tables
        mapping = getattr(batch, "request_lora_mapping", None)
        for rid, row in batch.req_id_to_index.items():
            want_lora = self._adapters.get(rid)
            if mapping is not None and want_lora is not None and int(mapping[row]) != want_lora:
                self._once(step, "worker-adapter", ext(rid), -1,
                           f"row {row}: the worker's LoRA mapping is adapter {int(mapping[row])}, the request's is "
                           f"{want_lora}" + (" (none)" if not want_lora else ""))
            for g, want in enumerate(self._rows.get(rid, ())):
                if g >= len(tables):
                    continue
                t = tables[g]
                n = int(t.num_blocks_per_row[row])
                got = [int(x) for x in t.block_table.np[row, :n]]
                # A null block in the scheduler's row is one it dropped (a sliding-window group
                # drops blocks that left the window, ``SlidingWindowManager.remove_skipped_blocks``;
                # the worker's row keeps the old id, which no kernel reads): any id matches it.
                wrong = [i for i, (x, y) in enumerate(zip(got, want)) if x != y and y != self._null]
                if wrong or len(got) != len(want):
                    at = wrong[0] if wrong else min(len(got), len(want))
                    self._once(step, "worker-row", ext(rid), want[at] if at < len(want) else -1,
                               f"group {g} row {row}: position {at} is block "
                               f"{got[at] if at < len(got) else 'missing'}, the scheduler's is "
                               f"{want[at] if at < len(want) else 'none'} ({len(got)} vs {len(want)} blocks)")

    def _check_sampling(self, step: int, batch: Any, ext: Callable[[str], str]) -> None:
        """Each row's sampling state against its request's (``sampling_state_mismatch``)."""
        for rid, row in batch.req_id_to_index.items():
            req = self._requests.get(rid)
            params = getattr(req, "sampling_params", None)
            if req is None or params is None:
                continue
            wrong = sampling_state_mismatch(batch, rid, row, params, list(req.output_token_ids))
            if wrong:
                self._once(step, "worker-sampling", ext(rid), -1, f"row {row}: {wrong}")

    def _check_slots(self, step: int, batch: Any, ext: Callable[[str], str]) -> None:
        """Each token computed this step against its row's slot for its position (rows are laid
        out in the batch's order, each with its scheduled tokens)."""
        if not self._spans:
            return
        ids = self._step_ids(batch)
        if ids is None:
            self._writes_off = True  # this step's writes are unknown from here on
            return
        total = sum(self._spans[r][1] for r in ids)
        read: list[tuple[int, int]] = []  # (group, block size): its reads, once every write is in
        for g, t in enumerate(batch.block_table.block_tables):
            if getattr(getattr(t, "slot_mapping_mode", None), "name", "TOKEN_TO_KV_SLOT") != "TOKEN_TO_KV_SLOT" \
                    or getattr(t, "dcp_world_size", 1) != 1:
                continue  # its blocks are never marked written, so never judged unwritten either
            bs = int(t.block_size)
            got_all = t.slot_mapping.gpu[:total].cpu().numpy()
            for row, rid, start, off, n in self._row_spans(ids):
                pos = np.arange(start, start + n)
                width = int(t.num_blocks_per_row[row])
                blocks = t.block_table.np[row, :width].astype(np.int64)
                got = got_all[off:off + n]
                inside = pos // bs < width  # a missing block is the row check's (worker-row)
                want: np.ndarray = np.full(n, -1, dtype=np.int64)
                want[inside] = blocks[pos[inside] // bs] * bs + pos[inside] % bs
                bad = np.nonzero(inside & (got != want))[0]
                if not self._writes_off:
                    toks = self._write_tokens.get(rid)
                    toks = toks.copy() if toks is not None and len(toks) == n else np.full(n, ANY, dtype=np.int64)
                    toks[bad] = ANY  # written, but sent to another slot: worker-slot's, not the token checks'
                    self._wrote(got, toks, bs)
                self._step_slots.setdefault(rid, []).append((got, bs))  # a break later this step counts too
                if g in self._windows and n and rid in self._rows and g < len(self._rows[rid]):
                    self._check_held(step, g, bs, rid, self._rows[rid][g], start, n, blocks, ext)
                if not len(bad):
                    continue
                i = int(bad[0])
                p, w, x = int(pos[i]), int(want[i]), int(got[i])
                detail = (f"group {g} row {row}: position {p} written to slot {x} (block {x // bs} offset "
                          f"{x % bs}); its row's slot is {w} (block {w // bs} offset {w % bs})")
                writer = ext(rid)
                self._once(step, "worker-slot", writer, w // bs, detail)
                for j in bad:
                    for blk in (int(want[j]) // bs, int(got[j]) // bs):
                        if 0 < blk < len(self._blocks_of) and blk not in self._taints:
                            self._taints[blk] = _Taint(writer=writer, step=step, detail=detail,
                                                       hash=self._blocks_of[blk].block_hash)
            read.append((g, bs))
        # Blocks that entered the prefix-cache map before the reads: a hit taken this step on
        # one reads it after the writes, and its break is rooted in the block's.
        if not self._writes_off:
            self._check_backed(step)
        for g, bs in read:
            self._check_reads(step, g, bs, ids, ext)
        # Another holder scheduled this step read the wrong KV already (writes come first).
        for blk, taint in self._taints.items():
            if taint.step != step:
                continue
            for rid, groups in self._rows.items():
                if ext(rid) != taint.writer and any(blk in ids_ for ids_ in groups) and rid in self._spans:
                    self._tainted_read(step, ext(rid), blk, taint)

    def _wrote(self, slots: np.ndarray, tokens: np.ndarray, bs: int) -> None:
        """Records the token each of a row's slots was written with this step (where it really
        went: a wrong slot holds that token's KV now)."""
        keep = slots >= 0
        slots, tokens = slots[keep], tokens[keep]
        if not len(slots):
            return
        blocks: np.ndarray = slots // bs
        offs: np.ndarray = slots % bs
        for blk in np.unique(blocks).tolist():
            have = self._written.get(blk)
            if have is None:
                continue  # not handed out in this run: no evidence
            at = blocks == blk
            o = offs[at]
            top = int(o.max()) + 1
            if len(have) < top:
                have = np.concatenate([have, np.full(top - len(have), UNWRITTEN, dtype=np.int64)])
                self._written[blk] = have
            have[o] = tokens[at]
            if blk in self._ok_by_block or blk in self._backed_by_block:
                self._forget(blk)  # content found right changed (a wrong write: normal ones land past it)

    def _check_reads(self, step: int, g: int, bs: int, ids: list[str], ext: Callable[[str], str]) -> None:
        """Group ``g``: each scheduled request read positions ``0 .. start - 1`` through the
        scheduler's blocks for it (a null block, dropped from a sliding window, is not read),
        after this step's writes (a forward pass writes every token's KV before attention), and
        counts as computed every position below its count after the step (a rejection takes
        its drafts back): what later steps, and blocks registered from that count, read."""
        if self._writes_off:
            return
        for rid in ids:
            groups = self._rows.get(rid)
            if not groups or g >= len(groups):
                continue
            row, start = groups[g], self._spans[rid][0]
            end = self._counted(rid, start)
            key = (rid, g)
            ok = self._read_ok.get(key, [])
            first = len(ok) if row[:len(ok)] == ok else 0
            for i in range(first, min(len(row), -(-end // bs))):
                if self._misread(step, g, bs, rid, row[i], i * bs, start, end, ext):
                    break
            else:
                full = start // bs
                self._read_ok[key] = row[:full]
                for bid in row[first:full]:
                    self._ok_by_block.setdefault(bid, set()).add(key)

    def _counted(self, rid: str, start: int) -> int:
        """The positions ``rid`` counts as computed after the step, at least ``start``; just
        ``start`` for a request the step finished (freed: it reads nothing more)."""
        req = self._requests.get(rid)
        done = getattr(req, "is_finished", None)
        if req is None or (callable(done) and done()):
            return start
        return max(start, int(req.num_computed_tokens))

    def _misread(self, step: int, g: int, bs: int, rid: str, bid: int, lo: int, start: int, end: int,
                 ext: Callable[[str], str]) -> bool:
        """Block ``bid``, positions ``lo ..`` of ``rid``: each one read (below ``start``) written
        since the block was handed out (``held-block-unwritten``), each one counted (below
        ``end``) last written with the request's own token there (``held-block-token``: a
        draft's KV stays in its slot until the accepted token's overwrites it). True: broken."""
        have = self._written.get(bid)
        if bid == self._null or have is None:
            return False  # not handed out in this run: no evidence
        n = min(bs, end - lo)
        slots: np.ndarray = np.full(n, UNWRITTEN, dtype=np.int64)
        slots[:min(n, len(have))] = have[:n]
        unwritten = np.flatnonzero(slots[:max(0, start - lo)] == UNWRITTEN)
        writer = self._writer.get(bid)
        if len(unwritten):
            o = int(unwritten[0])
            lost = self._writer_break(writer, ext(rid), lambda b: BREAKS[b.name].misdirects)
            self._once(step, "held-block-unwritten", ext(rid), bid,
                       f"group {g}: position {lo + o} (block {bid} offset {o}) counts as computed, "
                       f"but nothing wrote that slot since block {bid} was handed out at step "
                       f"{self._handed.get(bid, '?')}"
                       + (f" to {writer}, after its own {lost.name} at step {lost.step}" if lost else ""),
                       root=(lost.root or lost.name) if lost is not None else None)
            return True
        taint = self._taints.get(bid)
        if taint is not None and taint.name == "worker-slot":
            return False  # a write sent to another slot: that break names every holder
        toks = list(self._requests[rid].all_token_ids[lo:lo + n])
        mine: np.ndarray = np.full(n, NO_TOKEN, dtype=np.int64)
        mine[:len(toks)] = toks
        wrong = np.flatnonzero((slots != mine) & (slots != UNWRITTEN) & (slots != ANY))
        if not len(wrong):
            return False
        o = int(wrong[0])
        prior = self._writer_break(writer, ext(rid), _wrote_other)
        when = "counts as computed after the step" if lo + o >= start else "counts as computed"
        self._once(step, "held-block-token", ext(rid), bid,
                   f"group {g}: position {lo + o} (block {bid} offset {o}) {when}, but its slot's last write is "
                   f"the KV of {_token(int(slots[o]))}; the request's token there is {_token(int(mine[o]))}"
                   + (f" (block {bid} written by {writer}, after its own {prior.name} at step {prior.step})"
                      if prior else ""),
                   root=self._roots.get(bid) or ((prior.root or prior.name) if prior is not None else None))
        return True

    def _writer_break(self, writer: str | None, reader: str, which: Callable[[Break], bool]) -> Break | None:
        """The first break of a block's writer other than its reader that says whose loss the
        reader reads (``which``), or None."""
        if writer is None or writer == reader:
            return None
        return next((b for b in self.breaks if b.request == writer and which(b)), None)

    # -- the prefix-cache map's content ---------------------------------------------------------
    def _index_hashes(self, scheduler: Any) -> None:
        """The tokens each request's new block hashes cover (a hash covers its block's tokens,
        and through its parent every token before): what a block registered under it must hold."""
        size = self._hash_size
        if size <= 0:
            return
        for rid, req in scheduler.requests.items():
            hashes = req.block_hashes
            done = self._hashed.get(rid, 0)
            if len(hashes) <= done:
                continue
            toks = req.all_token_ids
            for i in range(done, len(hashes)):
                self._hash_tokens[hashes[i]] = np.asarray(toks[i * size:(i + 1) * size], dtype=np.int64)
            self._hashed[rid] = len(hashes)

    def _unjudged_entries(self, pool: Any) -> list[tuple[Any, Any]]:
        """The map's (hash, block) pairs not yet found holding their hash's tokens: registered,
        or written, since (judged after the step's writes: a block is registered as the step
        that writes its last slots is scheduled)."""
        self._pool = pool
        table = pool.cached_block_hash_to_block
        entries: dict[Any, Any] = table._cache if hasattr(table, "_cache") else table
        backed = self._backed
        fresh = [(key, value) for key, value in entries.items() if backed.get(key) is not value]
        return [(key, b) for key, value in fresh for b in _map_blocks(value)
                if b.block_id not in self._unbacked and key not in self._backed_by_block.get(b.block_id, ())]

    def _check_backed(self, step: int) -> None:
        """Each entry: its block's slots hold the KV of the tokens its hash covers. A slot
        written with another token (a draft's, a position counted wrongly) breaks it; one never
        written is left to its reader (``held-block-unwritten``); a group whose blocks span
        several hashes is not judged."""
        pending, self._to_back = self._to_back, []
        extra: dict[int, set[Any]] = getattr(self._pool, "cached_block_hashes_by_block", None) or {}
        for key, block in pending:
            bid = block.block_id
            if block.block_hash != key and key not in extra.get(bid, ()):
                continue  # the map check's (orphaned, stolen)
            have = self._written.get(bid)
            want = self._hash_tokens.get(key[:-4]) if isinstance(key, bytes) else None
            g = int.from_bytes(key[-4:], "big") if isinstance(key, bytes) else -1
            taint = self._taints.get(bid)
            if have is not None and want is not None and 0 <= g < len(self._group_sizes) \
                    and self._group_sizes[g] == len(want) and not (taint is not None and taint.name == "worker-slot"):
                n = min(len(have), len(want))
                wrong = np.flatnonzero((have[:n] != want[:n]) & (have[:n] != UNWRITTEN) & (have[:n] != ANY))
                if len(wrong):
                    o = int(wrong[0])
                    self._unbacked_entry(step, bid, key, o, int(have[o]), int(want[o]))
                    continue
            self._backed[key] = block
            self._backed_by_block.setdefault(bid, set()).add(key)

    def _unbacked_entry(self, step: int, bid: int, key: Any, o: int, got: int, want: int) -> None:
        """Records the entry's break. Its root, which a reader's break on the block takes: the
        block writer's own break before that put another token's KV there (``_wrote_other``),
        else this break."""
        writer = self._writer.get(bid)
        prior = self._writer_break(writer, "", _wrote_other)
        root = (prior.root or prior.name) if prior is not None else None
        self._unbacked.add(bid)
        self._roots.setdefault(bid, root or "map-entry-unbacked")
        self._add(step, "map-entry-unbacked", block=bid, root=root,
                  detail=f"hash {_hex(key)} finds block {bid}, whose offset {o} holds the KV of {_token(got)}; "
                         f"the hash covers token {want} there"
                         + (f" (written by {writer}, after its own {prior.name} at step {prior.step})"
                            if prior else ""))

    def _check_held(self, step: int, g: int, bs: int, rid: str, row: list[int], start: int, n: int,
                    worker: np.ndarray, ext: Callable[[str], str]) -> None:
        """The blocks the step's tokens (positions ``start .. start + n - 1``) attend to are all
        the request's. One the scheduler released (the null block in its row) while still read
        is harmless until another request holds it: the worker's row (``worker``) still lists
        its id, so the attention then reads that request's KV. One the scheduler never gave it
        (a prefix hit's, or external KV's, blocks skipped as outside the window: the null block
        in the worker's row too) is read as the null block's content, never the request's."""
        w = self._windows[g]
        lo = 0 if w is None else max(0, start - w + 1)
        first, last = lo // bs, (start + n - 1) // bs
        span = row[first:last + 1]
        if self._null not in span:
            return  # the common case, in C
        for j, b in enumerate(span):
            i = first + j
            if b != self._null or i >= len(worker):
                continue
            read = int(worker[i])
            if read != self._null and not self._held_ids.get(read):
                continue  # released, but its content is still the request's
            where = (f"group {g}: position {max(lo, i * bs)} (block {read}) is read by the step's tokens "
                     f"{start}..{start + n - 1}" + (f" (window {w})" if w else ""))
            self._once(step, "held-block-released", ext(rid), read, where + (
                ", but the scheduler gave the request the null block there (skipped as outside the window): "
                "the attention reads the null block's content" if read == self._null else
                ", but the scheduler released that block from the request's row, and another request holds it now"))
            return


def _processor(batch: Any, name: str) -> Any | None:
    procs = getattr(batch, "logitsprocs", None)
    for p in (procs.all if procs is not None else ()):
        if type(p).__name__ == name:
            return p
    return None


def sampling_state_mismatch(batch: Any, rid: str, row: int, params: Any, output: list[int]) -> str | None:
    """What of a row's sampling state differs from its request's ``SamplingParams`` (and output
    tokens so far), or None. Only state vLLM's ``InputBatch`` keeps per row is read; a field of
    another layout raises (the monitor then stops checking: no evidence rather than a wrong one)."""
    greedy = params.temperature < 1e-5
    if not np.isclose(batch.temperature_cpu[row], 0.0 if greedy else params.temperature):
        return f"temperature {batch.temperature_cpu[row]:g}, the request's {params.temperature:g}"
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        got = float(getattr(batch, name.replace("_penalty", "_penalties") + "_cpu")[row])
        if not np.isclose(got, getattr(params, name)):
            return f"{name} {got:g}, the request's {getattr(params, name):g}"
    k = params.top_k if 0 < params.top_k < batch.vocab_size else batch.vocab_size
    if int(batch.top_k_cpu[row]) != k:
        return f"top_k {int(batch.top_k_cpu[row])}, the request's {k}"
    allowed = sorted(set(params.allowed_token_ids or ()))
    if (rid in batch.has_allowed_token_ids) != bool(allowed):
        return "an allowed-token mask" + (" missing" if allowed else " where the request has none")
    mask = batch.allowed_token_ids_mask_cpu_tensor
    if mask is not None:
        # The sampler applies every row of the mask once any request in the batch has one: an
        # unrestricted request's row must mask nothing.
        got = np.flatnonzero(~mask[row].numpy()).tolist() if allowed else []
        if allowed and got != allowed:
            return f"allowed tokens {got[:8]}, the request's {allowed[:8]}"
        if not allowed and bool(mask[row].any()):
            kept = np.flatnonzero(~mask[row].numpy()).tolist()
            return f"an allowed-token mask of {len(kept)} tokens {kept[:8]} where the request has none"
    bad = getattr(params, "bad_words_token_ids", None) or None
    if batch.bad_words_token_ids.get(row) != bad:
        return f"bad words {batch.bad_words_token_ids.get(row)}, the request's {bad}"
    if (row in batch.generators) != (params.seed is not None):
        return "a generator" + (" missing" if params.seed is not None else " where the request has no seed")
    # The output tokens penalties and min_tokens count (a prefix: the runner may hold one more).
    counted = batch.req_output_token_ids[row]
    if counted is not None and list(counted[:len(output)]) != output[:len(counted)]:
        return f"counts output tokens {list(counted)[:8]}, the request's are {output[:8]}"
    bias = _processor(batch, "LogitBiasLogitsProcessor")
    if bias is not None and (bias.biases.get(row) or None) != (params.logit_bias or None):
        return f"logit bias {bias.biases.get(row)}, the request's {params.logit_bias}"
    mins = _processor(batch, "MinTokensLogitsProcessor")
    entry = mins.min_toks.get(row) if mins is not None else None
    if entry is not None and (entry[0] != params.min_tokens or set(entry[2]) != set(params.all_stop_token_ids)):
        return f"min_tokens {entry[0]} stopping {sorted(entry[2])}, the request's {params.min_tokens} stopping " \
               f"{sorted(params.all_stop_token_ids)}"
    return None


def _ints(values: Any) -> np.ndarray:
    """A tensor (or array) as int64 numbers on the host."""
    return np.asarray(values.cpu() if hasattr(values, "cpu") else values, dtype=np.int64)


def worker_runner(core: Any) -> Any | None:
    """The in-process worker's model runner, or None on another layout."""
    try:
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return None


def worker_positions(core: Any) -> Any | None:
    """The in-process model runner's positions buffer, or None on another layout or with
    M-RoPE (three rows of positions a token)."""
    runner = worker_runner(core)
    if runner is None or getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0):
        return None
    return getattr(runner, "positions", None)


def worker_input_ids(core: Any) -> Any | None:
    """The in-process model runner's token ids buffer, or None on another layout. With prompt
    embeddings the runner embeds only the positions it marks as token ids (``is_token_ids``):
    the others read -1, which the token check does not judge."""
    runner = worker_runner(core)
    if runner is None:
        return None
    buf = getattr(runner, "input_ids", None)
    ids = getattr(buf, "gpu", buf)
    if not getattr(runner, "enable_prompt_embeds", False):
        return ids
    mask = getattr(getattr(runner, "is_token_ids", None), "np", None)
    if mask is None or ids is None:
        return None
    got = _ints(ids[:len(mask)])
    return np.where(np.asarray(mask, dtype=bool)[:len(got)], got, -1)


def worker_batch(core: Any) -> Any | None:
    """The in-process worker's persistent batch (``InputBatch``), or None on another layout."""
    return getattr(worker_runner(core), "input_batch", None)


__all__ = ["MAX_BREAKS", "Monitor", "worker_batch", "worker_input_ids", "worker_positions", "worker_runner"]
