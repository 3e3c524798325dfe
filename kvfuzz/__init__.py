"""kvfuzz: a concurrency fuzzer and temperature-0 determinism oracle for vLLM.

The rooms are top-level packages: ``traces`` (format) -> ``harness`` (engines, servers,
toggles) -> ``oracle`` (verdicts, findings) ; ``fuzzer`` (generation, mutation, campaigns).
This package is the thin CLI that wires them together.
"""

__version__ = "0.1.0"
