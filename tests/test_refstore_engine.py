"""The reference store changes no verdict: on the real vLLM CPU engine, the same traces judged
with the in-memory memo alone, with the disk store computing, and with every reference served by
the store and computed again (verify 1.0), get the same classes, in float32 and bfloat16."""

from __future__ import annotations

import pytest

from kvfuzz.fuzzer import GenOptions, default_engine, generate, trace_seed
from kvfuzz.harness.refstore import DiskTiers
from kvfuzz.harness.runner import ReferenceStore, ScoreStore

pytestmark = [pytest.mark.engine]

MAX_LEN = 160


def small(trace):
    events = []
    for e in trace.events:
        if e.kind == "send" and e.prompt.length > MAX_LEN:
            p = e.prompt.model_copy(update={"length": MAX_LEN, "prefix_len": min(e.prompt.prefix_len, MAX_LEN)})
            e = e.model_copy(update={"prompt": p}).fitted()  # embeddings within the shorter prompt
        events.append(e)
    return trace.model_copy(update={"events": events})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_traces_get_the_same_verdicts_with_and_without_the_store(session, tmp_path, dtype):
    engine = default_engine(dtype=dtype)
    opts = GenOptions(min_requests=2, max_requests=4, max_tokens=(2, 8), p_long=0.0, p_cancel=0.5,
                      prompt_reuse=0.5, pool_seed=29, pool_size=4)
    traces = [small(generate(trace_seed(29, i), engine, opts)) for i in range(3)]
    saved = session.references, session.scores

    def verdicts():
        return [[(v.request_id, v.arm, v.class_) for v in session.check(t, runs=1).verdicts] for t in traces]

    try:
        session.references, session.scores = ReferenceStore(), ScoreStore()
        without = verdicts()
        tiers = DiskTiers.for_campaign(tmp_path, cache=False)
        session.references, session.scores = ReferenceStore(tiers=tiers), ScoreStore(tiers=tiers)
        computing = verdicts()
        first = session.references
        session.references, session.scores = ReferenceStore(tiers=tiers, verify=1.0), ScoreStore(tiers=tiers)
        stored = verdicts()
        sends = sum(len(t.sends) for t in traces)
        assert session.references.computed == 0 and session.references.verified == sends
        assert first.computed < sends  # the pool's prompts repeat: the store served some already
    finally:
        session.references, session.scores = saved
    assert without == computing == stored
    assert sum(len(v) for v in without) == sum(len(s.completion_ids) for t in traces for s in t.sends)
