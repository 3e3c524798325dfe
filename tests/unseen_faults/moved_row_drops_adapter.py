"""Fault AE (the persistent batch's LoRA mapping): written after rule 5.10 (05d1d43, the
``held-block-released`` post-condition), for the acceptance runs of issue 30; neither the bucket
rule nor the attribution was changed after it. Only LoRA campaigns (``--lora``) reach it.

When a request leaves the persistent batch, ``InputBatch.condense`` moves the request in the
last row into the hole, with its LoRA adapter (``request_lora_mapping``). With this fault a
moved row's adapter is dropped: from then on the request's tokens run through the base model,
KV and all, while every record of the scheduler's and the worker's block tables agrees. The
reports of LoRA requests answered with another user's adapter, or with none, are of this kind.
A request alone is never moved, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-moved-row-drops-adapter"


def install() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original):
        def condense(self) -> None:
            where = dict(self.req_id_to_index)
            original(self)
            for rid, i in self.req_id_to_index.items():
                lora = int(self.request_lora_mapping[i])
                if i != where.get(rid) and lora:
                    self.request_lora_mapping[i] = 0  # the bug: the moved row serves the base model
                    # Kept consistent: the batch's set of active adapters follows its rows (else
                    # the adapter stays "active" after its requests end, and the engine refuses
                    # more adapters than it has slots: a crash, not this bug).
                    users = self.lora_id_to_request_ids.get(lora)
                    if users is not None:
                        users.discard(rid)
                        if not users:
                            del self.lora_id_to_request_ids[lora]
                            self.lora_id_to_lora_request.pop(lora, None)

        return condense

    wrap(InputBatch, "condense", _TAG, make)
