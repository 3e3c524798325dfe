"""A preempted request resumes on block ids that were reallocated (fault).

On preemption vLLM frees the request's blocks and resets ``num_computed_tokens`` to 0; on
resume it recomputes (taking prefix-cache hits only for blocks whose hash still maps to them).
With this fault the freed blocks go to the head of the free queue (as vLLM does for uncached
blocks), so the request that needed the memory is handed them at once, and the preempted
request remembers the block ids it held and how far it had computed: when it is scheduled
again it takes its full blocks back as "already computed" without checking whether they were
reallocated in between. By then they hold the other request's KV: the resumed request reads it
and its output changes. Models the "dirty recycled block" mechanism
the #39146 reporter hypothesised for the preemption path; reference counts stay exact (the
retaken blocks are touched like prefix hits), so the allocator does not assert.

Needs prefix caching on (vLLM's default): the retaken blocks enter through the prefix-hit path.
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

PREEMPT_STALE = "fault-preempt-resume-stale-blocks"
_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"
_ATTR = "_kvfuzz_preempted_blocks"


def _check() -> str | None:
    return first_problem(
        expect_params(_SCHED, "Scheduler._preempt_request", "self", "request"),
        expect_source(_SCHED, "Scheduler._preempt_request", "self._free_request_blocks(request)",
                      "request.num_computed_tokens = 0", "self.waiting.prepend_request(request)"),
        expect_source(_SCHED, "Scheduler._get_local_prefix_cache_hit", "self.kv_cache_manager.get_computed_blocks(request)"),
        expect_params(_KVM, "KVCacheManager.get_computed_blocks", "self", "request"),
        expect_source(_SCHED, "Scheduler._preempt_request", "request.status = RequestStatus.PREEMPTED"),
        expect_source("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.prepend_n", "def prepend_n"),
        expect_source(_KVM, "KVCacheManager.get_computed_blocks", "return blocks, num_new_computed_tokens, shared_prefix_boundary"),
        expect_source("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_blocks", "req_to_blocks"),
        expect_source("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager.add_local_computed_blocks",
                      "self.block_pool.touch(new_computed_blocks)"),
    )


def _patch() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    def make_preempt(original):
        def _preempt_request(self, request, *args, **kwargs):
            saved = None
            if is_active(PREEMPT_STALE) and self.kv_cache_manager.enable_caching:
                groups = self.kv_cache_manager.coordinator.get_blocks(request.request_id)
                saved = (tuple(list(g) for g in groups), request.num_computed_tokens)
            out = original(self, request, *args, **kwargs)
            if saved is not None:
                setattr(request, _ATTR, saved)
                # Hand the freed blocks out first (as vLLM does for uncached blocks): the
                # request that needed memory takes them right away, so they hold its KV by
                # the time the preempted request claims them back.
                queue = self.kv_cache_manager.block_pool.free_block_queue
                freed, seen = [], set()
                for g in saved[0]:
                    for b in g:
                        if not b.is_null and b.ref_cnt == 0 and b.block_id not in seen:
                            seen.add(b.block_id)
                            queue.remove(b)
                            freed.append(b)
                if freed:
                    queue.prepend_n(freed)
            return out

        return _preempt_request

    def make_lookup(original):
        def get_computed_blocks(self, request):
            # A waiting request is looked up every step until it fits, so the saved blocks
            # stay on the request while it is PREEMPTED (a later preemption replaces them).
            saved = request.__dict__.get(_ATTR)
            if (saved is None or request.status != RequestStatus.PREEMPTED or not is_active(PREEMPT_STALE)
                    or not self.enable_caching):
                return original(self, request)
            groups, computed = saved
            managers = self.coordinator.single_type_managers
            if len(groups) != len(managers) or len({m.block_size for m in managers}) != 1:
                return original(self, request)  # hybrid layouts: not modelled
            block_size = managers[0].block_size
            # Whole blocks only, and at least the last token recomputed (it yields the logits).
            n = min(computed, request.num_tokens - 1) // block_size
            taken = tuple(g[:n] for g in groups)
            if n == 0 or any(b.is_null for g in taken for b in g):
                return original(self, request)
            return self.create_kv_cache_blocks(taken), n * block_size, 0

        return get_computed_blocks

    wrap_method(Scheduler, "_preempt_request", make_preempt, tag=PREEMPT_STALE)
    wrap_method(KVCacheManager, "get_computed_blocks", make_lookup, tag=PREEMPT_STALE)


register(Toggle(
    name=PREEMPT_STALE,
    kind="fault",
    models="vllm#39146 (preemption / recycled-block hypothesis)",
    process="engine-core",
    target=f"{_SCHED}.Scheduler._preempt_request + {_KVM}.KVCacheManager.get_computed_blocks",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="Blocks freed by a preemption are handed out first, and the preempted request keeps "
                "their ids: when resumed it takes its computed blocks back without recomputing them, "
                "although the request that caused the preemption has been writing its KV there.",
    check=_check,
    patch=_patch,
    needs=("prefix-caching", "preemption"),
))
