"""Which of vLLM's post-conditions broke first on a diverging request's own path (the checks
are harness/postconditions.py, the names traces/history.py).

A request reads wrong KV through its own state: a worker block-table row that is not the
scheduler's, a worker row whose LoRA adapter is not the request's, a token's KV written to
another slot than its row's (its own, or one in a block it holds), a block at a full position
that holds another prefix's content (it carries another hash, or none while another request
holds it), one block at two positions, a position counted as computed whose slot nothing wrote
since its block was handed out, or that holds another token's KV (a rejected draft's), a
position it attends to in a block the scheduler released, an attention kernel told another
length than its own, a token handed to the model at another position than its own, another
token than its own handed to the model, a block whose KV another request computed after its own
harmful break (named by that request's break, its root). Those are the *harmful* breaks. Others
are *latent*: a prefix-cache entry that finds the wrong block, or a block holding another
token's KV than its hash covers, a reference count short of the block's holders — nothing reads
wrong KV until a request is handed that block. A latent break is the root of a later harmful
break on its block, and then it is the name (it says which operation went wrong, not where it
showed); alone it names nothing: a fault that breaks a count in every trace but corrupts an
output in few must not claim the victims of another cause in the same run (two bugs at once).
One name per request: its first harmful break by step, then by a fixed precedence."""

from __future__ import annotations

from collections.abc import Iterable

from kvfuzz.traces.history import HARMFUL_BREAKS, Break

# Harmful breaks in the precedence that names a request's first break of a step (the one table
# of what each break can harm is ``traces.history.BREAKS``).
HARMFUL: tuple[str, ...] = HARMFUL_BREAKS


def witness(breaks: Iterable[Break], request: str) -> Break | None:
    """The break that names ``request``'s origin: its first harmful break, by precedence."""
    own = [b for b in breaks if b.request == request and b.name in HARMFUL]
    if not own:
        return None
    first = min(b.step for b in own)
    return min((b for b in own if b.step == first), key=lambda b: HARMFUL.index(b.name))


def origin(breaks: Iterable[Break], request: str) -> str | None:
    """The name of the first harmful break on ``request``'s own state (its block's latent
    break where there was one), or None when none broke (or the run was not monitored)."""
    w = witness(breaks, request)
    return None if w is None else w.root or w.name


__all__ = ["HARMFUL", "origin", "witness"]
