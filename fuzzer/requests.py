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

from kvfuzz.traces import EMBEDDED_MODEL, EngineConfig, PromptEmbeds, Sampling, SendEvent, Speculative
from kvfuzz.traces.trace import EMBEDDED_HYBRID, Event

# The embedded models' vocabulary and end-of-sequence token (harness/embedded.py).
EMBEDDED_VOCAB = 512
EMBEDDED_EOS = 1
# A send's state is drawn from these features, one to three at a time.
FEATURES = ("allowed", "bias", "eos", "min_tokens", "stop", "penalties", "n", "prompt_logprobs", "bad_words")
# Those that need the model's vocabulary.
VOCAB_FEATURES = frozenset({"allowed", "bias", "eos", "stop", "bad_words"})
PRIORITIES = (-1, 0, 0, 1, 2)


def with_knobs_of(engine: EngineConfig, other: EngineConfig) -> EngineConfig:
    """``engine`` able to run ``other``'s sends too, for the engine settings drawn per trace
    (``dress``): priority scheduling (sends without a priority have the default one) and prompt
    embeddings (id prompts run as ever)."""
    update: dict[str, object] = {}
    if other.scheduling_policy == "priority":
        update["scheduling_policy"] = "priority"
    if other.enable_prompt_embeds:
        update["enable_prompt_embeds"] = True
    if other.speculative is not None and engine.speculative is None:
        # Valid only where no send has a logit bias (vLLM refuses the pair): callers that merge
        # sends fall back to no speculative decoding (``mutate.graft``).
        update["speculative"] = other.speculative
    return engine.model_copy(update=update) if update else engine


def without_knobs(engine: EngineConfig) -> EngineConfig:
    """``engine`` without the settings drawn per trace: what two traces' engines must share to be
    one engine but for those."""
    return engine.model_copy(update={"scheduling_policy": None, "enable_prompt_embeds": False, "speculative": None})


# Ngram drafting settings a trace may take: (draft tokens, lookup min, lookup max). Few, so a
# campaign's engines stay few enough for the engine pool to keep; one and several drafts a step,
# short and long lookups.
SPECULATIVE = ((1, 1, 2), (3, 1, 3), (5, 2, 4))


def draw_speculative(rng: random.Random) -> Speculative:
    k, low, high = rng.choice(SPECULATIVE)
    return Speculative(num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)


def draws_speculative(seed: int, engine: EngineConfig, p: float) -> bool:
    """Whether trace ``seed``'s engine drafts: with probability ``p`` where ngram drafting
    applies (token ids of a model whose vocabulary kvfuzz knows; LoRA or a KV connector with
    it are left to a later generator). The same stream ``dress`` draws the setting from."""
    return (p > 0 and random.Random(f"kvfuzz/speculative/{seed}").random() < p and knows_vocab(engine)
            and not engine.lora.enabled and engine.kv_connector is None)


def knows_vocab(engine: EngineConfig) -> bool:
    return engine.model in (EMBEDDED_MODEL, EMBEDDED_HYBRID)


def draw_sampling(rng: random.Random, engine: EngineConfig, max_tokens: int) -> Sampling:
    """One send's state: one to three features, drawn so that they take effect at temperature 0
    (a stop rule on a token the request will produce, EOS made likely where it is honoured)."""
    vocab = knows_vocab(engine)
    speculative = engine.speculative is not None
    # vLLM refuses a logit bias with speculative decoding; EOS is then left to the allowed sets.
    features = [f for f in FEATURES if (vocab or f not in VOCAB_FEATURES) and not (speculative and f == "bias")]
    chosen = set(rng.sample(features, rng.choice((1, 1, 2, 2, 3))))
    if speculative and vocab and rng.random() < 0.6:
        # A few allowed tokens make the output repeat itself: ngram lookup then finds drafts the
        # model accepts (a random model's free output gives almost none).
        chosen.add("allowed")
    fields: dict[str, object] = {}
    allowed: list[int] | None = None
    if "allowed" in chosen:
        allowed = sorted(rng.sample(range(4, EMBEDDED_VOCAB), rng.choice((2, 3, 3, 4) if speculative else (2, 3, 5, 8, 16))))
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
        if vocab and not speculative:
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
    if "bad_words" in chosen:
        # Words the request may otherwise choose: from its allowed set where it has one. A
        # two-word entry bans its second word only after its first.
        pool = [t for t in (allowed or range(4, EMBEDDED_VOCAB)) if t != EMBEDDED_EOS]
        words = rng.sample(pool, min(len(pool) - 1, rng.randint(1, 2 if allowed else 8)))
        bad = [f"<t{t}>" for t in words]
        if rng.random() < 0.3:
            bad.append(f"<t{rng.choice(pool)}><t{rng.choice(pool)}>")
        fields["bad_words"] = bad
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


def draw_embeds(rng: random.Random, length: int) -> PromptEmbeds:
    """A prompt as embeddings: the tokens' own rows (half the time), else one to three perturbed
    positions; now and then the first part of the prompt (a shared prefix, mostly) as ids."""
    perturbed = sorted(rng.sample(range(length), min(length, rng.randint(1, 3)))) if rng.random() < 0.5 else []
    as_ids: list[tuple[int, int]] = []
    if length > 1 and rng.random() < 0.3:
        as_ids = [(0, rng.randint(1, length - 1))]
    return PromptEmbeds(perturbed=perturbed, scale=round(rng.uniform(0.5, 2.0), 2), seed=rng.randrange(1 << 30),
                        as_ids=as_ids)


def dress(events: Sequence[Event], seed: int, engine: EngineConfig, *, share: float,
          p_priority: float, p_embeds: float = 0.0, p_spec: float = 0.0) -> tuple[list[Event], EngineConfig]:
    """``events`` with a ``share`` of their sends given per-request state and, with probability
    ``p_priority``, the engine switched to priority scheduling with a priority on every send
    (which request is preempted, and which waits, then follows the priorities); with probability
    ``p_embeds`` the engine takes prompt embeddings and some sends give their prompt as
    embeddings (beside id prompts of the same prefix groups). Sends that are retries of an
    earlier send (the same prompt after a cancel) keep that send's state, as a client's retry
    would."""
    rng = random.Random(f"kvfuzz/request-state/{seed}")
    if share <= 0 and p_priority <= 0 and p_embeds <= 0 and p_spec <= 0:
        return list(events), engine
    priority = rng.random() < p_priority
    if priority:
        engine = engine.model_copy(update={"scheduling_policy": "priority"})
    # Drawn after the others, so a seed's other draws do not depend on it.
    embeds = engine.model == EMBEDDED_MODEL and engine.kv_connector is None and rng.random() < p_embeds
    if embeds:
        engine = engine.model_copy(update={"enable_prompt_embeds": True})
    # Its own stream, so traces without it are drawn as before. Ngram drafting needs token ids
    # (not with embeddings).
    if not embeds and draws_speculative(seed, engine, p_spec):
        spec_rng = random.Random(f"kvfuzz/speculative/{seed}")
        spec_rng.random()
        engine = engine.model_copy(update={"speculative": draw_speculative(spec_rng)})
        share = max(share, 0.7)
    drawn_embeds: dict[str, PromptEmbeds | None] = {}
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
            if embeds:
                if base not in drawn_embeds:
                    drawn_embeds[base] = draw_embeds(rng, ev.prompt.length) if rng.random() < 0.4 else None
                update["embeds"] = drawn_embeds[base]
            ev = ev.model_copy(update=update)
        out.append(ev)
    return out, engine
