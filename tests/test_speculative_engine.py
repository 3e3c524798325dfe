"""Speculative decoding (ngram) on the real vLLM CPU engine, in float32 and bfloat16: drafts
are proposed and accepted, the output equals decoding without it (each request's reference runs
on an engine without speculative decoding), and the reference engine is one beside the fuzzed
one (docs/oracle.md)."""

import pytest

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, GenPrompt, Sampling, SendEvent, Speculative, Trace

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
