"""Fault AG (the prefix cache's LoRA namespace): written after rule 5.11 and its last review
(475bce2), for the acceptance runs of issue 30; neither the bucket rule nor the attribution nor
the post-conditions were changed after it. Only LoRA campaigns (``--lora``) reach it.

vLLM names a full block by its parent's hash, its tokens and extra keys; a LoRA request's extra
keys carry its adapter (``kv_cache_utils._gen_lora_extra_hash_keys``), so two adapters never
share KV. With this fault the adapter key is dropped: a request under one adapter (or the base
model) hits blocks another adapter computed, and attends to KV made with other weights — the
"two adapters alternating over shared prefixes" reports. Requests' and blocks' hashes agree
(both computed the same wrong way), so no post-condition kvfuzz checks breaks. A request alone
on a clean cache hits nothing, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-hash-ignores-adapter"


def install() -> None:
    from vllm.v1.core import kv_cache_utils

    def make(original):
        def _gen_lora_extra_hash_keys(request):
            return []  # the bug: every adapter's blocks share one namespace

        return _gen_lora_extra_hash_keys

    wrap(kv_cache_utils, "_gen_lora_extra_hash_keys", _TAG, make)
