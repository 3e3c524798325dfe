"""Fault AL (the persistent batch's token ids of a re-added request).

A request leaves the worker's persistent batch when it is preempted, or when it is running but
not scheduled for a step (the token budget went to others); when it is scheduled again the
runner adds it back (``InputBatch.add_request``), copying its prompt and its output tokens into
the row it gets. With this fault the output tokens are not copied: the row keeps whatever its
previous occupant left at those positions (another request's tokens, or zeros). A resumed
request recomputes its output tokens from them, and a request that was only left out for a step
feeds the model its row's stale token at its next position: KV and answer built from another
request's tokens. Slots, positions, lengths, blocks and sampled rows are all right; the token
ids the model is handed break ``worker-token``. It has two paths to a victim: preemption (KV
pressure) and a step without budget (long prompts beside decodes).

Upstream's own bugs of this kind: vLLM PR #26385 ("Fix async scheduling + request preemption":
the runner must be refreshed with all token ids after a preemption, "so that correct input ids
are used") and PR #27756 (the same for a running request left out of a step). A request alone
is never preempted nor left out, so its reference is right.
"""

from __future__ import annotations

from typing import Any

from . import wrap

_TAG = "unseen-fault-readded-row-keeps-stale-tokens"


def _make(original):
    def add_request(self: Any, request: Any) -> int:
        n_out = len(request.output_token_ids)
        before = self.token_ids_cpu.copy() if n_out else None  # only a re-added request pays
        index = original(self, request)
        if before is not None:
            start = int(self.num_prompt_tokens[index])
            # The bug: the output tokens are not copied; the row's previous content stays.
            self.token_ids_cpu[index, start : start + n_out] = before[index, start : start + n_out]
        return index

    return add_request


def install() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    wrap(InputBatch, "add_request", _TAG, _make)
