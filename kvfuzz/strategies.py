"""Hypothesis strategies for your own property tests against vLLM (``from kvfuzz.strategies
import traces``). They live in kvfuzz.fuzzer.strategies; docs/fuzzer.md has an example."""

from kvfuzz.fuzzer.strategies import (
    adapter_events,
    adapter_sources,
    cancels,
    lifecycle_traces,
    mutants,
    prompt_lengths,
    prompts,
    samplings,
    traces,
)

__all__ = ["adapter_events", "adapter_sources", "cancels", "lifecycle_traces", "mutants", "prompt_lengths", "prompts",
           "samplings", "traces"]
