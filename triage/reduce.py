"""Pure reducers for minimization: set reduction (ProbDD, ddmin), integer shrinking and the k-of-m
acceptance rule. Each takes a ``keeps`` predicate: no traces, no engines."""

from __future__ import annotations

import itertools
import math
import operator
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
    # Step-anchored in-process replays are deterministic (one decides); wall-clock ones must hit half the time.
    return Acceptance(1, 1) if step_exact else Acceptance(4, 2)


def accepts(run_once: Callable[[], bool], acc: Acceptance) -> tuple[bool, int]:
    """Replay until the k-of-m outcome is decided. Returns (kept, replays spent)."""
    hits = 0
    for done in range(1, acc.repeats + 1):
        hits += bool(run_once())
        if hits >= acc.min_hits or hits + (acc.repeats - done) < acc.min_hits:
            break
    return hits >= acc.min_hits, done


def probdd(items: Sequence[T], keeps: Callable[[list[T]], bool]) -> list[T]:
    """Probabilistic delta debugging (Wang et al., FSE 2021): each round removes the items with
    the best expected gain (size x chance that none is needed); a failed removal raises their
    chances of being needed. Ends when every remaining item has been shown necessary alone."""
    p = [0.1] * len(items)  # the prior chance that an item is needed
    alive = list(range(len(items)))
    if alive and keeps([]):
        return []
    while open_ := sorted((i for i in alive if p[i] < 1.0), key=lambda i: (p[i], i)):
        gains = [n * q for n, q in enumerate(itertools.accumulate((1.0 - p[i] for i in open_), operator.mul), 1)]
        drop = set(open_[:gains.index(max(gains)) + 1])
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
        # Each chunk alone (then start over at 2), else each complement (then one chunk fewer).
        tries = [(c, 2) for c in chunks] + [([x for x in cur if x not in c], max(n - 1, 2)) for c in chunks]
        found = next(((c, k) for c, k in tries if keeps(c)), None)
        if found is not None:
            cur, n = found
        elif n >= len(cur):
            break
        else:
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
    for _ in range(max_tries - 1):
        if lo >= cur:
            break
        mid = (lo + cur) // 2
        if keeps(mid):
            cur = mid
        else:
            lo = mid + 1
    return cur
