"""Every engine knob a campaign draws (fuzzer/configs.py), on the real vLLM CPU engine: a trace
of shared prefixes, a long prompt (chunked, capped) and more requests than a small batch holds
runs clean under each, and the engine reports the knob as set. One knob at a time, its first
variant value."""

import pytest

from kvfuzz.fuzzer import configs
from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, GenPrompt, SendEvent, Trace

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("knob", sorted(configs.VARIANTS))
def test_a_trace_runs_clean_with_one_knob_moved(session, knob):
    base = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096)
    engine = configs.with_knob(base, knob, configs.VARIANTS[knob][0])
    sends = [SendEvent(request_id=f"r{i}", at=At(step=i // 3), max_tokens=6,
                       prompt=GenPrompt(length=(1200 if i == 1 else 96 + 40 * i), prefix_group="g", prefix_len=64,
                                        seed=i))
             for i in range(5)]
    t = Trace(engine=engine, events=sends)
    checked = session.check(t, runs=1)
    assert not divergent(checked.verdicts), [(v.request_id, v.class_, v.detail) for v in divergent(checked.verdicts)]
    (h,) = checked.histories
    assert all(r.token_ids for r in h.requests.values())
    vllm_config = session.engine_for(engine)._llm.vllm_config
    got = {"block_size": vllm_config.cache_config.block_size,
           "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
           "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
           "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
           "max_num_batched_tokens": vllm_config.scheduler_config.max_num_batched_tokens,
           "long_prefill_token_threshold": vllm_config.scheduler_config.long_prefill_token_threshold}[knob]
    assert got == getattr(engine, knob)
