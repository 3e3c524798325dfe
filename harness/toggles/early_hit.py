"""Prefix-cache hits on blocks registered before their KV was written (fault; vllm#37076).

vLLM registers a block's hash when the tokens that fill it are scheduled, and the same step's
forward pass writes it. With this fault a request in chunked prefill allocates blocks for its
whole prompt at its first chunk (as much of it as the free pool holds) and registers all their
hashes at once, although only the first chunk's KV will be written this step. A request that
hits those blocks before the later chunks run reads unwritten KV (zeros or a previous owner's data). On a synchronous CPU engine a
chunk's blocks are written in the same forward pass as any same-step hit reads them, so the
window is what lies between chunks: with vLLM's defaults a running chunked prefill takes the
whole token budget until its last chunk, and the window opens when the writer stops early
(cancelled or preempted mid-prefill: registered blocks that were never written; a resumed
writer hits its own). With ``long_prefill_token_threshold`` set, chunks are capped and other
requests are scheduled between them, so a request sharing the prefix that arrives while the
prefill is under way reads the unwritten blocks directly. Under GPU async scheduling the
registration is also visible to the very next step.
"""

from __future__ import annotations

import inspect

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, unwrap, wrap_method

EARLY_HIT = "fault-prefix-hit-before-write"
_KVM = "vllm.v1.core.kv_cache_manager"
_COORD = "vllm.v1.core.kv_cache_coordinator"


def _check() -> str | None:
    return first_problem(
        expect_params(_KVM, "KVCacheManager.allocate_slots", "self", "request", "num_new_tokens",
                      "num_new_computed_tokens", "new_computed_blocks", "num_lookahead_tokens",
                      "num_external_computed_tokens", "delay_cache_blocks"),
        expect_source(_KVM, "KVCacheManager.allocate_slots", "self.coordinator.cache_blocks(request, num_tokens_to_cache)",
                      "request.num_computed_tokens + num_new_computed_tokens"),
        expect_params(_COORD, "KVCacheCoordinator.allocate_new_blocks", "self", "request_id", "num_tokens",
                      "num_tokens_main_model"),
        expect_params(_COORD, "KVCacheCoordinator.cache_blocks", "self", "request", "num_computed_tokens"),
        expect_source("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.__add__", "zip(self.blocks, other.blocks)"),
    )


def _patch() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

    def make_alloc(original):
        sig = inspect.signature(unwrap(original))

        def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
            out = original(self, request, num_new_tokens, *args, **kwargs)
            if out is None or not is_active(EARLY_HIT) or not self.enable_caching:
                return out
            a = sig.bind(self, request, num_new_tokens, *args, **kwargs)
            a.apply_defaults()
            p = a.arguments
            if p["delay_cache_blocks"] or p["num_lookahead_tokens"]:
                return out
            end = (request.num_computed_tokens + p["num_new_computed_tokens"]
                   + p["num_external_computed_tokens"] + num_new_tokens)
            prompt = request.num_prompt_tokens
            if end >= prompt:
                return out  # not a chunk of a longer prefill
            managers = self.coordinator.single_type_managers
            if len(managers) != 1:
                return out  # hybrid layouts: not modelled
            m = managers[0]
            have = len(m.req_to_blocks.get(request.request_id, ()))
            # As much of the prompt as the free pool holds (under memory pressure the writer
            # is then the one preempted, and it hits its own unwritten blocks on resume).
            k = min(-(-prompt // m.block_size) - have, self.block_pool.get_num_free_blocks())
            if k <= 0:
                return out
            upto = min(prompt, (have + k) * m.block_size)
            extra = self.coordinator.allocate_new_blocks(request.request_id, upto, upto)
            # Register those blocks now; only [0, end) is computed this step.
            self.coordinator.cache_blocks(request, upto)
            # The worker learns block ids from what allocate_slots returns: include the extra
            # blocks so its block table matches the scheduler's.
            return out + KVCacheBlocks(extra) if any(extra) else out

        return allocate_slots

    wrap_method(KVCacheManager, "allocate_slots", make_alloc, tag=EARLY_HIT)


register(Toggle(
    name=EARLY_HIT,
    kind="fault",
    models="vllm#37076 (hit on blocks registered before the forward pass; PRs #37152, #38715, #41400)",
    process="engine-core",
    target=f"{_KVM}.KVCacheManager.allocate_slots",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="A chunked prefill allocates and registers the blocks of its whole prompt at its first chunk; "
                "requests that hit the later blocks before they are computed (or after the writer "
                "was cancelled or preempted) read KV that was never written.",
    check=_check,
    patch=_patch,
    needs=("prefix-caching", "chunked-prefill"),
))
