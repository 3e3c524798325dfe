"""The on-disk corpus (AFL's queue) and the scheduler that picks which entry to mutate next.

A corpus is a directory of JSON files, one per entry, each written atomically. An entry is a
trace plus the coverage buckets it reached and the buckets it reached *first*. Plain trace
files and finding files dropped into the directory are seeds too (a finding contributes its
trace), so a regression suite or yesterday's findings can seed today's campaign.
"""

from __future__ import annotations

import datetime as _dt
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfuzz.traces import EngineConfig, Trace, save
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.io import parse_finding, parse_trace, read_json, validation_message

from .feedback import Coverage
from .requests import with_knobs_of


class CorpusEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["corpus-entry"] = "corpus-entry"
    id: str
    trace: Trace
    # Every bucket the trace reached, and those it reached before any other trace.
    buckets: list[str] = Field(default_factory=list)
    novel: list[str] = Field(default_factory=list)
    # EngineConfig.key() + toggles of the run that measured ``buckets``: a later campaign on
    # the same engine can trust them without re-running the trace.
    measured_on: str | None = None
    origin: dict[str, Any] = Field(default_factory=dict)
    created: str | None = None


def measured_key(engine: EngineConfig, arms: dict[str, list[str]] | None) -> str:
    toggles = sorted({t for ts in (arms or {}).values() for t in ts}) or sorted(engine.toggles)
    return f"{engine.key()}/{','.join(toggles)}"


@dataclass
class Seed:
    """A trace found in the corpus directory, re-targeted to the campaign's engine."""

    trace: Trace
    source: str
    entry: CorpusEntry | None = None


def rebase(trace: Trace, engine: EngineConfig) -> Trace | None:
    """The trace on the campaign's engine (None if it cannot run there, e.g. unknown adapters).
    Findings from another KV size or LoRA setting still make useful seeds. A trace with adapter
    lifecycle events keeps its own LoRA section (names, slots: drawn per trace, docs/fuzzer.md)
    on a LoRA engine."""
    if trace.lifecycle and engine.lora.enabled:
        engine = engine.model_copy(update={"lora": trace.engine.lora})
    engine = with_knobs_of(engine, trace.engine)  # drawn per trace (fuzzer/requests.py)
    if trace.engine.key() == engine.key() and trace.engine.toggles == engine.toggles:
        return trace
    try:
        return Trace.model_validate({**trace.model_dump(mode="json", by_alias=True),
                                     "engine": engine.model_dump(mode="json")})
    except ValidationError:
        return None


class Corpus:
    def __init__(self, path: Path):
        self.path = Path(path)

    def entry_path(self, entry_id: str) -> Path:
        return self.path / f"{entry_id}.json"

    def save(self, entry: CorpusEntry) -> Path:
        p = self.entry_path(entry.id)
        save(entry, p)
        return p

    def load_entry(self, entry_id: str) -> CorpusEntry:
        p = self.entry_path(entry_id)
        data = read_json(p)
        try:
            return CorpusEntry.model_validate(data)
        except ValidationError as e:
            fld, msg = validation_message(e)
            raise BadInput(msg, source=str(p), field=fld) from None

    def seeds(self, engine: EngineConfig) -> tuple[list[Seed], list[str]]:
        """Every usable trace in the directory, in file-name order, deduplicated by trace id;
        and the files skipped (with why)."""
        out: dict[str, Seed] = {}
        skipped: list[str] = []
        if not self.path.exists():
            return [], skipped
        for p in sorted(self.path.glob("*.json")):
            data = read_json(p)
            entry = None
            if isinstance(data, dict) and data.get("kind") == "corpus-entry":
                try:
                    entry = CorpusEntry.model_validate(data)
                except ValidationError as e:
                    fld, msg = validation_message(e)
                    raise BadInput(msg, source=str(p), field=fld) from None
                trace = entry.trace
            elif isinstance(data, dict) and data.get("kind") == "finding":
                trace = parse_finding(data, str(p)).trace
            else:
                trace = parse_trace(data, str(p))
            based = rebase(trace, engine)
            if based is None:
                skipped.append(f"{p.name}: does not fit the campaign engine")
                continue
            tid = based.trace_id()
            keep = entry if based is trace else None
            if tid in out and (out[tid].entry is not None or keep is None):
                continue  # first file wins, except that a measured entry beats a plain trace
            out[tid] = Seed(based, p.name, keep)
        return list(out.values()), skipped


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class Item:
    """A corpus entry as the scheduler sees it."""

    id: str
    trace: Trace
    buckets: frozenset[str]
    novel: int
    chosen: int = 0

    @property
    def cost(self) -> int:
        """Tokens the trace makes the engine process (prompts + generated)."""
        return sum(s.prompt.length + s.max_tokens for s in self.trace.sends)


@dataclass
class Scheduler:
    """Picks the next corpus entry to mutate. Entries that brought novel buckets and own rare
    buckets weigh more; each time an entry is picked its weight decays, so fresh entries get
    their turn (AFL's favoured entries + energy, in one weight). Costly entries (many tokens
    to prefill, e.g. after long_pressure) weigh less, as AFL favours fast inputs: the cost is
    the trace's token count, not its measured time, so the choice stays reproducible."""

    items: list[Item] = field(default_factory=list)

    def weight(self, item: Item, cov: Coverage) -> float:
        fresh = 2.0 if item.chosen == 0 else 1.0
        # log2 of the novel count: a campaign's first trace is "novel" in every bucket it
        # reaches (20-odd, against a median of 4 for later entries), so counted
        # linearly it kept 5x the weight of a typical entry long after others reached the same
        # buckets. Rarity says what an entry owns *now*.
        merit = (1.0 + math.log2(1.0 + item.novel)) * (1.0 + cov.rarity(item.buckets))
        return fresh * merit / (1.0 + item.chosen) ** 0.5 / (1.0 + item.cost / 8192) ** 0.5

    def choose(self, rng: random.Random, cov: Coverage) -> Item:
        weights = [self.weight(i, cov) for i in self.items]
        item = rng.choices(self.items, weights=weights)[0]
        item.chosen += 1
        return item

    def add(self, item: Item) -> None:
        self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)
