"""Prompt reuse (issue 29): a campaign's pool of prompts that fresh traces draw from.

Real traffic repeats system prompts and documents; a fuzzer that never repeats a prompt
across traces computes a fresh reference for every request. The pool is a pure function of
the campaign seed (``GenOptions.pool_seed``), so iteration i's trace stays a pure function
of (seed, i) and a resumed campaign draws the same prompts. A reused request either takes a
pool prompt whole (its reference is then usually in the store) or only the pool prompt's
prefix group (a shared system prompt with its own tail). The choice of the default
probability is in docs/benchmarks.md ("Reference store and where the time goes").
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvfuzz.traces import CancelEvent, EngineConfig, GenPrompt, SendEvent

if TYPE_CHECKING:
    from .generate import GenOptions

# `kvfuzz run` and `kvfuzz bench`'s default (docs/benchmarks.md, issue 29).
DEFAULT_PROMPT_REUSE = 0.3
# Pool prompts sharing one prefix group: a handful of "system prompts" under many documents.
GROUPS = 4


def pool_max_tokens(pool_seed: int, j: int, opts: GenOptions) -> int:
    """How many tokens a whole reuse of the pool's j-th prompt asks for: always the same, as a
    repeated request does, so its reference is served by the store from its second use on."""
    return random.Random(f"kvfuzz/pool-max/{pool_seed}/{j}").randint(*opts.max_tokens)


def pool_prompt(pool_seed: int, j: int, block_size: int) -> GenPrompt:
    """The pool's j-th prompt (lengths like the generator's short ones, often on block edges)."""
    rng = random.Random(f"kvfuzz/pool/{pool_seed}/{j}")
    if rng.random() < 0.4:
        length = max(1, block_size * rng.randint(1, 16) + rng.choice((-1, 0, 0, 1)))
    else:
        length = rng.randint(8, 700)
    prefix = min(length, rng.choice((block_size, 2 * block_size, 4 * block_size, 4 * block_size - 1)))
    return GenPrompt(length=length, prefix_group=f"pool{pool_seed}-{j % GROUPS}", prefix_len=prefix,
                     seed=rng.randrange(1 << 30))


def reuse_prompts(events: list[SendEvent | CancelEvent], seed: int, engine: EngineConfig,
                  opts: GenOptions) -> list[SendEvent | CancelEvent]:
    """``events`` with some sends' prompts taken from the pool (probability ``opts.prompt_reuse``
    each): two in three whole (with the pool entry's own max_tokens), one in three its prefix
    group only. Drawn with an RNG of its own
    (from the trace seed), so the rest of the trace is what it would be without reuse."""
    rng = random.Random(f"kvfuzz/reuse/{seed}")
    out: list[SendEvent | CancelEvent] = []
    for ev in events:
        if isinstance(ev, SendEvent) and rng.random() < opts.prompt_reuse:
            j = rng.randrange(opts.pool_size)
            pooled = pool_prompt(opts.pool_seed, j, engine.block_size)
            whole = rng.random() < 2 / 3
            max_tokens = pool_max_tokens(opts.pool_seed, j, opts)
            if whole and pooled.length + max_tokens <= engine.max_model_len:
                ev = ev.model_copy(update={"prompt": pooled, "max_tokens": max_tokens})
            elif not whole and isinstance(ev.prompt, GenPrompt) and pooled.prefix_len <= ev.prompt.length:
                ev = ev.model_copy(update={"prompt": GenPrompt(length=ev.prompt.length, prefix_group=pooled.prefix_group,
                                                               prefix_len=pooled.prefix_len, seed=ev.prompt.seed)})
        out.append(ev)
    return out
