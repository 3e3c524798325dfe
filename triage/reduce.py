"""Pure reducers for minimization: set reduction (ProbDD, ddmin), integer shrinking, and the
k-of-m acceptance rule. No traces, no engines: each takes a ``keeps`` predicate, so they are
unit-tested on plain lists and numbers (tests/test_reduce.py) and used by triage/minimize.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

@dataclass(frozen=True)
class Acceptance:
    """Keep a candidate when the signature reproduces in >= ``min_hits`` of ``repeats`` runs."""

    repeats: int = 1
    min_hits: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_hits <= self.repeats:
            raise ValueError(f"need 1 <= m <= k, got m={self.min_hits}, k={self.repeats}")

    def needed(self, runs: int) -> int:
        """Hits required out of ``runs`` replays at the same rate (for the final check)."""
        return max(1, math.ceil(runs * self.min_hits / self.repeats))


def default_acceptance(step_exact: bool) -> Acceptance:
    # Step-anchored in-process replays are deterministic: one replay decides. Wall-clock
    # replays vary run to run: keep candidates that reproduce at least half the time.
    return Acceptance(1, 1) if step_exact else Acceptance(4, 2)


def accepts(run_once: Callable[[], bool], acc: Acceptance) -> tuple[bool, int]:
    """Replay until the k-of-m outcome is decided. Returns (kept, replays spent)."""
    hits = 0
    for done in range(1, acc.repeats + 1):
        hits += bool(run_once())
        if hits >= acc.min_hits:
            return True, done
        if hits + (acc.repeats - done) < acc.min_hits:
            return False, done
    return False, acc.repeats  # pragma: no cover - the loop always decides


# -- set reduction: ProbDD and ddmin -----------------------------------------------------------


def probdd(items: Sequence[T], keeps: Callable[[list[T]], bool]) -> list[T]:
    """Probabilistic delta debugging (Wang et al., FSE 2021): every item has a probability
    of being needed; each round removes the set with the best expected gain (size x chance
    that none of it is needed), and a failed removal raises the probabilities of what it
    tried to remove. Ends when every remaining item has been shown necessary on its own.
    ``keeps(subset)`` says whether the subset still reproduces."""
    items = list(items)
    p = {i: 0.1 for i in range(len(items))}  # the prior chance that an item is needed
    alive = list(range(len(items)))
    if alive and keeps([]):
        return []
    while True:
        open_ = sorted((i for i in alive if p[i] < 1.0), key=lambda i: (p[i], i))
        if not open_:
            break
        best, best_gain, prod = 0, -1.0, 1.0
        for n, i in enumerate(open_, start=1):
            prod *= 1.0 - p[i]
            if n * prod > best_gain:
                best, best_gain = n, n * prod
        drop = set(open_[:best])
        rest = [i for i in alive if i not in drop]
        if keeps([items[i] for i in rest]):
            alive = rest
            continue
        none_needed = math.prod(1.0 - p[i] for i in drop)
        for i in drop:
            p[i] = 1.0 if len(drop) == 1 else min(1.0, p[i] / (1.0 - none_needed))
    return [items[i] for i in alive]


def ddmin(items: Sequence[T], keeps: Callable[[list[T]], bool]) -> list[T]:
    """Zeller's ddmin: 1-minimal subset for which ``keeps`` holds."""
    cur = list(items)
    if cur and keeps([]):
        return []
    n = 2
    while len(cur) >= 2:
        size = math.ceil(len(cur) / n)
        chunks = [cur[i:i + size] for i in range(0, len(cur), size)]
        for c in chunks:
            if keeps(c):
                cur, n = c, 2
                break
        else:
            for c in chunks:
                rest = [x for x in cur if x not in c]
                if keeps(rest):
                    cur, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(cur):
                    break
                n = min(len(cur), 2 * n)
    return cur


def shrink_int(cur: int, lo: int, keeps: Callable[[int], bool], *, max_tries: int = 8) -> int:
    """Smallest value in [lo, cur] that keeps, by trying ``lo`` and then bisecting (assumes,
    heuristically, that keeping is monotone; every accepted value was actually tested)."""
    if cur <= lo:
        return cur
    if keeps(lo):
        return lo
    lo += 1
    tries = 1
    while lo < cur and tries < max_tries:
        mid = (lo + cur) // 2
        if keeps(mid):
            cur = mid
        else:
            lo = mid + 1
        tries += 1
    return cur

