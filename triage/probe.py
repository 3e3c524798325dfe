"""How triage replays a candidate trace and judges it: the ``Replayer`` seam and the probe.

A replayer is ``kvfuzz.driver.session.Session`` (in-process engine, managed server or URL) or a
fake in tests; it declares what it can do instead of being probed for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvfuzz.traces import Trace
from kvfuzz.traces.result import Checked, Judged

if TYPE_CHECKING:
    from .minimize import Target


class Replayer(Protocol):
    @property
    def step_exact(self) -> bool:
        """Events land at exact engine steps (the in-process engine), so one replay decides a
        candidate; a wall-clock engine's replays vary."""
        ...

    @property
    def reference_runs(self) -> int:
        """Reference runs (requests alone on a clean cache) computed so far."""
        ...

    def judge(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str]) -> str:
        """The verdict class of ``victim`` in one replay of ``trace`` in ``arm``: only its reference
        is needed, so shrinking the other requests' prompts costs no reference runs."""
        ...

    def judge_victim(self, trace: Trace, *, victim: str, arm: str, toggles: Sequence[str],
                     others: Sequence[str] = (), settle: bool = False) -> Judged:
        """``judge``, and when the victim's tokens equal the reference's, its logprob drift;
        when it no longer corrupts, ``others`` judged in the same replay. ``settle``: the caller
        reads only the class, so the replay may stop where the victim's corruption is final."""
        ...

    def check(self, trace: Trace, *, runs: int | None = None, arms: dict[str, list[str]] | None = None) -> Checked:
        """The full recording and verdicts (runs x arms), as a finding is made."""
        ...


class Probe:
    """One replay of a candidate, judged on the target: does the victim keep its class (and, for
    a named target, its first broken post-condition)?"""

    def __init__(self, replayer: Replayer, target: Target):
        self.replayer, self.target = replayer, target
        self.victim, self.arm, self.toggles = target.victim, target.arm, list(target.toggles)
        self._refs0 = replayer.reference_runs

    @property
    def reference_runs(self) -> int:
        return self.replayer.reference_runs - self._refs0

    def __call__(self, trace: Trace) -> bool:
        if self.target.named:  # its name too: only ``judge_victim`` says it
            j = self.replayer.judge_victim(trace, victim=self.victim, arm=self.arm, toggles=self.toggles)
            return self.target.holds(j.cls, j.broke)
        cls = self.replayer.judge(trace, victim=self.victim, arm=self.arm, toggles=self.toggles)
        return self.target.holds(cls, None)
