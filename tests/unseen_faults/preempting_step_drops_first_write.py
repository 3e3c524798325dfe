"""Fault AR (the KV cache write in a step that preempts).

When the scheduler runs out of KV blocks it preempts a running request in the middle of
``schedule()`` (``Scheduler._preempt_request``; the step's ``SchedulerOutput.preempted_req_ids``
lists it), and the step goes on with the requests left. With this fault, in such a step the
cache write (``CPUAttentionBackendImpl.do_kv_cache_update``) skips the first row's last
scheduled token — a decode's new token, or the last token of a prefill or chunk — so that slot
keeps its old content: zeros in a fresh block, or the KV of the request the block last held
(under pressure, typically the one just preempted). The kind of bug of a write whose rows are
counted before the preempted ones were taken out of the batch. Every record kvfuzz checks
agrees, the slot mapping and the kernel's lengths and positions too: only the cache's content is
wrong, and only under KV pressure. A request alone is never preempted, so its reference is right.
"""

from __future__ import annotations

from . import attention_metadata, wrap

_TAG = "unseen-fault-preempting-step-drops-first-write"
# Whether the step being executed preempted a request (set around ``execute_model``).
_STEP = {"preempted": False}


def _make_execute(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        _STEP["preempted"] = bool(getattr(scheduler_output, "preempted_req_ids", None))
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            _STEP["preempted"] = False

    return execute_model


def _make_write(original):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        m = attention_metadata(layer) if _STEP["preempted"] else None
        if m is not None and int(m.query_start_loc.numel()) >= 2:
            skip = int(m.query_start_loc[1]) - 1  # the bug: the first row's last token
            if 0 <= skip < int(slot_mapping.numel()):
                keep = [i for i in range(int(slot_mapping.numel())) if i != skip]
                key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        return original(self, layer, key, value, kv_cache, slot_mapping)

    return do_kv_cache_update


def install() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner, "execute_model", _TAG, _make_execute)
    wrap(CPUAttentionBackendImpl, "do_kv_cache_update", _TAG, _make_write)
