"""Fault AK (the sampler's row index).

Each step the model runner picks, for each request, the hidden state its next token is sampled
from: ``logits_indices``, the request's last scheduled token (``query_start_loc[1:] - 1`` in
``GPUModelRunner._prepare_inputs``, which the CPU runner inherits). With this fault, in a batch
of two requests or more, a request whose scheduled tokens cross its prompt's end in this step
and that is not the batch's first row takes the index of the row above: its first new token is
its neighbour's next token (after a preemption the crossing chunk may be partial, and its sample
is dropped anyway). Its KV, slots, lengths, positions and blocks are all
right; from the second token on it continues, correctly, from a wrong first token. It breaks
``worker-sample-row``. The kind of
bug of a runner whose sampled rows are counted apart from its scheduled rows (padding, a
reordered batch, a row left out for a partial prefill). A request alone is never hit, so its
reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-prefill-samples-neighbours-row"


def _make(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        logits_indices, rest = out[0], out[1:]
        batch = self.input_batch
        n = batch.num_reqs
        if n < 2 or rest[0] is not None:  # alone, or speculative decoding: not this path
            return out
        computed = batch.num_computed_tokens_cpu[:n]
        prompt = batch.num_prompt_tokens[:n]
        scheduled = num_scheduled_tokens[:n]
        last = [i for i in range(1, n) if computed[i] < prompt[i] <= computed[i] + scheduled[i]]
        if not last:
            return out
        logits_indices = logits_indices.clone()
        for i in last:  # the bug: the row above's index
            logits_indices[i] = logits_indices[i - 1]
        return (logits_indices, *rest)

    return _prepare_inputs


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner, "_prepare_inputs", _TAG, _make)
