"""Fault AF (the persistent batch's computed-token count).

When a request leaves the persistent batch, ``InputBatch.condense`` moves the request in the
last row into the hole, with its count of computed tokens (``num_computed_tokens_cpu``). With
this fault the moved row's count is copied one short. The worker refreshes every row's count
from the scheduler at the start of the next step, so the glitch lasts the one step after the
move: that step computes the moved request's token at the position before its own, writes its
KV there (over the previous token's) and rotates it as that position. A request alone is never
moved, so its reference is right.
"""

from __future__ import annotations

from typing import Any

from . import wrap_condense

_TAG = "unseen-fault-moved-row-count-one-short"


def _one_short(batch: Any, rid: str, i: int) -> None:
    if batch.num_computed_tokens_cpu[i] > 0:
        batch.num_computed_tokens_cpu[i] -= 1  # the bug: the moved row's count one short


def install() -> None:
    wrap_condense(_TAG, _one_short)
