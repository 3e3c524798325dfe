"""Typed facts a finding carries besides its verdicts: how the engine crashed, where the
finding came from, the noise bounds it was judged with, and the toggle attribution it got.

Code reads these fields; ``Finding.notes`` is for people only (tests/test_notes_contract.py
fails when package code reads a key from it). Findings written before schema 3 kept these in
``notes``: ``migrate_notes`` moves them into the typed fields when such a file loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# How an engine crash happened: the engine process died or its step raised ("died"), it stopped
# answering or ran past its deadline ("hang"), or a Ray worker process died running the trace
# every time it was tried ("worker-died", kvfuzz/scale/cluster.py).
CrashKind = Literal["hang", "died", "worker-died"]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants", populate_by_name=True)


class WorkerDeath(_Data):
    worker: str
    detail: str = ""


class CrashInfo(_Data):
    """An engine-crash finding's crash: its kind, the engine's log tail (secrets redacted)."""

    kind: CrashKind
    detail: str = ""
    log: str | None = None
    log_tail: list[str] = Field(default_factory=list)
    # The campaign's engine restarts so far, this one included (kvfuzz/driver/recovery.py).
    restarts: int | None = None
    deaths: list[WorkerDeath] = Field(default_factory=list)  # worker-died: each death


class CampaignOrigin(_Data):
    """Which campaign trace exposed the finding (``kvfuzz run``)."""

    seed: int | None = None
    index: int
    mode: str | None = None
    source: str | None = None  # seed, mutant, ...


class GraftInto(_Data):
    generator: str | None = None
    seed: int | None = None


class LineageLink(_Data):
    """One ancestor in the corpus, nearest first: a mutation (``parent`` and its operators,
    ``into`` a fresh trace when grafted) or the root (``root``, its generator and seed)."""

    parent: str | None = None
    operators: list[str] = Field(default_factory=list)
    into: GraftInto | None = None
    root: str | None = None
    generator: str | None = None
    seed: int | None = None


class GateCase(_Data):
    """The gate case (``kvfuzz gate``) whose run saved the finding."""

    source: str
    arm: str | None = None


class ReplayOf(_Data):
    """The file ``kvfuzz replay`` replayed (a finding, a trace or a foreign finding)."""

    source: str
    kind: str


class MinimizedFrom(_Data):
    id: str
    file: str | None = None  # relative to the campaign directory or the finding's


class Provenance(_Data):
    """Where a finding came from."""

    campaign: CampaignOrigin | None = None
    worker: str | None = None  # the Ray worker that found it (kvfuzz run --ray)
    lineage: list[LineageLink] = Field(default_factory=list)
    gate: GateCase | None = None
    replay_of: ReplayOf | None = None
    minimized_from: MinimizedFrom | None = None
    minimized_to: str | None = None  # the id of the minimized finding made from this one

    def under(self, base: Provenance) -> Provenance:
        """These facts, with ``base``'s where these have none."""
        mine = {k: v for k, v in self if v not in (None, [])}
        return base.model_copy(update=mine)


class BoundsUsed(_Data):
    """The noise bounds the verdicts were judged with (oracle/noise.py ``NoiseBounds``) and
    where they came from. Findings written before drift and teacher bounds have only near_tie."""

    dtype: str | None = None
    near_tie: float
    drift: float | None = None
    teacher: float | None = None
    source: str | None = None  # "profile", "default", ...
    profile: str | None = None
    overrides: list[str] = Field(default_factory=list)


class Attribution(_Data):
    """Toggle attribution (triage/attribution.py) ran on the finding: the fixes of the clean
    arm and the arms it added to tell a toggle's doing from vLLM's."""

    clean: list[str] = Field(default_factory=list)
    added_arms: list[str] = Field(default_factory=list)


# notes key of a schema 1/2 finding -> (typed field, model); provenance keys go under provenance.
_TOP: dict[str, tuple[str, type[BaseModel]]] = {"engine_crash": ("crash", CrashInfo), "oracle": ("bounds", BoundsUsed), "attribution": ("attribution", Attribution)}
_PROVENANCE = ("campaign", "worker", "lineage", "gate", "replay_of", "minimized_from", "minimized_to")


def migrate_notes(data: dict[str, Any]) -> dict[str, Any]:
    """A schema 1/2 finding's JSON with its machine-read notes moved into the typed fields. A
    note that does not fit its model stays in ``notes`` (for people; nothing is lost)."""
    notes = data.get("notes")
    if not isinstance(notes, dict) or not notes:
        return data
    data, notes = dict(data), dict(notes)
    for key, (field, model) in _TOP.items():
        if key in notes and data.get(field) is None:
            try:
                data[field] = model.model_validate(notes[key]).model_dump()
            except ValidationError:
                continue
            del notes[key]
    if "reproduced_in" in notes and data.get("reproduced_in") is None and isinstance(notes["reproduced_in"], list) \
            and all(isinstance(a, str) for a in notes["reproduced_in"]):
        data["reproduced_in"] = notes.pop("reproduced_in")
    prov = dict(data.get("provenance") or {})
    for key in _PROVENANCE:
        if key in notes and prov.get(key) in (None, []):
            try:
                Provenance.model_validate({key: notes[key]})
            except ValidationError:
                continue
            prov[key] = notes.pop(key)
    if prov:
        data["provenance"] = prov
    data["notes"] = notes
    return data
