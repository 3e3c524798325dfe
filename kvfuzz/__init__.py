"""kvfuzz: a concurrency fuzzer and temperature-0 determinism oracle for vLLM's paged KV cache.

One namespace; the rooms are its subpackages, and data flows one way through them:

- ``kvfuzz.traces``  — the versioned formats: traces (what to send), histories (what came
  back), findings, and the recording/checked results;
- ``kvfuzz.harness`` — engines that replay a trace into histories: in-process vLLM, a managed
  vLLM server, a server at a URL; fault and fix toggles; the embedded model;
- ``kvfuzz.oracle``  — pure checking: histories in, verdicts and findings out;
- ``kvfuzz.fuzzer``  — generation, mutation, Hypothesis strategies, corpus, campaigns;
- ``kvfuzz.triage``  — re-runs that explain a finding: minimization, control arms,
  attribution to toggles.

This module is the front door (names load on first use, so ``import kvfuzz`` imports neither
torch nor vLLM)::

    import kvfuzz
    with kvfuzz.Session() as session:                  # one in-process vLLM engine
        checked = session.check(kvfuzz.load_trace("t.json"))
        if checked.finding:
            kvfuzz.save(checked.finding, "finding.json")  # kvfuzz replay finding.json

Property tests: ``from kvfuzz.strategies import traces`` and the ``kvfuzz_session`` pytest
fixture (docs/fuzzer.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Session": "kvfuzz.driver.session",
    "Recovering": "kvfuzz.driver.recovery",
    "Checked": "kvfuzz.traces.result",
    "Recording": "kvfuzz.traces.result",
    **{name: "kvfuzz.traces" for name in (
        "At", "BadInput", "CancelEvent", "EngineConfig", "Finding", "GenPrompt", "History", "InfraError",
        "SendEvent", "TokenPrompt", "Trace", "load_any", "load_finding", "load_trace", "save")},
    **{name: "kvfuzz.fuzzer" for name in (
        "CampaignOptions", "CampaignState", "GenOptions", "default_engine", "generate", "mutate", "run_campaign")},
    "clean_toggles": "kvfuzz.driver.arms",
    "strategies": "kvfuzz.strategies",
}

__all__ = ["At", "BadInput", "CampaignOptions", "CampaignState", "CancelEvent", "Checked", "EngineConfig",
    "Finding", "GenOptions", "GenPrompt", "History", "InfraError", "Recording", "Recovering", "SendEvent",
    "Session", "TokenPrompt", "Trace", "clean_toggles", "default_engine", "generate", "load_any",
    "load_finding", "load_trace", "mutate", "run_campaign", "save", "strategies"]

if TYPE_CHECKING:
    from kvfuzz import strategies
    from kvfuzz.driver.arms import clean_toggles
    from kvfuzz.fuzzer import CampaignOptions, CampaignState, GenOptions, default_engine, generate, mutate, run_campaign
    from kvfuzz.driver.recovery import Recovering
    from kvfuzz.driver.session import Session
    from kvfuzz.traces import (
        At,
        BadInput,
        CancelEvent,
        EngineConfig,
        Finding,
        GenPrompt,
        History,
        InfraError,
        SendEvent,
        TokenPrompt,
        Trace,
        load_any,
        load_finding,
        load_trace,
        save,
    )
    from kvfuzz.traces.result import Checked, Recording


def __getattr__(name: str) -> Any:
    # PEP 562: load a front-door name on first use. A vLLM process imports kvfuzz for the
    # toggle plugin (kvfuzz.harness.toggles.plugin) and must not pay for the rest.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfuzz' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module == f"kvfuzz.{name}" else getattr(mod, name)
    globals()[name] = value
    return value
