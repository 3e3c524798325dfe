"""A clean engine gives no corruption: a seeded campaign of 50 small traces on the real vLLM
CPU engine, base and LoRA requests mixed, with the fix for the known CPU LoRA bug
(docs/findings.md #1) on. Any corruption here is an oracle defect or a new vLLM bug."""

from collections import Counter

import pytest

from kvfuzz.fuzzer import GenOptions, generate, trace_seed
from kvfuzz.harness.toggles.registry import clean_set

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TRACES = 50
MAX_LEN = 192  # prompt tokens; the CPU LoRA ops make long prefills slow


def small(trace):
    """The generated trace with prompts capped (keeping shared prefixes consistent)."""
    events = []
    for e in trace.events:
        if e.kind == "send" and e.prompt.length > MAX_LEN:
            n = MAX_LEN - e.prompt.length % 33  # 160..192: still around block boundaries
            p = e.prompt.model_copy(update={"length": n, "prefix_len": min(e.prompt.prefix_len, n)})
            e = e.model_copy(update={"prompt": p}).fitted()  # embeddings within the shorter prompt
        events.append(e)
    return trace.model_copy(update={"events": events})


def test_clean_engine_gives_no_corruption_over_a_seeded_campaign(session, lora_engine_config):
    # Small traces keep this near a minute: 2-4 requests, <= 192-token prompts, 2-8 tokens.
    opts = GenOptions(min_requests=2, max_requests=4, max_tokens=(2, 8), p_long=0.0,
                      adapters=sorted(lora_engine_config.lora.adapters))
    classes: Counter[str] = Counter()
    adapters: Counter[bool] = Counter()
    bad = []
    for i in range(TRACES):
        t = small(generate(trace_seed(5, i), lora_engine_config, opts))
        adapters.update(s.adapter is not None for s in t.sends)
        # One run: the in-process replay is deterministic (k = 1 suffices there).
        # The clean arm: every fix of a real vLLM bug that changes outputs here (docs/findings.md).
        c = session.check(t, runs=1, arms={"fixed": clean_set("cpu")})
        classes.update(v.class_ for v in c.verdicts)
        bad += [(i, v.request_id, v.class_, v.detail) for v in c.verdicts
                if v.class_ in ("corruption", "error", "engine-crash")]
    assert not bad, bad
    assert sum(classes.values()) >= 2 * TRACES and classes["ok"] >= TRACES  # it compared outputs
    assert classes["truncation"] > 0  # cancels happened and were not called divergences
    assert adapters[True] > 20 and adapters[False] > 20  # base and LoRA requests mixed
