"""Per-request state on generated sends: what vLLM keeps in a persistent-batch row beside the
request's KV (docs/fuzzer.md, "Per-request state").

vLLM moves a request's row when another request finishes (``InputBatch.condense``) or the batch
is reordered (``swap_states``), and the allowed-token mask, the bias, ``min_tokens``, the
penalties' counts, the stop rules and the generator move with it. A wrong move shows only when
rows differ: so a share of the sends get state of their own, drawn so that rows finish at
different steps and for different reasons (EOS, a stop token or string, ``max_tokens``, a cancel)
while their neighbours keep running.

``dress`` has its own random stream (seeded by the trace's seed), so the schedule a seed draws
is the same whatever the share; only the sends' state is added. The embedded model's vocabulary
is known (token i is the word ``<ti>``, EOS is token 1), so masks, biases and stop rules are
drawn on it; another model gets only the fields that need no vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvfuzz.traces import EMBEDDED_MODEL, EngineConfig, Sampling, SendEvent
from kvfuzz.traces.trace import EMBEDDED_HYBRID, Event

# The embedded models' vocabulary and end-of-sequence token (harness/embedded.py).
EMBEDDED_VOCAB = 512
EMBEDDED_EOS = 1
# A send's state is drawn from these features, one to three at a time.
FEATURES = ("allowed", "bias", "eos", "min_tokens", "stop", "penalties", "n", "prompt_logprobs")
# Those that need the model's vocabulary.
VOCAB_FEATURES = frozenset({"allowed", "bias", "eos", "stop"})
PRIORITIES = (-1, 0, 0, 1, 2)


def knows_vocab(engine: EngineConfig) -> bool:
    return engine.model in (EMBEDDED_MODEL, EMBEDDED_HYBRID)


def draw_sampling(rng: random.Random, engine: EngineConfig, max_tokens: int) -> Sampling:
    """One send's state: one to three features, drawn so that they take effect at temperature 0
    (a stop rule on a token the request will produce, EOS made likely where it is honoured)."""
    vocab = knows_vocab(engine)
    features = [f for f in FEATURES if vocab or f not in VOCAB_FEATURES]
    chosen = set(rng.sample(features, rng.choice((1, 1, 2, 2, 3))))
    fields: dict[str, object] = {}
    allowed: list[int] | None = None
    if "allowed" in chosen:
        allowed = sorted(rng.sample(range(4, EMBEDDED_VOCAB), rng.choice((2, 3, 5, 8, 16))))
        if rng.random() < 0.3:
            allowed.append(EMBEDDED_EOS)
        fields["allowed_token_ids"] = allowed
    bias: dict[int, float] = {}
    if "bias" in chosen:
        pool = allowed or range(4, EMBEDDED_VOCAB)
        for t in rng.sample(list(pool), min(len(pool), rng.randint(1, 4))):
            bias[t] = round(rng.choice((-1, 1)) * rng.uniform(0.5, 8.0), 2)
    if chosen & {"eos", "min_tokens"}:
        fields["ignore_eos"] = False
        if vocab:
            # The random model rarely chooses EOS by itself: a bias makes it end at some step.
            bias[EMBEDDED_EOS] = round(rng.uniform(2.0, 7.0), 2)
            if allowed is not None and EMBEDDED_EOS not in allowed:
                allowed.append(EMBEDDED_EOS)
    if "min_tokens" in chosen:
        fields["min_tokens"] = rng.randint(1, max_tokens)
    if bias:
        fields["logit_bias"] = bias
    if "stop" in chosen:
        pool = [t for t in (allowed or range(4, EMBEDDED_VOCAB)) if t != EMBEDDED_EOS]
        picks = rng.sample(pool, min(len(pool), rng.randint(1, 2)))
        if rng.random() < 0.5:
            fields["stop_token_ids"] = picks
        else:
            fields["stop"] = [f"<t{t}>" for t in picks]
    if "penalties" in chosen:
        kind = rng.choice(("presence_penalty", "frequency_penalty", "repetition_penalty", "all"))
        if kind in ("presence_penalty", "all"):
            fields["presence_penalty"] = round(rng.uniform(-1.0, 2.0), 2)
        if kind in ("frequency_penalty", "all"):
            fields["frequency_penalty"] = round(rng.uniform(-1.0, 2.0), 2)
        if kind in ("repetition_penalty", "all"):
            fields["repetition_penalty"] = round(rng.uniform(0.7, 1.8), 2)
    if "n" in chosen:
        fields["n"] = rng.randint(2, 4)
    if "prompt_logprobs" in chosen:
        fields["prompt_logprobs"] = rng.choice((0, 1, 2))
    return Sampling(**fields)  # type: ignore[arg-type]


def dress(events: Sequence[Event], seed: int, engine: EngineConfig, *, share: float,
          p_priority: float) -> tuple[list[Event], EngineConfig]:
    """``events`` with a ``share`` of their sends given per-request state and, with probability
    ``p_priority``, the engine switched to priority scheduling with a priority on every send
    (which request is preempted, and which waits, then follows the priorities). Sends that are
    retries of an earlier send (the same prompt after a cancel) keep that send's state, as a
    client's retry would."""
    rng = random.Random(f"kvfuzz/request-state/{seed}")
    if share <= 0 and p_priority <= 0:
        return list(events), engine
    priority = rng.random() < p_priority
    if priority:
        engine = engine.model_copy(update={"scheduling_policy": "priority"})
    drawn: dict[str, Sampling] = {}
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, SendEvent):
            base = ev.request_id.split("_retry")[0]
            sampling = drawn.get(base)
            if sampling is None:
                sampling = draw_sampling(rng, engine, ev.max_tokens) if rng.random() < share else Sampling()
                drawn[base] = sampling
            if sampling.min_tokens > ev.max_tokens:
                sampling = sampling.model_copy(update={"min_tokens": ev.max_tokens})
            update: dict[str, object] = {"sampling": sampling}
            if priority:
                update["priority"] = rng.choice(PRIORITIES)
            ev = ev.model_copy(update=update)
        out.append(ev)
    return out, engine
