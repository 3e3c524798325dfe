"""The house's structure, checked from the source: one namespace, data flowing one way, no
import circles, and typed seams (no probing for capabilities). Reads files and imports
nothing heavy: part of the fast tier."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Import name -> folder, as pyproject.toml's package-dir maps them.
PACKAGES = {"kvfuzz": ROOT / "kvfuzz", "kvfuzz.traces": ROOT / "traces", "kvfuzz.harness": ROOT / "harness",
            "kvfuzz.oracle": ROOT / "oracle", "kvfuzz.fuzzer": ROOT / "fuzzer", "kvfuzz.triage": ROOT / "triage"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if pkg == "kvfuzz" and parts and f"kvfuzz.{parts[0]}" in PACKAGES:
                continue  # not a folder of kvfuzz/ (cannot happen, but keep the map exact)
            mods[name] = path
    return mods


MODULES = _modules()


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(mod: str) -> set[str]:
    """The kvfuzz modules ``mod`` imports, at module level or inside functions (a lazy import
    is still a dependency), except under ``if TYPE_CHECKING``."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            names = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        out |= {n for n in names if n in MODULES and n != mod}
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_the_map_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for pkg, folder in PACKAGES.items():
        assert f'"{pkg}" = "{folder.name}"' in text


def test_oracle_is_pure():
    """oracle/ is histories in, verdicts out: it imports no engine, no triage, no CLI, and
    neither torch nor vLLM."""
    for mod, deps in GRAPH.items():
        if mod.startswith("kvfuzz.oracle"):
            bad = sorted(d for d in deps if not d.startswith(("kvfuzz.oracle", "kvfuzz.traces")))
            assert not bad, f"{mod} imports {bad}"
            tree = ast.parse(MODULES[mod].read_text())
            heavy = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in ast.walk(tree)
                     if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not [h for h in heavy if h and h.split(".")[0] in ("torch", "vllm")], mod


def test_rooms_depend_one_way():
    """traces depends on nothing; harness and oracle only on traces (harness on itself);
    the fuzzer never drives an engine; triage sits above the session."""
    allowed = {
        "kvfuzz.traces": ("kvfuzz.traces",),
        "kvfuzz.harness": ("kvfuzz.harness", "kvfuzz.traces"),
        "kvfuzz.oracle": ("kvfuzz.oracle", "kvfuzz.traces"),
        "kvfuzz.fuzzer": ("kvfuzz.fuzzer", "kvfuzz.traces"),
    }
    for mod, deps in GRAPH.items():
        room = next((r for r in allowed if mod == r or mod.startswith(r + ".")), None)
        if room is None:
            continue
        bad = sorted(d for d in deps if not d.startswith(allowed[room]))
        assert not bad, f"{mod} imports {bad}"


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (its strongly connected components of more than one
    node, Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for m in graph:
        if m not in index:
            visit(m)
    return cycles


def test_no_import_cycles():
    assert not cycles_of(GRAPH)


# -- rooms: folders, not modules (docs/architecture.md draws them) -------------------------------
# A module's room: its top-level folder (kvfuzz.traces ...) or its sub-package of kvfuzz/
# (kvfuzz.driver ...); the modules left at the kvfuzz/ root are the front door.
FRONT_DOOR = {"kvfuzz", "kvfuzz.__main__", "kvfuzz.strategies", "kvfuzz.pytest_plugin"}
# Room -> (floor, the rooms it may import). Imports go down only: a room imports rooms on lower
# floors (test_the_table_is_a_layering), function-level (lazy) imports included.
ROOMS: dict[str, tuple[int, set[str]]] = {
    "traces": (0, set()),
    "harness": (1, {"traces"}),
    "oracle": (1, {"traces"}),
    "fuzzer": (1, {"traces"}),
    "driver": (2, {"traces", "harness", "oracle"}),
    "versions": (2, {"traces", "harness"}),
    "triage": (3, {"traces", "harness", "oracle", "fuzzer", "driver", "versions"}),
    "gate": (4, {"traces", "harness", "oracle", "driver"}),
    "bench": (4, {"traces", "harness", "oracle", "fuzzer", "driver", "triage"}),
    "present": (4, {"traces", "harness", "oracle", "driver"}),
    "scale": (5, {"traces", "harness", "oracle", "fuzzer", "driver", "triage", "gate"}),
    "cli": (6, {"traces", "harness", "oracle", "fuzzer", "driver", "versions", "triage", "gate", "bench", "present",
                "scale"}),
    "front door": (7, {"traces", "harness", "oracle", "fuzzer", "driver", "gate", "cli"}),
}


def room_of(mod: str) -> str:
    if mod in FRONT_DOOR:
        return "front door"
    room = mod.split(".")[1]
    assert room in ROOMS, f"{mod}: not in a room (a new kvfuzz/ root module? give it a room in docs/architecture.md)"
    return room


ROOM_GRAPH: dict[str, set[str]] = {r: set() for r in ROOMS}
for _mod, _deps in GRAPH.items():
    ROOM_GRAPH[room_of(_mod)] |= {room_of(d) for d in _deps} - {room_of(_mod)}


def test_every_module_is_in_a_room():
    assert {room_of(m) for m in MODULES} == set(ROOMS)


def test_the_table_is_a_layering():
    for room, (floor, allowed) in ROOMS.items():
        assert all(ROOMS[a][0] < floor for a in allowed), room


def test_rooms_import_only_the_rooms_below():
    bad = [f"{m} ({room_of(m)}) imports {d} ({room_of(d)})" for m, deps in GRAPH.items() for d in deps
           if room_of(d) != room_of(m) and room_of(d) not in ROOMS[room_of(m)][1]]
    assert not bad, "\n".join(bad)


def test_no_room_cycles():
    """No circle between folders either: module-level acyclicity misses recovery.py importing
    triage while triage imports recovery.py."""
    assert not cycles_of(ROOM_GRAPH)


def test_the_room_check_sees_a_lazy_import(tmp_path, monkeypatch):
    """A function-level import counts: a recovery -> triage arrow can hide in one."""
    mod = tmp_path / "lazy.py"
    mod.write_text("def f():\n    from kvfuzz.triage.attribution import explain_toggles\n")
    monkeypatch.setitem(MODULES, "kvfuzz.driver.lazy", mod)
    deps = imports("kvfuzz.driver.lazy")
    assert deps == {"kvfuzz.triage.attribution"} and room_of("kvfuzz.triage.attribution") not in ROOMS["driver"][1]


def test_the_architecture_page_is_this_table():
    """docs/architecture.md's table of rooms says what ROOMS says (floor and imports)."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit():
            name = cells[0].strip("`").rstrip("/").removeprefix("kvfuzz/")
            may = set() if cells[2].startswith("nothing") else \
                {c.strip() for c in cells[2].replace("all of the above", "").split(",") if c.strip()}
            rows[name] = (int(cells[1]), may)
    # cli "may import all of the above": every room on a lower floor.
    assert rows["cli"] == (ROOMS["cli"][0], set())
    assert ROOMS["cli"][1] == {r for r, (floor, _) in ROOMS.items() if floor < ROOMS["cli"][0]}
    assert {r: v for r, v in rows.items() if r != "cli"} == {r: v for r, v in ROOMS.items() if r != "cli"}


def test_root_rooms_open_with_one_line():
    """Each room under kvfuzz/ says in its first line what it is."""
    for room in ("driver", "versions", "scale", "gate", "bench", "present", "cli"):
        doc = ast.get_docstring(ast.parse((ROOT / "kvfuzz" / room / "__init__.py").read_text()))
        assert doc and doc.splitlines()[0].strip(), room


# The seams where a capability must be declared (harness/base.py Engine, triage/probe.py
# Replayer), not probed for with getattr/hasattr or hidden behind Any.
SEAMS = ["kvfuzz.driver.session", "kvfuzz.harness.runner", "kvfuzz.harness.base", "kvfuzz.driver.recovery",
         "kvfuzz.triage.probe", "kvfuzz.triage.minimize", "kvfuzz.triage.controls", "kvfuzz.triage.finish",
         "kvfuzz.triage.attribution", "kvfuzz.fuzzer.campaign"]


@pytest.mark.parametrize("mod", SEAMS)
def test_seams_declare_capabilities(mod):
    tree = ast.parse(MODULES[mod].read_text())
    probes = [f"line {n.lineno}: {ast.unparse(n)[:60]}" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert not probes, probes
    # Public functions and methods (module level and class level; helpers nested in them are
    # private by construction).
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    defs += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
             if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    anys = [f"line {n.lineno}: {n.name}" for n in defs if not n.name.startswith("_")
            and any("Any" in ast.unparse(a.annotation) for a in [*n.args.args, *n.args.kwonlyargs] if a.annotation)]
    assert not anys, anys


def test_one_top_level_package_is_installed(tmp_path):
    """``pip install -e .`` provides exactly one import package, ``kvfuzz``: from outside the
    repository, the rooms exist only under it."""
    top = metadata.distribution("kvfuzz").read_text("top_level.txt")
    assert top is not None and top.split() == ["kvfuzz"]
    code = ("import importlib.util as u, kvfuzz.oracle, kvfuzz.traces, kvfuzz.harness, kvfuzz.fuzzer, kvfuzz.triage;"
            "print([n for n in ('traces', 'harness', 'oracle', 'fuzzer', 'triage') if u.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr or out.stdout


def test_front_door_names_load_lazily():
    import kvfuzz

    names = set(kvfuzz.__all__)
    assert {"Session", "Trace", "Finding", "load_trace", "save", "run_campaign", "strategies"} <= names
    for name in sorted(names):
        assert getattr(kvfuzz, name) is not None
    code = "import sys, kvfuzz; print(sorted(m for m in ('torch', 'vllm', 'hypothesis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr or out.stdout
