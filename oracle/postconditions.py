"""Which of vLLM's post-conditions broke first on a diverging request's own path (issue 30,
bucket rule 5; the checks are harness/postconditions.py, the names traces/history.py).

A request reads wrong KV through its own state: a block at a full position that carries another
prefix's hash, one block at two positions, a block whose reference count is short, a worker
block-table row that is not the scheduler's. Where that block's prefix-cache entry had broken
before (the allocator mis-recorded it and the request was handed it by a hit), the map break is
the origin: it names the operation that went wrong, not the place it showed. One name per
request, by a fixed precedence, so that one cause gives one name across witnesses: the map
break first (its cause precedes the request's), then the worker's row, the reference count, a
foreign block, a repeated one (a repeated block is usually foreign too: the foreign name wins)."""

from __future__ import annotations

from collections.abc import Iterable

from kvfuzz.traces.history import Break

PRECEDENCE: tuple[str, ...] = ("map-entry-stolen", "map-entry-orphaned", "worker-row", "held-block-undercounted",
                               "held-block-foreign", "held-block-repeated")


def witness(breaks: Iterable[Break], request: str) -> Break | None:
    """The break that names ``request``'s origin: its first own break, by precedence."""
    own = [b for b in breaks if b.request == request]
    if not own:
        return None
    first = min(b.step for b in own)
    return min((b for b in own if b.step == first), key=lambda b: PRECEDENCE.index(b.root or b.name))


def origin(breaks: Iterable[Break], request: str) -> str | None:
    """The name of the first post-condition broken on ``request``'s own state (its root where
    the block's map entry broke first), or None when none did (or the run was not monitored)."""
    w = witness(breaks, request)
    return None if w is None else w.root or w.name


__all__ = ["PRECEDENCE", "origin", "witness"]
