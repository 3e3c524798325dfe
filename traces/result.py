"""What checking a trace produces: the recording (harness output) and the checked result
(oracle output). Plain data, so every layer — campaign loop, triage, CLI — passes one type."""

from __future__ import annotations

from dataclasses import dataclass, field

from .finding import Divergence, Environment, Finding
from .history import History, RequestRecord, Scoring
from .trace import Trace


@dataclass
class Recording:
    """A trace replayed ``runs`` times per arm, the references (each request alone on a clean
    cache), and the teacher-forced scorings of diverged runs (see ``Scoring``)."""

    trace: Trace
    histories: list[History]
    references: dict[str, RequestRecord]
    environment: Environment
    arms: dict[str, list[str]] = field(default_factory=dict)
    scores: list[Scoring] = field(default_factory=list)


@dataclass(frozen=True)
class Judged:
    """One replay judged on one victim (triage's probes and ablations): its verdict class and,
    when its tokens all equal the reference's ("ok"), the largest drift of its tokens' logprobs
    from the reference's (nats) against the noise bound for that drift. ``drifted``: no token
    flipped, yet the logprobs moved further than batch-order noise ever moves them — the KV
    the victim read was still wrong."""

    cls: str
    drift: float | None = None
    bound: float | None = None
    # The post-condition named on this request in this replay (oracle/postconditions.py), if any.
    broke: str | None = None
    # The other requests asked about, judged in the same replay (only when this one no longer
    # corrupts: whether the cause moved to another request; see triage/explain.py).
    others: tuple[tuple[str, "Judged"], ...] = ()

    @property
    def drifted(self) -> bool:
        return self.cls == "ok" and self.drift is not None and self.bound is not None and self.drift > self.bound

    @property
    def corrupt(self) -> bool:
        """Still corruption: a corrupted output, or wrong KV that flipped no token."""
        return self.cls in ("engine-crash", "error", "corruption") or self.drifted


@dataclass
class Checked:
    """A recording and its verdicts (one per request per arm); ``finding`` when any diverged."""

    recording: Recording
    verdicts: list[Divergence]
    finding: Finding | None = None

    @property
    def histories(self) -> list[History]:
        return self.recording.histories
