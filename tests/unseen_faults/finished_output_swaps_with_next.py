"""Fault AS (the output processor: which request a step's tokens are delivered to).

Each step the engine core returns one output per request that produced tokens, and the output
processor (``OutputProcessor.process_outputs``, in the process that serves the caller) delivers
each output's new tokens and logprobs to its request. With this fault, when a request finishes
in a step, its output and the next one in the list that carries new tokens trade them: the
finished request ends on the other request's token, and that request is handed the finished
one's last token, while the engine goes on from its own. The kind of bug of per-request state
looked up by position after a finished request was taken out (the reports of responses mixed
between concurrent requests: vLLM issue #13408, PR #16863 for n > 1 requests overriding each
other). The scheduler, the allocator, the KV cache and the worker are all right: no post-condition
breaks, and every later token is the engine's own. A request alone is never hit, so its reference
is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-finished-output-swaps-with-next"


def _make(original):
    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        outs = list(engine_core_outputs)
        for a, b in zip(outs, outs[1:]):
            if a.finish_reason is not None and a.new_token_ids and b.new_token_ids and b.finish_reason is None:
                # The bug: the finished request's output and the next one trade their tokens.
                a.new_token_ids, b.new_token_ids = b.new_token_ids, a.new_token_ids
                a.new_logprobs, b.new_logprobs = b.new_logprobs, a.new_logprobs
        return original(self, engine_core_outputs, *args, **kwargs)

    return process_outputs


def install() -> None:
    from vllm.v1.engine.output_processor import OutputProcessor

    wrap(OutputProcessor, "process_outputs", _TAG, _make)
