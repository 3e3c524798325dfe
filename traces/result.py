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


@dataclass
class Checked:
    """A recording and its verdicts (one per request per arm); ``finding`` when any diverged."""

    recording: Recording
    verdicts: list[Divergence]
    finding: Finding | None = None

    @property
    def histories(self) -> list[History]:
        return self.recording.histories
