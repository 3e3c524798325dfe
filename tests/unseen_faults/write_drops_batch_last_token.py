"""Fault AJ (the KV cache write).

Each step every attention layer writes the step's keys and values into the paged cache
(``CPUAttentionBackendImpl.do_kv_cache_update``, ``cpu_attn_reshape_and_cache``) at the slots the
worker computed. With this fault, in a batch of two requests or more, the write covers one
token fewer than the batch holds: the batch's last token (a decode's new token, or the last
token of a prefill or chunk) keeps whatever its slot held before, zeros in a fresh block or a
departed request's KV in a recycled one. The kind of bug of a kernel whose token count is
computed apart from the metadata (a padded or reordered batch). Every record kvfuzz checks
agrees, the slot mapping and the kernel's lengths and positions too: only the cache's content is
wrong. A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

from . import attention_metadata, wrap

_TAG = "unseen-fault-write-drops-batch-last-token"


def _make(original):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        m = attention_metadata(layer)
        if m is not None and int(m.query_start_loc.numel()) - 1 >= 2:
            n = int(m.num_actual_tokens) - 1  # the bug: the write's count is one short
            key, value, slot_mapping = key[:n], value[:n], slot_mapping[:n]
        return original(self, layer, key, value, kv_cache, slot_mapping)

    return do_kv_cache_update


def install() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    wrap(CPUAttentionBackendImpl, "do_kv_cache_update", _TAG, _make)
