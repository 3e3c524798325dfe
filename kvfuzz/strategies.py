"""Hypothesis strategies for your own property tests against vLLM (``from kvfuzz.strategies
import traces``). They live in kvfuzz.fuzzer.strategies; docs/fuzzer.md has an example."""

from kvfuzz.fuzzer.strategies import cancels, mutants, prompt_lengths, prompts, traces

__all__ = ["cancels", "mutants", "prompt_lengths", "prompts", "traces"]
