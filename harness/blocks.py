"""Block-lifecycle interactions between requests, step by step (in-process harness).

The coverage buckets of fuzzer/feedback.py count scheduler states; the allocator faults of the
vLLM reports live in *interactions* between requests over the same physical KV block — a block
freed by a cancelled or preempted request and handed to another one within a step or two; a
block still shared when one of its holders is cancelled; a preempted request coming back to
blocks someone else held meanwhile. These are the edges of the block lifecycle (AFL counts
edges, not basic blocks). After each scheduling step the harness passes which block ids each
request holds; ``BlockEdges.step`` compares with the previous step and names what happened:

- ``share`` — a request took a block another live request holds (a prefix-cache hit);
  ``share:same-step`` when both took it in the same step;
- ``reuse:<why>[:prefill]:<gap>`` — a request took a block whose last holder left by ``why``
  (``cancel``, ``preempt`` or ``finish``; ``:prefill`` if it left before its first token)
  ``gap`` steps ago (0, 1, 2-3, 4+); prefixed ``resumed-`` when the taker had been preempted;
- ``reclaim:<why>`` — a request took back a block it held itself before leaving (a preempted
  request resuming on its own cached blocks);
- ``leave-shared:<why>`` — a request left while another live request still held one of its
  blocks (a cancel while a prefix is shared).

Pure bookkeeping on ids: no vLLM import, unit-tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def gap_bucket(n: int) -> str:
    return "0" if n <= 0 else "1" if n == 1 else "2-3" if n <= 3 else "4+"


@dataclass
class _Left:
    owner: str
    why: str
    step: int
    prefill: bool


@dataclass
class BlockEdges:
    prev: dict[str, frozenset[int]] = field(default_factory=dict)
    last: dict[int, _Left] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)

    def step(self, step: int, holders: Mapping[str, Iterable[int]], *, preempted: Iterable[str] = (),
             cancelled: Iterable[str] = (), no_tokens: Iterable[str] = ()) -> list[str]:
        """Edges of this step. ``holders``: request -> block ids held now; ``preempted``:
        requests preempted this step; ``cancelled``: requests cancelled so far; ``no_tokens``:
        requests that have produced no token yet."""
        now = {r: frozenset(b) for r, b in holders.items()}
        pre, canc, fresh = set(preempted), set(cancelled), set(no_tokens)
        edges: list[str] = []
        held_by: dict[int, set[str]] = {}
        for r, blocks in now.items():
            for b in blocks:
                held_by.setdefault(b, set()).add(r)
        # Requests that let go of blocks since the last step (gone entirely, or preempted).
        for r, blocks in self.prev.items():
            gone = blocks - now.get(r, frozenset())
            if not gone or (r in now and r not in pre):
                continue  # still running: a partial release is not a leave
            why = "preempt" if r in pre else "cancel" if r in canc else "finish"
            if why == "preempt":
                self.preempted.add(r)
            # Shared: another request held the block before this one let go and holds it still.
            if any(b in self.prev.get(o, frozenset()) for b in gone for o in held_by.get(b, set()) - {r}):
                edges.append(f"leave-shared:{why}")
            for b in gone:
                self.last[b] = _Left(r, why, step, r in fresh)
        for r, blocks in now.items():
            for b in sorted(blocks - self.prev.get(r, frozenset())):
                others = held_by[b] - {r}
                left = self.last.get(b)
                if others:
                    # Taken from a live holder (a prefix hit), or by two requests in one step.
                    edges.append("share" if any(b in self.prev.get(o, frozenset()) for o in others)
                                 else "share:same-step")
                elif left is not None and left.owner == r:
                    edges.append(f"reclaim:{left.why}")
                elif left is not None:
                    tag = "resumed-" if r in self.preempted else ""
                    edges.append(f"{tag}reuse:{left.why}{':prefill' if left.prefill else ''}:"
                                 f"{gap_bucket(step - left.step)}")
        self.prev = now
        return edges
