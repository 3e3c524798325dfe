"""Fault AG (prefix-cache registration on abort).

When a request ends, ``KVCacheManager.free`` returns its blocks; only full blocks whose KV is
computed were registered in the prefix cache (``cache_blocks``). With this fault, a request
aborted in the middle of its prompt (a cancel during chunked prefill) first registers every
block it was given, up to the prompt's last full block: its last, partly computed block is
cached under the hash of the whole block, and a later request with the same prefix (a retry
after a cancel) hits it and reads its unwritten tail. The "retries after cancels diverge"
reports are of this kind. A request alone is never cancelled, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-abort-caches-partial-block"


def install() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    def make(original):
        def free(self, request):
            if (self.enable_caching and request.status == RequestStatus.FINISHED_ABORTED
                    and request.num_computed_tokens < request.num_prompt_tokens):
                bs = self.coordinator.single_type_managers[0].block_size
                given = len(self.get_block_ids(request.request_id)[0]) * bs
                full = min(request.num_prompt_tokens, len(request.block_hashes) * bs) // bs * bs
                upto = min(given, full)
                if upto > request.num_computed_tokens:
                    self.cache_blocks(request, upto)  # the bug: blocks not yet computed are cached
            return original(self, request)

        return free

    wrap(KVCacheManager, "free", _TAG, make)
