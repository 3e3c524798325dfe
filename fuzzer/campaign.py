"""The campaign driver loop: generate -> record (harness) -> check (oracle) -> write findings.

State lives on disk (``campaign.json``, ``findings/``), written atomically after every trace,
so a campaign killed at any moment loses nothing it had reported and ``--resume`` continues
the same seed sequence.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from traces import EngineConfig, Finding, Trace, atomic_write_text, save
from traces.errors import BadInput

from .generate import GenOptions, generate

CAMPAIGN_FILE = "campaign.json"


def trace_seed(seed: int, index: int) -> int:
    """The i-th trace's seed: a pure function of (campaign seed, index), so a resumed
    campaign continues the same sequence."""
    return int.from_bytes(hashlib.sha256(f"kvfuzz/{seed}/{index}".encode()).digest()[:4], "little")


@dataclass
class CampaignOptions:
    seed: int = 0
    budget_s: float | None = 60.0
    max_traces: int | None = None
    runs: int = 3
    out: Path = Path("kvfuzz-out")
    engine: EngineConfig = field(default_factory=EngineConfig)
    gen: GenOptions | None = None
    resume: bool = False


@dataclass
class CampaignState:
    seed: int
    traces: int = 0
    seconds: float = 0.0
    findings: int = 0
    next_index: int = 0
    by_class: dict[str, int] = field(default_factory=dict)
    finding_files: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    runs: int = 3
    complete: bool = False

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n"


@dataclass
class TraceOutcome:
    index: int
    trace: Trace
    finding: Finding | None
    seconds: float


def load_state(out: Path, opts: CampaignOptions) -> CampaignState:
    path = out / CAMPAIGN_FILE
    if opts.resume and path.exists():
        try:
            data = json.loads(path.read_text())
            state = CampaignState(**data)
        except (ValueError, TypeError) as e:
            raise BadInput(f"cannot resume: unreadable campaign state ({e})", source=str(path)) from None
        if state.seed != opts.seed:
            raise BadInput(f"cannot resume: campaign seed is {state.seed}, --seed says {opts.seed}",
                           source=str(path), field="seed")
        state.complete = False
        return state
    return CampaignState(seed=opts.seed, engine=opts.engine.model_dump(mode="json"), runs=opts.runs)


def run_campaign(opts: CampaignOptions, check_trace: Callable[[Trace], Finding | None],
                 on_outcome: Callable[[TraceOutcome, CampaignState], None] | None = None) -> CampaignState:
    """Run traces until the budget or trace count is used up. ``check_trace`` records and
    checks one trace (harness + oracle) and returns a finding or None."""
    out = opts.out
    (out / "findings").mkdir(parents=True, exist_ok=True)
    state = load_state(out, opts)
    start = time.monotonic()
    base_seconds = state.seconds
    atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
    while True:
        elapsed = time.monotonic() - start
        if opts.max_traces is not None and state.traces >= opts.max_traces:
            break
        if opts.budget_s is not None and elapsed >= opts.budget_s:
            break
        i = state.next_index
        t0 = time.monotonic()
        trace = generate(trace_seed(opts.seed, i), opts.engine, opts.gen)
        finding = check_trace(trace)
        if finding is not None:
            finding.notes.setdefault("campaign", {"seed": opts.seed, "index": i})
            path = out / "findings" / f"{finding.worst_class()}-{finding.id}.json"
            save(finding, path)
            state.findings += 1
            state.finding_files.append(str(path.relative_to(out)))
            counts = Counter(state.by_class)
            counts[finding.worst_class()] += 1
            state.by_class = dict(counts)
        state.traces += 1
        state.next_index = i + 1
        state.seconds = round(base_seconds + time.monotonic() - start, 3)
        atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
        if on_outcome:
            on_outcome(TraceOutcome(i, trace, finding, time.monotonic() - t0), state)
    state.complete = True
    state.seconds = round(base_seconds + time.monotonic() - start, 3)
    atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
    return state
