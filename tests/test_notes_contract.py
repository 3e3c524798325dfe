"""Findings hand their machine-read facts over in typed fields (traces/provenance.py), never in
``Finding.notes``: notes are for people. Old findings (schema 1/2) load with those notes moved
into the typed fields."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from kvfuzz.traces import (
    Attribution,
    BoundsUsed,
    CampaignOrigin,
    CrashInfo,
    Finding,
    GateCase,
    MinimizedFrom,
    load_finding,
    parse_finding,
    save,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ["kvfuzz", "traces", "harness", "oracle", "fuzzer", "triage"]
DATA = ROOT / "tests" / "data" / "present"

# Every machine read of a notes key is gone (issues 30 and 31): nothing is allowed.
ALLOWED: set[tuple[str, str]] = set()

# Methods that read one key (copying the notes whole to a new finding reads none).
READ_METHODS = {"get", "pop", "setdefault"}


def _is_notes(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "notes"


def _key(node: ast.AST | None) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "?"


def notes_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of each place ``source`` reads ``<x>.notes``: a subscript that is not
    assigned to, ``.get``/``.pop``/... on it, or ``key in <x>.notes``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_notes(node.value) and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, _key(node.slice)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_notes(node.func.value) \
                and node.func.attr in READ_METHODS:
            found.append((node.lineno, _key(node.args[0] if node.args else None)))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_notes(c) for c in node.comparators):
            found.append((node.lineno, _key(node.left)))
    return found


def test_the_scan_sees_every_kind_of_read():
    src = ("a = f.notes['x']\nb = f.notes.get('y')\nc = 'z' in f.notes\nf.notes['w'] = 1\n"
           "d = f.notes.setdefault('v', {})\n")
    assert sorted(notes_reads(src)) == [(1, "x"), (2, "y"), (3, "z"), (5, "v")]


def test_no_package_code_reads_a_key_from_notes():
    bad = []
    for room in PACKAGE:
        for p in sorted((ROOT / room).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            for line, key in notes_reads(p.read_text(encoding="utf-8")):
                if (rel, key) not in ALLOWED:
                    bad.append(f"{rel}:{line} reads notes[{key!r}]")
    assert not bad, "code reads Finding.notes (notes are for people; use a typed field):\n" + "\n".join(bad)


def test_a_schema_2_finding_loads_with_its_notes_typed():
    raw = json.loads((DATA / "bf16-near-tie.json").read_text())
    assert raw["schema_version"] == 2 and "oracle" in raw["notes"]
    f = parse_finding(raw)
    assert f.schema_version == 3
    assert f.bounds == BoundsUsed(dtype="bfloat16", near_tie=0.25, drift=0.25, teacher=0.25, source="profile",
                                  profile="ee58696d7ef43250")
    assert f.attribution is not None and f.attribution.clean == ["fix-lora-cpu-no-lora-tokens",
                                                                 "fix-lora-reload-prefix-identity"]
    assert f.reproduced_in == ["vanilla"]
    assert f.provenance.campaign == CampaignOrigin(seed=1, index=9, mode="feedback", source="mutant")
    assert f.provenance.lineage[0].parent == "22ba1babdfbb" and f.provenance.lineage[-1].root == "22ba1babdfbb"
    assert f.provenance.minimized_from == MinimizedFrom(id="af4958ab169d", file="nt.json")
    assert set(f.notes) <= {"buckets"}  # bucket membership
    g = load_finding(DATA / "lora-reload-same-path.json")
    assert g.provenance.gate is not None and isinstance(g.provenance.gate, GateCase) and "gate" not in g.notes


def test_an_old_crash_note_migrates_and_a_note_that_does_not_fit_stays(tmp_path):
    raw = json.loads((DATA / "lora-base-original.json").read_text())
    raw["notes"] = {"engine_crash": {"kind": "worker-died", "detail": "x", "deaths": [{"worker": "w1", "detail": "x"}]},
                    "attribution": {"B": "a shape no model knows"}, "triage": "for people"}
    f = parse_finding(raw)
    assert f.crash == CrashInfo(kind="worker-died", detail="x", deaths=[{"worker": "w1", "detail": "x"}])
    assert f.attribution is None and f.notes == {"attribution": {"B": "a shape no model knows"}, "triage": "for people"}
    save(f, tmp_path / "f.json")
    again = load_finding(tmp_path / "f.json")
    assert again == f and json.loads((tmp_path / "f.json").read_text())["schema_version"] == 3


def test_inherit_keeps_what_the_new_finding_lacks():
    base = load_finding(DATA / "bf16-near-tie.json")
    new = base.model_copy(deep=True, update={"attribution": None, "reproduced_in": None, "notes": {"x": 1}})
    new.provenance = new.provenance.model_copy(update={"campaign": None})
    new.bounds = BoundsUsed(near_tie=1.0)
    new.inherit(base)
    assert new.attribution == base.attribution and new.provenance.campaign == base.provenance.campaign
    assert new.bounds == BoundsUsed(near_tie=1.0) and new.notes["x"] == 1 and Attribution() != new.attribution
    assert isinstance(new, Finding)
