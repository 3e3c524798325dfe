"""Token-level comparison of one observed request against its reference."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvfuzz.traces import RequestRecord, Scoring


@dataclass(frozen=True)
class Comparison:
    # same: identical over the expected span; prefix: a shorter stream that agrees with the
    # reference as far as it goes (cancelled or cut short: truncation, not divergence);
    # diverged: some produced token differs.
    kind: Literal["same", "prefix", "diverged"]
    compared: int  # number of positions compared
    first_divergence: int | None = None
    # Reference top-1 minus top-2 logprob at the first divergent position (None: unknown).
    ref_margin: float | None = None
    # The same margin in the observed run, when it carried logprobs.
    run_margin: float | None = None
    # None with kind "diverged": the reference stopped where the run went on.
    ref_token: int | None = None
    # None with kind "diverged": the run ended (end of sequence) where the reference went on.
    got_token: int | None = None
    # The reference's second choice at the first divergent position.
    ref_runner_up: int | None = None
    # Largest |logprob difference| (nats) of the chosen token at the positions before the
    # first divergence, where both produced the same tokens (None: no logprobs to compare). Noise
    # that could flip a near tie moves logprobs by about as much as the tie is wide; a drift
    # far above that says the run's context (its KV) differed.
    prefix_drift: float | None = None


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first position where both have a token and they differ."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None


def gap(a: float, b: float) -> float:
    """|a - b| for two logprobs. vLLM reports NaN where every token was masked: two NaNs agree,
    a NaN against a number is as far apart as logprobs can be."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return abs(a - b)


def margin_at(rec: RequestRecord, i: int) -> float | None:
    if i < len(rec.logprobs) and len(rec.logprobs[i]) >= 2:
        return float(rec.logprobs[i][0][1]) - float(rec.logprobs[i][1][1])
    return None


def runner_up_at(rec: RequestRecord, i: int) -> int | None:
    if i < len(rec.logprobs) and len(rec.logprobs[i]) >= 2:
        return int(rec.logprobs[i][1][0])
    return None


def logprob_drift(ref: RequestRecord, got: RequestRecord, n: int) -> float | None:
    """Max |Δ logprob| of the chosen (top-1) token over positions < ``n`` where both chose it."""
    drift: float | None = None
    for i in range(min(n, len(ref.logprobs), len(got.logprobs))):
        if ref.logprobs[i] and got.logprobs[i] and int(ref.logprobs[i][0][0]) == int(got.logprobs[i][0][0]):
            d = gap(float(ref.logprobs[i][0][1]), float(got.logprobs[i][0][1]))
            drift = d if drift is None else max(drift, d)
    return drift


def early_stop_comparison(ref: RequestRecord, got: RequestRecord, n: int) -> Comparison:
    """A run (``got``) that stopped after ``n`` tokens where the reference produced token ``n``."""
    return Comparison("diverged", compared=n, first_divergence=n, ref_margin=margin_at(ref, n),
                      ref_token=ref.token_ids[n], got_token=None, ref_runner_up=runner_up_at(ref, n),
                      prefix_drift=logprob_drift(ref, got, n))


def compare(ref: RequestRecord, got: RequestRecord, expected_len: int) -> Comparison:
    """Compare ``got`` to ``ref`` over the first ``expected_len`` tokens (the request's
    max_tokens). A reference longer than the request is fine: greedy decoding makes the
    first N tokens of a longer reference the reference for an N-token request."""
    ref_tokens = ref.token_ids[:expected_len]
    got_tokens = got.token_ids[:expected_len]
    i = first_divergence(ref_tokens, got_tokens)
    if i is not None:
        return Comparison("diverged", compared=min(len(ref_tokens), len(got_tokens)), first_divergence=i,
                          ref_margin=margin_at(ref, i), run_margin=margin_at(got, i),
                          ref_token=ref_tokens[i], got_token=got_tokens[i], ref_runner_up=runner_up_at(ref, i),
                          prefix_drift=logprob_drift(ref, got, i))
    if len(got_tokens) < len(ref_tokens):
        return Comparison("prefix", compared=len(got_tokens))
    if len(got_tokens) > len(ref_tokens):
        n = len(ref_tokens)
        if ref.finish_reason == "stop" and not ref.cancelled and ref.error is None:
            # The reference stopped here (EOS or a stop rule); the run, on the same tokens,
            # went on. A stop rule is a function of the tokens, so no numeric noise does that.
            return Comparison("diverged", compared=n, first_divergence=n, ref_token=None,
                              got_token=got_tokens[n], prefix_drift=logprob_drift(ref, got, n))
        # The reference itself was cut short (e.g. a reference run failed part way): we can
        # only vouch for the common part.
        return Comparison("same", compared=n)
    return Comparison("same", compared=len(got_tokens))


def teacher_drifts(rec: RequestRecord, scoring: Scoring) -> list[float]:
    """Per generated position, |the run's decode logprob of its token - the same token's logprob
    when the request alone on a clean cache is teacher-forced through the run's tokens|. The
    scoring covers the run's tokens in order (a scoring of other tokens says nothing about this
    run: none); positions without both logprobs are skipped."""
    if list(scoring.token_ids) != list(rec.token_ids[: len(scoring.token_ids)]):
        return []
    out: list[float] = []
    for i, tok in enumerate(scoring.token_ids):
        if i >= len(rec.logprobs) or i >= len(scoring.logprobs) or not rec.logprobs[i] or not scoring.logprobs[i]:
            continue
        run_tok, run_lp = rec.logprobs[i][0]
        scored_tok, scored_lp = scoring.logprobs[i][0]
        if int(run_tok) != tok or int(scored_tok) != tok:
            continue  # not the same token: the scoring is of another run
        out.append(gap(float(run_lp), float(scored_lp)))
    return out


def prompt_drifts(ref: RequestRecord, rec: RequestRecord) -> list[float]:
    """Per prompt position both recorded, |the run's logprob of the prompt's token - the
    reference's|. Both are a prefill of the same prompt: batch order moves them by noise, wrong
    KV by more."""
    out: list[float] = []
    for a, b in zip(ref.prompt_logprobs or [], rec.prompt_logprobs or []):
        if a and b and int(a[0][0]) == int(b[0][0]):
            out.append(gap(float(a[0][1]), float(b[0][1])))
    return out
