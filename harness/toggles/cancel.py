"""Cancel path frees shared blocks (fault; the cancel/retry mechanism of vllm#39146).

When a request is aborted (client cancel / disconnect), vLLM decrements each of its blocks'
reference counts; a prefix block it shares with a running request stays allocated. With this
fault the abort path returns shared blocks to the free pool as if nobody else referenced
them, at the head of the queue so the next allocation recycles them. The surviving request
still has those block ids in its block table: once another request (or the survivor itself,
growing) is handed the block and writes its KV there, the survivor reads foreign KV and its
output changes. The lost references are remembered so that the survivor's own free later
does not decrement a count it no longer holds: the allocator's books stay balanced and the
corruption shows as wrong tokens, not as an allocator assertion.
"""

from __future__ import annotations

from collections import Counter

from .base import Toggle, is_active, register
from .checks import expect_attr, expect_params, expect_source, first_problem, wrap_method

CANCEL_FREES_SHARED = "fault-cancel-frees-shared-blocks"
_KVM = "vllm.v1.core.kv_cache_manager"
_ST = "vllm.v1.core.single_type_kv_cache_manager"

# (id(manager), request_id, block_id) -> references the fault took away from that request.
_lost: Counter[tuple[int, str, int]] = Counter()


def _check() -> str | None:
    return first_problem(
        expect_params(_KVM, "KVCacheManager.free", "self", "request"),
        expect_source(_KVM, "KVCacheManager.free", "self.coordinator.free(request.request_id)"),
        expect_source("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.free", "manager.free(request_id)"),
        expect_params(_ST, "SingleTypeKVCacheManager.pop_blocks_for_free", "self", "request_id"),
        expect_source(_ST, "SingleTypeKVCacheManager.pop_blocks_for_free", "self.req_to_blocks.pop(request_id"),
        expect_source(_ST, "SingleTypeKVCacheManager.free", "self.pop_blocks_for_free(request_id)"),
        expect_source("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests", "request.status = finished_status",
                      "self._free_request(request"),
        expect_attr("vllm.v1.request", "RequestStatus.FINISHED_ABORTED"),
        expect_attr("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.remove"),
        expect_attr("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue.prepend_n"),
    )


def _take_sharers_refs(kvm, request_id: str) -> list:
    """Drop every other holder's reference to the blocks ``request_id`` shares; return them.
    A reference the fault already took earlier (a survivor of a previous cancel) is not
    counted in ``ref_cnt`` any more and must not be taken twice."""
    released = []
    for manager in kvm.coordinator.single_type_managers:
        mine = manager.req_to_blocks.get(request_id) or []
        shared = {b.block_id for b in mine if not b.is_null and b.ref_cnt > 1}
        if not shared:
            continue
        for other, blocks in manager.req_to_blocks.items():
            if other == request_id:
                continue
            seen: Counter[int] = Counter()
            for b in blocks:
                if b.block_id not in shared or b.is_null:
                    continue
                seen[b.block_id] += 1
                key = (id(manager), other, b.block_id)
                if seen[b.block_id] <= _lost.get(key, 0):
                    continue  # this occurrence's reference is already gone
                if b.ref_cnt > 1:
                    b.ref_cnt -= 1
                    _lost[key] += 1
                    released.append(b)
    return released


def _patch() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.request import RequestStatus

    def make_free(original):
        def free(self, request):
            if not (is_active(CANCEL_FREES_SHARED) and request.status == RequestStatus.FINISHED_ABORTED):
                return original(self, request)
            released = _take_sharers_refs(self, request.request_id)
            original(self, request)
            # The blocks are free now (ref 0). Put them at the head of the free queue, where
            # the next allocation takes them, as the report's "freed immediately" describes.
            queue = self.block_pool.free_block_queue
            front, seen = [], set()
            for b in released:
                if b.block_id not in seen and b.ref_cnt == 0 and not b.is_null:
                    seen.add(b.block_id)
                    queue.remove(b)
                    front.append(b)
            if front:
                queue.prepend_n(front)

        return free

    def make_pop(original):
        def pop_blocks_for_free(self, request_id):
            blocks = original(self, request_id)
            if not _lost:
                return blocks
            kept = []
            for b in blocks:
                key = (id(self), request_id, b.block_id)
                if _lost.get(key, 0) > 0:
                    _lost[key] -= 1  # this reference was already taken by the fault
                    if _lost[key] == 0:
                        del _lost[key]
                    continue
                kept.append(b)
            return kept

        return pop_blocks_for_free

    wrap_method(KVCacheManager, "free", make_free, tag=CANCEL_FREES_SHARED)
    wrap_method(SingleTypeKVCacheManager, "pop_blocks_for_free", make_pop, tag=CANCEL_FREES_SHARED)


def _reset() -> None:
    _lost.clear()


register(Toggle(
    name=CANCEL_FREES_SHARED,
    kind="fault",
    models="vllm#39146 (finding_00030 cancel/retry path)",
    process="engine-core",
    target=f"{_KVM}.KVCacheManager.free (abort) + {_ST}.SingleTypeKVCacheManager.pop_blocks_for_free",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="Aborting a request returns the blocks it shares with running requests to the "
                "head of the free pool regardless of their reference count; the next allocation "
                "overwrites KV a running request still reads.",
    check=_check,
    patch=_patch,
    needs=("prefix-caching",),
    reset=_reset,
))
