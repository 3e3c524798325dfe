"""Fault AE (the persistent batch's LoRA mapping). Only LoRA campaigns (``--lora``) reach it.

When a request leaves the persistent batch, ``InputBatch.condense`` moves the request in the
last row into the hole, with its LoRA adapter (``request_lora_mapping``). With this fault a
moved row's adapter is dropped: from then on the request's tokens run through the base model,
KV and all, while every record of the scheduler's and the worker's block tables agrees. The
reports of LoRA requests answered with another user's adapter, or with none, are of this kind.
A request alone is never moved, so its reference is right.
"""

from __future__ import annotations

from typing import Any

from . import wrap_condense

_TAG = "unseen-fault-moved-row-drops-adapter"


def _drop_adapter(batch: Any, rid: str, i: int) -> None:
    lora = int(batch.request_lora_mapping[i])
    if not lora:
        return
    batch.request_lora_mapping[i] = 0  # the bug: the moved row serves the base model
    # Kept consistent: the batch's active adapters follow its rows, as ``remove_request`` keeps
    # them (else the adapter stays "active" after its requests end, and the engine refuses more
    # adapters than it has slots: a crash, not this bug).
    users = batch.lora_id_to_request_ids.get(lora)
    if users is not None:
        users.discard(rid)
        if not users:
            del batch.lora_id_to_request_ids[lora]
            batch.lora_id_to_lora_request.pop(lora, None)


def install() -> None:
    wrap_condense(_TAG, _drop_adapter)
