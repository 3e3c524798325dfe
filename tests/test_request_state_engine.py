"""Per-request state on the real vLLM CPU engine, in float32 and bfloat16: each field takes effect
as vLLM documents it, and a clean engine's runs equal their references (the oracle's contract,
docs/oracle.md "Per-request state")."""

import pytest

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, CancelEvent, GenPrompt, Sampling, SendEvent, Trace

pytestmark = pytest.mark.engine

EOS = 1
S = Sampling
# One request per field (and a plain one), sharing a prefix, sent over three steps: rows finish
# at different steps and for different reasons while the others keep running.
SPECS = {
    "plain": S(),
    "allowed": S(allowed_token_ids=[5, 9, 17, 33]),
    "bad_words": S(allowed_token_ids=[5, 9, 17, 33], bad_words=["<t5>", "<t9><t17>"]),
    "eos": S(ignore_eos=False, logit_bias={EOS: 6.0}),
    "min_tokens": S(ignore_eos=False, min_tokens=6, logit_bias={EOS: 8.0}),
    "stop_string": S(stop=["<t17>"], allowed_token_ids=[17, 20, 21, 22]),
    "stop_token": S(stop_token_ids=[20], allowed_token_ids=[20, 21, 22, 23]),
    "penalties": S(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
    "n": S(n=3),
    "n_cancelled": S(n=2, allowed_token_ids=[3, 4, 5, 6, 7]),
    "prompt_logprobs": S(prompt_logprobs=2),
}


def _trace(dtype: str) -> Trace:
    events: list = [SendEvent(request_id=name, at=At(step=i % 3), max_tokens=16, sampling=s, priority=i % 3,
                              prompt=GenPrompt(length=40 + 30 * i, prefix_group="g", prefix_len=32, seed=i))
                    for i, (name, s) in enumerate(SPECS.items())]
    events.append(CancelEvent(request_id="n_cancelled", at=At(after_tokens=4)))
    engine = default_engine(dtype=dtype, kv_cache_bytes=8 * 2**20, max_model_len=4096, scheduling_policy="priority")
    return Trace(engine=engine, events=events)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_field_takes_effect_and_a_clean_engine_matches_its_references(session, dtype):
    t = _trace(dtype)
    checked = session.check(t, runs=1)
    assert not divergent(checked.verdicts), [(v.request_id, v.class_, v.detail) for v in divergent(checked.verdicts)]
    (h,) = checked.histories
    r = h.requests
    assert set(r["allowed"].token_ids) <= {5, 9, 17, 33}
    # A one-word bad word never comes; a two-word one never completes.
    bad = r["bad_words"].token_ids
    assert set(bad) <= {9, 17, 33} and (9, 17) not in set(zip(bad, bad[1:])) and 9 in bad
    assert r["eos"].finish_reason == "stop" and r["eos"].token_ids[-1] == EOS
    # min_tokens holds EOS back although its bias is larger than eos's.
    assert r["min_tokens"].finish_reason == "stop" and len(r["min_tokens"].token_ids) > 6
    assert EOS not in r["min_tokens"].token_ids[:6]
    assert r["stop_string"].finish_reason == "stop" and r["stop_string"].token_ids[-1] == 17
    assert r["stop_token"].finish_reason == "stop" and r["stop_token"].token_ids[-1] == 20
    assert r["plain"].finish_reason == "length" and len(r["plain"].token_ids) == 16
    # Prompt logprobs: every position after the first, its own token first, judged by the
    # reference's (the verdicts above); a request that asked for none records none.
    own, ref = r["prompt_logprobs"], checked.recording.references["prompt_logprobs"]
    assert own.prompt_logprobs and len(own.prompt_logprobs) == own.prompt_len - 1 == len(ref.prompt_logprobs or [])
    assert r["plain"].prompt_logprobs is None
    # n: every child is recorded and equals the request alone (its reference).
    children = [r[c] for c in ("n", "n#1", "n#2")]
    assert all(c.token_ids == checked.recording.references["n"].token_ids[:16] for c in children)
    assert r["n_cancelled"].cancelled and r["n_cancelled#1"].cancelled
    # A processed request's logprobs are the processed ones: its chosen token is their top entry.
    assert all(lp[0][0] == tok for tok, lp in zip(r["allowed"].token_ids, r["allowed"].logprobs))
    assert all(v.class_ in ("ok", "truncation") for v in checked.verdicts)
    # Rows moved as requests finished, and the restricted ones moved with their state.
    moved = {r for s in h.steps for r in s.rows_moved}
    assert moved and moved & {name for name, s in SPECS.items() if not s.is_default}


def test_a_row_that_moves_without_its_state_is_caught_and_named(session):
    """A request finishes early and frees its row; a later-admitted restricted request is moved
    into it. With the fault its mask stays behind: the oracle sees corruption, the monitor names
    worker-sampling on the moved request, and a clean run breaks nothing."""
    from kvfuzz.harness.toggles.builtin import ROW_STATE

    engine = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096)
    first = SendEvent(request_id="short", at=At(step=0), max_tokens=2, prompt=GenPrompt(length=40, seed=1))
    moved = SendEvent(request_id="moved", at=At(step=0), max_tokens=12, prompt=GenPrompt(length=50, seed=2),
                      sampling=S(allowed_token_ids=[5, 6, 7], presence_penalty=1.0))
    t = Trace(engine=engine, events=[first, moved])
    clean = session.check(t, runs=1)
    assert not divergent(clean.verdicts) and not clean.histories[0].breaks
    faulty = session.check(t.model_copy(update={"engine": engine.model_copy(update={"toggles": [ROW_STATE]})}),
                           runs=1)
    (v,) = divergent(faulty.verdicts)
    assert v.request_id == "moved" and v.class_ == "corruption" and v.broke == "worker-sampling"
    assert not set(faulty.histories[0].requests["moved"].token_ids) <= {5, 6, 7}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_embeddings_mean_their_tokens_unless_perturbed(session, dtype):
    """Embeddings of the tokens' own rows are the same prompt as the ids (the reference is the id
    prompt); perturbed ones (no token's row) and mixed ones are judged by themselves alone. Id and
    embeddings prompts share a prefix group: vLLM keys cached blocks by the embeddings, so none of
    them reads another's KV."""
    from kvfuzz.traces import PromptEmbeds

    engine = default_engine(dtype=dtype, enable_prompt_embeds=True, kv_cache_bytes=8 * 2**20, max_model_len=4096)

    def prompt(i: int) -> GenPrompt:
        return GenPrompt(length=70, prefix_group="g", prefix_len=64, seed=i)

    t = Trace(engine=engine, events=[
        SendEvent(request_id="ids", at=At(step=0), prompt=prompt(1), max_tokens=12),
        SendEvent(request_id="own", at=At(step=0), prompt=prompt(1), max_tokens=12, embeds=PromptEmbeds()),
        SendEvent(request_id="perturbed", at=At(step=1), prompt=prompt(2), max_tokens=12,
                  embeds=PromptEmbeds(perturbed=[3, 40], scale=2.0, seed=5)),
        SendEvent(request_id="mixed", at=At(step=1), prompt=prompt(3), max_tokens=12,
                  embeds=PromptEmbeds(perturbed=[50], scale=2.0, as_ids=[(0, 33)])),
        SendEvent(request_id="ids2", at=At(step=2), prompt=prompt(2), max_tokens=12)])
    checked = session.check(t, runs=1)
    assert not divergent(checked.verdicts), [(v.request_id, v.detail) for v in divergent(checked.verdicts)]
    (h,) = checked.histories
    r, refs = h.requests, checked.recording.references
    assert r["own"].token_ids == r["ids"].token_ids
    assert r["perturbed"].token_ids != r["ids2"].token_ids  # the noise changed what the prompt means
    assert refs["perturbed"].token_ids == r["perturbed"].token_ids and not h.breaks


def test_the_stale_allowed_mask_of_a_vacated_row_is_named_on_the_request_that_reads_it(session):
    """vLLM #43894's witness (traces/regressions): on 0.32 clean it passes; with a row that keeps
    its mask behind, the unrestricted request added to that row reads it, and its break says so."""
    from kvfuzz.gate.gate import bundled_corpus
    from kvfuzz.harness.toggles.builtin import ROW_STATE
    from kvfuzz.traces import load_trace

    t = load_trace(bundled_corpus() / "vllm-43894-condense-stale-allowed-mask.json")
    assert not divergent(session.check(t, runs=1).verdicts)
    faulty = session.check(t.model_copy(update={"engine": t.engine.model_copy(update={"toggles": [ROW_STATE]})}),
                           runs=1)
    v = {d.request_id: d for d in divergent(faulty.verdicts)}
    assert v["r5"].class_ == "corruption" and v["r5"].broke == "worker-sampling"
    (b,) = [b for b in faulty.histories[0].breaks if b.request == "r5"]
    assert "where the request has none" in b.detail


def test_a_replay_stopped_at_a_child_of_n_waits_for_that_child(session):
    """Triage replays a victim's trace until the victim is done: a completion of n is done when it
    finishes, not when it is admitted (its send's id is the one vLLM tracks)."""
    engine = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096)
    t = Trace(engine=engine, events=[
        SendEvent(request_id="n", at=At(step=0), max_tokens=10, sampling=S(n=3), prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="long", at=At(step=0), max_tokens=30, prompt=GenPrompt(length=50, seed=2))])
    h = session.engine_for(engine).replay(t, until=["n#2"])
    assert h.stopped_at is not None and h.requests["n#2"].finish_reason == "length"
    assert len(h.requests["n#2"].token_ids) == 10 and h.requests["long"].finished_step is None
