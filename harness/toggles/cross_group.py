"""One-phase cross-group allocation of prefix hits and external blocks (fault; vllm#44409).

Since PR #44409 (issue #33775) ``KVCacheCoordinator.allocate_new_computed_blocks`` runs in two
phases: every KV cache group first touches its local prefix-cache hits, then every group
allocates blocks for the connector's external tokens. This fault restores the order before
the fix, interleaved per group: group i touches its hits and at once allocates its external
blocks, before group i+1 has touched its hits. Group i's ``get_new_blocks`` pops the free
queue's head, which can be a later group's cache-hit block that is still free (ref count 0):
that block is evicted and handed to group i, and then touched by group i+1 as its hit. One
block id is now in two groups' tables. On vLLM's hybrid layout the groups' KV tensors alias
the same bytes, so the connector's load for group i overwrites the KV group i+1 reads as its
cached prefix, and the output changes. The allocator does not notice.

Reachable only with several KV cache groups (a hybrid model), a KV connector that reports
external tokens for a request that also has local hits, and a free queue whose head holds a
later group's hits: the full-attention group first (``embedded:tiny-hybrid``), KV pressure.
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

CROSS_GROUP_ONE_PHASE = "fault-cross-group-one-phase"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_STKM = "vllm.v1.core.single_type_kv_cache_manager"


def _check() -> str | None:
    return first_problem(
        expect_params(_COORD, "KVCacheCoordinator.allocate_new_computed_blocks", "self", "request_id",
                      "new_computed_blocks", "num_local_computed_tokens", "num_external_computed_tokens",
                      "skip_zeroing_group_ids"),
        # The two phases as shipped: every group's hits touched, then every group's external blocks.
        expect_source(_COORD, "KVCacheCoordinator.allocate_new_computed_blocks", "manager.add_local_computed_blocks(",
                      "manager.allocate_external_computed_blocks(", "request_id in manager.num_cached_block",
                      "record_for_zeroing=i not in skip_zeroing_group_ids"),
        expect_params(_STKM, "SingleTypeKVCacheManager.add_local_computed_blocks", "self", "request_id",
                      "new_computed_blocks", "num_local_computed_tokens", "num_external_computed_tokens"),
        expect_params(_STKM, "SingleTypeKVCacheManager.allocate_external_computed_blocks", "self", "request_id",
                      "num_local_computed_tokens", "num_external_computed_tokens", "record_for_zeroing"),
        expect_source(_STKM, "SingleTypeKVCacheManager.allocate_external_computed_blocks", "get_new_blocks"),
    )


def _patch() -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    def make(original):
        def allocate_new_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                         num_external_computed_tokens, skip_zeroing_group_ids=()):
            if not is_active(CROSS_GROUP_ONE_PHASE) or num_external_computed_tokens <= 0:
                return original(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                num_external_computed_tokens, skip_zeroing_group_ids)
            if any(request_id in m.num_cached_block for m in self.single_type_managers):
                assert all(len(blocks) == 0 for blocks in new_computed_blocks)
                return None
            # Before #44409: per group, touch the hits, then allocate the external blocks.
            for i, manager in enumerate(self.single_type_managers):
                manager.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                                  num_external_computed_tokens)
                manager.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                          num_external_computed_tokens,
                                                          record_for_zeroing=i not in skip_zeroing_group_ids)
            return None

        return allocate_new_computed_blocks

    wrap_method(KVCacheCoordinator, "allocate_new_computed_blocks", make, tag=CROSS_GROUP_ONE_PHASE)


register(Toggle(
    name=CROSS_GROUP_ONE_PHASE,
    kind="fault",
    models="vllm#44409 (one-phase cross-group allocation; issue #33775)",
    process="engine-core",
    target=f"{_COORD}.KVCacheCoordinator.allocate_new_computed_blocks",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="Each KV cache group allocates its external-token blocks right after touching its own "
                "prefix hits, so an earlier group can take a later group's not-yet-touched hit block; "
                "the connector's load then overwrites KV the later group reads as its cached prefix.",
    check=_check,
    patch=_patch,
    needs=("prefix-caching", "kv-connector", "hybrid"),
))
