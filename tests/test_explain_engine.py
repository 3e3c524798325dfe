"""Causal ablation on the real engine (issue 18): for every built-in toggle that changes
outputs on CPU, `explain` names the mechanism the toggle's code path needs (its declared
``needs``), and a mechanism it does not need keeps the divergence."""

from __future__ import annotations

import pytest
from test_toggles import OUTPUT_CHANGING, SMALL, send

from kvfuzz.harness import toggles as reg
from kvfuzz.harness.toggles.builtin import LORA_NS, PREEMPT_STALE
from kvfuzz.triage.explain import explain

pytestmark = pytest.mark.engine


def _preempt_trace(_cfg):
    from kvfuzz.traces import Trace

    return Trace(engine=SMALL, events=[send("X", 0, 1000, seed=1, mt=160), send("Y", 1, 1900, seed=2, mt=100)])


CASES = [*OUTPUT_CHANGING,
         pytest.param(PREEMPT_STALE, _preempt_trace, "Y", [], [PREEMPT_STALE], id="preempt-resume-stale")]


@pytest.mark.parametrize("toggle,make,victim,good,bad", CASES)
def test_explain_names_what_the_toggle_needs(session, lora_engine_config, toggle, make, victim, good, bad):
    finding = session.check(make(lora_engine_config), runs=1, arms={"bad": bad}).finding
    assert finding is not None and victim in {d.request_id for d in finding.divergences}
    needs = list(reg.get(toggle).needs)
    # The LoRA-namespace fault reproduces with the requests one at a time (adapter b reads the
    # blocks adapter a cached earlier): concurrency is a mechanism it does not need.
    extra = ["concurrency"] if toggle == LORA_NS else []
    ex = explain(session, finding, victim=victim, mechanisms=[*needs, *extra])
    outcome = {a.mechanism: a.outcome for a in ex.ablations}
    assert all(outcome[m] == "disappears" for m in needs), outcome
    assert all(outcome[m] == "persists" for m in extra), outcome
    assert ex.needs == needs and ex.victim == victim
    assert ex.summary().startswith("needs: ")
