"""The ``Engine`` protocol: what every harness (in-process engine, managed server, URL) offers
the rest of kvfuzz. Optional capabilities are declared here with a meaning for every engine,
so callers never probe for them (tests/test_layers.py keeps it so)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from kvfuzz.traces import EngineConfig, Environment, History, RequestRecord, SendEvent, Trace
from kvfuzz.traces.calibration import NoiseKey
from kvfuzz.traces.history import StopAtFlip, TopLogprobs
from kvfuzz.traces.trace import Binding

EngineKind = Literal["inprocess", "server", "url"]


def reference_config(config: EngineConfig) -> EngineConfig:
    """The engine configuration of a request's reference (docs/oracle.md): the trace's, without
    speculative decoding, which at temperature 0 must not change an output."""
    return config if config.speculative is None else config.model_copy(update={"speculative": None})


@runtime_checkable
class Engine(Protocol):
    kind: EngineKind
    config: EngineConfig
    device: str

    @property
    def step_exact(self) -> bool:
        """Events land at exact engine steps: the same trace gives the same history."""
        ...

    @property
    def reference_toggles(self) -> list[str]:
        """Toggles of reference runs (the clean arm's fixes; none where toggles cannot apply)."""
        ...

    @property
    def reference_note(self) -> str | None:
        """How references were kept from reusing the runs' KV, when a finding should say so."""
        ...

    @property
    def log_path(self) -> Path | None:
        """The engine's or server's log file, if it has one."""
        ...

    def start(self) -> "Engine": ...

    def close(self) -> None: ...

    def reference_engine(self) -> "Engine":
        """The engine a request's reference runs on: this one, unless the configuration's
        reference is another engine (``reference_config``: speculative decoding off), which is
        then started beside this one and closed with it."""
        ...

    def compatible(self, config: EngineConfig) -> bool: ...

    def replay(self, trace: Trace, *, arm: str = "default", run_index: int = 0,
               toggles: Iterable[str] | None = None, until: Iterable[str] = (),
               settled: StopAtFlip | None = None) -> History:
        """``trace`` once. ``until``: the only requests the caller reads; an engine kvfuzz steps
        stops once each has finished or, with ``settled``, reached its stop (nothing later can
        change what is read of it); the others run the whole trace."""
        ...

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None,
                  binding: Binding | None = None) -> RequestRecord:
        """``send`` alone on a clean cache with the reference toggles: its reference, its adapter
        name bound to ``binding``'s weights (default: the engine configuration's)."""
        ...

    def score(self, send: SendEvent, tokens: Sequence[int], *, binding: Binding | None = None) -> list[TopLogprobs]:
        """Teacher forcing: ``send``'s prompt followed by ``tokens``, alone on a clean cache;
        per token, its logprob first, then the best others (see ``traces.history.Scoring``)."""
        ...

    def environment(self) -> Environment: ...

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds (None: unknown, as for a server over HTTP)."""
        ...

    def noise_key(self) -> NoiseKey:
        """What a calibration profile must match to judge this engine's runs."""
        ...

    def log_tail(self, n: int = 40) -> list[str]: ...

    def recover(self) -> bool:
        """After a crash or hang: kill what is running and be ready for the next run in place
        (True), or False when the engine cannot, and must be closed and started anew."""
        ...
