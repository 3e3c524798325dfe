"""Fault AV (speculative decoding's rollback of rejected drafts).

A step computes a request's drafts' KV with its own last token; the rejection sampler keeps the
ones the model agrees with, and ``Scheduler.update_from_output`` takes the others back from the
request's computed tokens (``num_computed_tokens -= num_rejected``). With this fault it takes
back one fewer: the first rejected draft stays counted, so its KV stays in the slot of the token
sampled in its place, which no step computes. The request reads it from then on, and once the
block fills it is registered in the prefix cache under the hash of the request's own tokens, so
a later prefix hit on it reads the draft's KV too. No record of vLLM's disagrees: the slot of a
position counted as computed holds the KV of another token (``held-block-token``), and so does a
cached block (``map-entry-unbacked``). Speculative decoding only; a request's reference runs
without it (``reference_config``), so it is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-rejected-draft-stays-counted"


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def make(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            drafted = scheduler_output.scheduled_spec_decode_tokens
            before = {rid: self.requests[rid].num_computed_tokens for rid in drafted if rid in self.requests}
            out = original(self, scheduler_output, model_runner_output)
            for rid, count in before.items():
                req = self.requests.get(rid)
                if req is not None and not req.is_finished() and req.num_computed_tokens < count:
                    req.num_computed_tokens += 1  # the bug: one rejected draft stays counted
            return out

        return update_from_output

    wrap(Scheduler, "update_from_output", _TAG, make)
