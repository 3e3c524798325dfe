"""What every harness (in-process engine, managed server, URL) offers the rest of kvfuzz."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from traces import EngineConfig, Environment, History, RequestRecord, SendEvent, Trace


@runtime_checkable
class Engine(Protocol):
    kind: str
    config: EngineConfig

    def start(self) -> "Engine": ...

    def close(self) -> None: ...

    def compatible(self, config: EngineConfig) -> bool: ...

    def replay(self, trace: Trace, *, arm: str = "default", run_index: int = 0,
               toggles: Iterable[str] | None = None) -> History: ...

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None) -> RequestRecord: ...

    def environment(self) -> Environment: ...
