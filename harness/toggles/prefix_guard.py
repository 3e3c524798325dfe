"""Same-step prefix reuse guard for full attention (vLLM PR #38715, not merged) as a fix.

``allocate_slots`` registers a request's full blocks in the prefix cache at scheduling time,
before the forward pass writes them; a second request scheduled in the same step can hit them.
The PR moves the Mamba manager's ``cached_blocks_this_step`` guard into full attention: when the
last block of a hit was registered in the current step, ``get_num_blocks_to_allocate`` reports
"no capacity" (``num_gpu_blocks + 1``) and the request is deferred to the next step.

On CPU the forward pass writes every layer's KV for the whole batch before computing
attention, so a same-step hit reads written KV and the guard only shifts the schedule by a
step (outputs identical): GPU / async-scheduling only in effect.
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

SAME_STEP_GUARD = "fix-same-step-prefix-guard"
_ST = "vllm.v1.core.single_type_kv_cache_manager"
_ATTR = "_kvfuzz_cached_this_step"


def _check() -> str | None:
    return first_problem(
        expect_params(_ST, "FullAttentionManager.cache_blocks", "self", "request", "num_tokens"),
        expect_params(_ST, "SingleTypeKVCacheManager.get_num_blocks_to_allocate", "self", "request_id",
                      "num_tokens", "new_computed_blocks"),
        expect_source(_ST, "SingleTypeKVCacheManager.cache_blocks", "self.num_cached_block[request.request_id] = num_full_blocks"),
        expect_params(_ST, "SingleTypeKVCacheManager.new_step_starts", "self"),
        # The guard the PR generalises must still look like this in the Mamba manager.
        expect_source(_ST, "MambaManager.get_num_blocks_to_allocate", "cached_blocks_this_step",
                      "self.block_pool.num_gpu_blocks + 1"),
    )


def _this_step(manager) -> set:
    s = manager.__dict__.get(_ATTR)
    if s is None:
        s = set()
        setattr(manager, _ATTR, s)
    return s


def _patch() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    def make_cache(original):
        def cache_blocks(self, request, num_tokens, *args, **kwargs):
            if not is_active(SAME_STEP_GUARD):
                return original(self, request, num_tokens, *args, **kwargs)
            before = self.num_cached_block.get(request.request_id, 0)
            out = original(self, request, num_tokens, *args, **kwargs)
            after = self.num_cached_block.get(request.request_id, 0)
            blocks = self.req_to_blocks.get(request.request_id, [])
            seen = _this_step(self)
            for b in blocks[before:after]:
                if not b.is_null and b.block_hash is not None:
                    seen.add(b.block_hash)
            return out

        return cache_blocks

    def make_count(original):
        def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs):
            if (is_active(SAME_STEP_GUARD) and len(new_computed_blocks) > 0
                    and new_computed_blocks[-1].block_hash in _this_step(self)):
                # Defer: "no capacity" this step, so the hit is taken after the writer's forward.
                return self.block_pool.num_gpu_blocks + 1
            return original(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs)

        return get_num_blocks_to_allocate

    def make_step(original):
        def new_step_starts(self):
            _this_step(self).clear()
            return original(self)

        return new_step_starts

    wrap_method(FullAttentionManager, "cache_blocks", make_cache, tag=SAME_STEP_GUARD)
    wrap_method(FullAttentionManager, "get_num_blocks_to_allocate", make_count, tag=SAME_STEP_GUARD)
    wrap_method(FullAttentionManager, "new_step_starts", make_step, tag=SAME_STEP_GUARD)


register(Toggle(
    name=SAME_STEP_GUARD,
    kind="fix",
    models="vllm PR #38715 (closed unmerged; same idea: #37152, #42359)",
    process="engine-core",
    target=f"{_ST}.FullAttentionManager.cache_blocks / get_num_blocks_to_allocate / new_step_starts",
    backends=("cuda",),
    versions="0.32 (unfixed)",
    description="A request whose prefix-cache hit ends on a block registered in the current "
                "scheduling step is deferred to the next step, so it never reads KV the same "
                "step's forward has not written yet. On CPU only the schedule changes.",
    check=_check,
    patch=_patch,
    needs=("prefix-caching",),
))
