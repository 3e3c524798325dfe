"""What the managed-server and URL engines share: replay over HTTP, references alone on a
cleaned (or salted) cache, and teacher-forced scoring."""

from __future__ import annotations

from pathlib import Path

from kvfuzz.traces import EngineConfig, History, SendEvent, Trace

from ..base import EngineKind
from .replay import replay_trace
from .wire import HttpTarget


class HttpEngineBase:
    """What the managed-server and URL engines share: replay over HTTP, references."""

    kind: EngineKind = "server"
    config: EngineConfig
    device: str = "unknown"
    target: HttpTarget | None
    request_timeout_s: float = 300.0
    # How references are kept from reusing KV cached by the run under test.
    reference_isolation: str = "reset_prefix_cache"

    def _http_replay(self, trace: Trace, *, arm: str, run_index: int, toggles: list[str],
                     cache_salt: str | None) -> tuple[History, list[str]]:
        assert self.target is not None
        return replay_trace(self.target, trace, engine=self.kind, arm=arm, run_index=run_index, toggles=toggles,
                            cache_salt=cache_salt, timeout_s=self.request_timeout_s)

    @staticmethod
    def _alone_trace(config: EngineConfig, send: SendEvent, max_tokens: int | None) -> Trace:
        at = send.at.model_copy(update={"step": 0, "offset_ms": 0.0})
        one = send.model_copy(update={"at": at, "max_tokens": max_tokens or send.max_tokens})
        return Trace(engine=config.model_copy(update={"toggles": []}), events=[one])

    @property
    def reference_note(self) -> str | None:
        return {
            "reset_prefix_cache": "references: each request alone after POST /reset_prefix_cache",
            "cache_salt": "references: each request alone with a fresh cache_salt (the server does not allow "
                          "resetting its prefix cache; a salted request cannot hit blocks cached by the runs)",
            "none": "references: each request alone, serialized, after the runs; the server's prefix cache could "
                    "not be reset and it rejected cache_salt, so a reference may reuse KV cached by the runs",
        }.get(self.reference_isolation)


    # Wall-clock engines: a replay's timing (and so its schedule) differs run to run.
    @property
    def step_exact(self) -> bool:
        return False

    @property
    def reference_toggles(self) -> list[str]:
        # Vanilla, on purpose: a lone request needs no fix today (the CPU LoRA bug needs a mixed
        # batch), and the current server then serves references without a restart.
        return []

    @property
    def log_path(self) -> Path | None:
        return None

    def log_tail(self, n: int = 40) -> list[str]:
        return []

    def recover(self) -> bool:
        return False

    def kv_capacity_tokens(self) -> int | None:
        return None
