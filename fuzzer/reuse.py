"""Prompt reuse: a campaign's pool of prompts that fresh traces draw from.

Real traffic repeats system prompts and documents; a fuzzer that never repeats a prompt
across traces computes a fresh reference for every request. The pool is a pure function of
the campaign seed (``GenOptions.pool_seed``): ``pool_size`` prompts in ``GROUPS`` prefix
groups ("system prompts" under "documents"), so iteration i's trace stays a pure function of
(seed, i) and a resumed campaign draws the same prompts.

Reuse keeps the trace's own prefix sharing: the bugs kvfuzz hunts live where requests of one
trace share blocks. A trace's prefix group is mapped, with probability ``prompt_reuse``, to
one pool group as a whole (every request of the group moves together, so they still share),
and each of its requests then takes, two times in three, a pool prompt of that group whole
(with the pool entry's own ``max_tokens``: a repeated request, whose reference the store
already has), else keeps its own length and tail under the pool's prefix. A request without a
prefix group takes a pool prompt whole with probability ``prompt_reuse``. A prompt longer than
any of the pool's keeps its length (KV pressure: preemption bugs need it). The probability is
chosen in docs/benchmarks.md ("Adaptive runs and the reference store").
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvfuzz.traces import CancelEvent, EngineConfig, GenPrompt, SendEvent

if TYPE_CHECKING:
    from .generate import GenOptions

# `kvfuzz run` and `kvfuzz bench`'s default: off, by measurement (docs/benchmarks.md: at 0.3 the hit rate rose
# 32% -> 43%, but traces got costlier and the preemption fault took 25 traces instead of 13 on one seed).
DEFAULT_PROMPT_REUSE = 0.0
# Prefix groups of the pool: entry j is in group j % GROUPS.
GROUPS = 4


def max_pool_len(block_size: int) -> int:
    """The longest prompt the pool holds (``pool_prompt``)."""
    return max(700, 16 * block_size + 1)


def pool_max_tokens(pool_seed: int, j: int, opts: GenOptions) -> int:
    """How many tokens a whole reuse of the pool's j-th prompt asks for: always the same, as a
    repeated request does, so its reference is served by the store from its second use on."""
    return random.Random(f"kvfuzz/pool-max/{pool_seed}/{j}").randint(*opts.max_tokens)


def pool_group(pool_seed: int, r: int) -> str:
    return f"pool{pool_seed}-{r}"


def pool_prompt(pool_seed: int, j: int, block_size: int) -> GenPrompt:
    """The pool's j-th prompt: lengths and prefix lengths as the generator draws them (on and
    next to block boundaries), without the rare long ones."""
    rng = random.Random(f"kvfuzz/pool/{pool_seed}/{j}")
    bs = block_size
    if rng.random() < 0.4:
        length = max(1, bs * rng.randint(1, 16) + rng.choice((-1, 0, 0, 1)))
    else:
        length = rng.randint(8, 700)
    prefix = min(length, rng.choice([bs, 2 * bs, 4 * bs, 8 * bs, 16 * bs, 2 * bs + 1, 4 * bs - 1,
                                     rng.randint(1, max(1, length))]))
    return GenPrompt(length=length, prefix_group=pool_group(pool_seed, j % GROUPS), prefix_len=prefix,
                     seed=rng.randrange(1 << 30))


def reuse_prompts(events: list[SendEvent | CancelEvent], seed: int, engine: EngineConfig,
                  opts: GenOptions) -> list[SendEvent | CancelEvent]:
    """``events`` with prompts taken from the pool (module docstring). Drawn with an RNG of
    its own (from the trace seed), so the rest of the trace is what it would be without reuse."""
    rng = random.Random(f"kvfuzz/reuse/{seed}")
    groups: dict[str, int | None] = {}  # the trace's group -> its pool group (None: kept)
    out: list[SendEvent | CancelEvent] = []
    for ev in events:
        if isinstance(ev, SendEvent) and isinstance(ev.prompt, GenPrompt):
            ev = _reuse(ev, ev.prompt, rng, groups, engine, opts)
        out.append(ev)
    return out


def _reuse(ev: SendEvent, prompt: GenPrompt, rng: random.Random, groups: dict[str, int | None],
           engine: EngineConfig, opts: GenOptions) -> SendEvent:
    n_per_group = max(1, opts.pool_size // GROUPS)
    # A prompt longer than any of the pool's is KV pressure (preemption bugs need it): it keeps
    # its length; only its prefix may move with its group.
    long = prompt.length > max_pool_len(engine.block_size)
    if prompt.prefix_group is None:
        if long:
            return ev
        if rng.random() >= opts.prompt_reuse:
            return ev
        j = rng.randrange(opts.pool_size)
    else:
        if prompt.prefix_group not in groups:
            groups[prompt.prefix_group] = rng.randrange(GROUPS) if rng.random() < opts.prompt_reuse else None
        r = groups[prompt.prefix_group]
        if r is None:
            return ev
        if long or rng.random() >= 2 / 3:  # the pool's prefix, the request's own length and tail
            pooled = pool_prompt(opts.pool_seed, r, engine.block_size)  # group r's first entry's prefix
            prefix = min(prompt.prefix_len, prompt.length)
            return ev.model_copy(update={"prompt": GenPrompt(length=prompt.length, prefix_group=pooled.prefix_group,
                                                             prefix_len=prefix, seed=prompt.seed)})
        j = r + GROUPS * rng.randrange(n_per_group)
    pooled = pool_prompt(opts.pool_seed, j, engine.block_size)
    max_tokens = pool_max_tokens(opts.pool_seed, j, opts)
    if pooled.length + max_tokens > engine.max_model_len:
        return ev
    return ev.model_copy(update={"prompt": pooled, "max_tokens": max_tokens})
