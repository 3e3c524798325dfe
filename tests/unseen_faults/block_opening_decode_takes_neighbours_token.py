"""Fault AP (the model's input token ids).

Each step the model runner gathers each scheduled token's id from the persistent batch's token
ids (``GPUModelRunner._prepare_inputs``: ``token_ids_cpu`` indexed by row and position, into
``input_ids``). With this fault, in a batch of two requests or more, a decode below the first
row whose token opens a new KV block (its position a multiple of the block size) is handed the
row above's last scheduled token instead of its own: an index off by one row at a block
boundary. Its KV at that position is computed from another request's token, in its own slot,
and every later token of the request attends to it. Blocks, slots, lengths, positions and the
sampled row are all right; it breaks ``worker-token``. A request alone is never hit, so its
reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-block-opening-decode-takes-neighbours-token"


def _make(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        n = batch.num_reqs
        if n < 2:
            return out
        bs = self.cache_config.block_size
        counts = [int(c) for c in num_scheduled_tokens[:n]]
        computed = batch.num_computed_tokens_cpu[:n]
        prompt = batch.num_prompt_tokens[:n]
        ids = self.input_ids.cpu
        start = counts[0]
        for r in range(1, n):
            pos = int(computed[r])
            if counts[r] == 1 and pos >= int(prompt[r]) and pos % bs == 0:
                ids[start] = ids[start - 1]  # the bug: the row above's last token
            start += counts[r]
        if self.input_ids.gpu.data_ptr() != ids.data_ptr():
            self.input_ids.gpu[:start].copy_(ids[:start])
        return out

    return _prepare_inputs


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap(GPUModelRunner, "_prepare_inputs", _TAG, _make)
