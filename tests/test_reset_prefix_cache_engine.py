"""Prefix-cache resets on the real vLLM CPU engine (docs/oracle.md, "Prefix-cache resets"): a
reset of the running requests between two requests sharing a prefix, a plain reset vLLM
declines while they run, and a plain reset of the idle cache before a repeat of the first
prompt change no output, and the history says where each landed and what it did."""

import pytest

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.oracle import divergent
from kvfuzz.traces import At, GenPrompt, ResetPrefixCacheEvent, SendEvent, Trace

pytestmark = pytest.mark.engine


def test_resets_between_requests_sharing_a_prefix_change_no_output(session):
    engine = default_engine(kv_cache_bytes=8 * 2**20, max_model_len=4096)
    first = GenPrompt(length=200, prefix_group="g", prefix_len=160, seed=1)
    t = Trace(engine=engine, events=[
        SendEvent(request_id="r0", at=At(step=0), prompt=first, max_tokens=24),
        # r0 decodes: it is preempted, the cache emptied, and r1's hit on the shared 5 blocks can
        # only land on blocks r0 recomputes.
        ResetPrefixCacheEvent(at=At(step=3), reset_running_requests=True),
        SendEvent(request_id="r1", at=At(step=3), prompt=GenPrompt(length=230, prefix_group="g", prefix_len=160, seed=2),
                  max_tokens=16),
        ResetPrefixCacheEvent(at=At(step=6)),  # r0 and r1 hold blocks: vLLM declines
        ResetPrefixCacheEvent(at=At(step=80)),  # both done: the idle cache is emptied
        SendEvent(request_id="r2", at=At(step=80), prompt=first, max_tokens=8),
    ])
    checked = session.check(t, runs=1)
    assert not divergent(checked.verdicts), [(v.request_id, v.class_, v.detail) for v in divergent(checked.verdicts)]
    assert checked.finding is None
    (h,) = checked.histories
    resets = [e for e in h.events if e.kind == "reset-prefix-cache"]
    assert [(e.actual_step, e.reset, e.effective, e.preempted) for e in resets] == [
        (3, "done", True, ["r0"]), (6, "declined", False, []), (80, "done", True, [])]
    assert "r0" in next(s for s in h.steps if s.step == 3).preempted and h.requests["r0"].num_preemptions == 1
    assert h.requests["r1"].num_cached_tokens and h.requests["r1"].num_cached_tokens % 32 == 0  # r0's recomputed blocks
    assert not h.requests["r2"].num_cached_tokens  # the idle cache was emptied before it
    assert not h.breaks
