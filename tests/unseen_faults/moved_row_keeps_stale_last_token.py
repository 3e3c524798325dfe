"""Fault AA (the persistent batch's token ids, the model's input).

When a request leaves the persistent batch, ``InputBatch.condense`` moves the request in the
last row into the hole, copying its token ids (``token_ids_cpu``). With this fault the copy
stops one token short: the moved request's last token — the one its next decode step feeds the
model — is the hole's old content (the departed request's token at that position, or 0). The
request computes that token's KV from the wrong input and samples from it. Nothing in the
scheduler's or the worker's block records changes (its blocks, rows and slots are right: only
the KV *content* is wrong); the token the model is handed is the shape ``worker-token``
checks. It needs concurrent
requests, one leaving while a later one continues; a request alone is never moved, so its
reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-moved-row-keeps-stale-last-token"


def install() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original):
        def condense(self) -> None:
            holes = list(self.batch_update_builder.removed or ())
            before = {i: self.token_ids_cpu[i].copy() for i in holes}  # the holes' old rows
            where = dict(self.req_id_to_index)
            original(self)
            for rid, i in self.req_id_to_index.items():
                if i != where.get(rid) and i in before:
                    n = int(self.num_tokens_no_spec[i])
                    if n > 0:
                        self.token_ids_cpu[i, n - 1] = before[i][n - 1]  # the bug: one token short

        return condense

    wrap(InputBatch, "condense", _TAG, make)
