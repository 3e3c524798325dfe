"""Which of vLLM's post-conditions broke first on a diverging request's own path (issue 30,
bucket rule 5; the checks are harness/postconditions.py, the names traces/history.py).

A request reads wrong KV through its own state: a worker block-table row that is not the
scheduler's, a worker row whose LoRA adapter is not the request's, a token's KV written to
another slot than its row's (its own, or one in a block it holds), a block at a full position
that holds another prefix's content (it carries another hash, or none while another request
holds it), one block at two positions, a position counted as computed whose slot nothing wrote
since its block was handed out, a position it attends to in a block the scheduler released,
an attention kernel told another length than its own, a token handed to the model at another
position than its own, another token than its own handed to the model, a block whose KV another request computed after its own harmful break
(named by that request's break, its root: rule 5.17). Those are the *harmful* breaks. Others are *latent*: a prefix-cache entry that finds the wrong block, a
reference count short of the block's holders — nothing reads wrong KV until a request is
handed that block. A latent break is the root of a later harmful break on its block, and then
it is the name (it says which operation went wrong, not where it showed); alone it names
nothing: a fault that breaks a count in every trace but corrupts an output in few must not
claim the victims of another cause in the same run (rule 5.2: faults T and U on at once).
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


# Checks of the worker's inputs the harness can enforce in a replay (harness/enforce.py
# ``Enforcer``): rule 5.19's evidence of a second cause, and
# rule 5.20's of whether a name caused a victim that broke nothing.
REPAIRABLE: tuple[str, ...] = ("worker-position", "worker-token", "worker-adapter")


def later(breaks: Iterable[Break], request: str) -> str | None:
    """Rule 5.19: when ``request``'s witness is a break the harness can enforce, the name (its
    root's, if any) of its first harmful break at a later step whose name did not break at the
    witness's step — a candidate second cause (faults AL + AI: AI's early positions named the
    victim, AL's stale token came steps later). None otherwise: one fault that breaks several
    checks at once breaks them in one step (AF: slot, length and position)."""
    own = [b for b in breaks if b.request == request and b.name in HARMFUL]
    w = witness(own, request)
    if w is None or w.root is not None or w.name not in REPAIRABLE:
        return None
    at_once = {b.root or b.name for b in own if b.step == w.step}
    after = sorted((b for b in own if b.step > w.step and (b.root or b.name) not in at_once),
                   key=lambda b: (b.step, HARMFUL.index(b.name)))
    return (after[0].root or after[0].name) if after else None


def origin(breaks: Iterable[Break], request: str) -> str | None:
    """The name of the first harmful break on ``request``'s own state (its block's latent
    break where there was one), or None when none broke (or the run was not monitored)."""
    w = witness(breaks, request)
    return None if w is None else w.root or w.name


__all__ = ["HARMFUL", "REPAIRABLE", "later", "origin", "witness"]
