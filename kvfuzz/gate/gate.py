"""The regression gate, as a library: shared by ``kvfuzz gate`` and the pytest plugin.

``plan`` turns corpus files into cases (file x arm); ``GateRunner.run`` replays one case on a
``Session`` and judges it with ``oracle.gate``. Nothing here imports vLLM until an engine starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvfuzz.driver.arms import replay_command
from kvfuzz.oracle.gate import Case
from kvfuzz.driver.session import Session
from kvfuzz.traces import Finding, GateCase, Trace, load_any
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.foreign import ForeignFinding

SELF_TEST_CLEAN = "clean"


def bundled_corpus() -> Path:
    """``traces/regressions/`` as installed (package data)."""
    return Path(str(resources.files("kvfuzz.traces") / "regressions"))


def collect(paths: list[Path]) -> list[Path]:
    """Every ``*.json`` under the given files/directories, in a stable order."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.json") if q.is_file())
            if not found:
                raise BadInput("no .json finding or trace files here", source=str(p), field="PATH")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise BadInput("no such file or directory", source=str(p), field="PATH")
    seen: set[Path] = set()
    unique = []
    for f in files:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique


@dataclass
class Entry:
    path: Path
    trace: Trace
    kind: str  # trace, finding, foreign

    @property
    def name(self) -> str:
        return self.trace.name or self.path.stem


def load(path: Path, overrides: list[str] | None = None) -> Entry:
    obj = load_any(path)
    if isinstance(obj, Finding):
        e = Entry(path, obj.trace, "finding")
    elif isinstance(obj, ForeignFinding):
        e = Entry(path, obj.trace, "foreign")
    else:
        e = Entry(path, obj, "trace")
    if overrides:
        e.trace = apply_overrides(e.trace, overrides, source=str(path))
    return e


def apply_overrides(trace: Trace, overrides: list[str], *, source: str | None = None) -> Trace:
    """``KEY=VALUE`` settings of the trace's engine configuration (dotted keys, JSON values or
    plain strings): the same corpus then runs on a real model and backend, e.g.
    ``model=Qwen/Qwen2.5-0.5B-Instruct``, ``dtype=bfloat16``, ``kv_cache_bytes=null``,
    ``extra_args.attention_backend=FLASHINFER``."""
    import json

    from pydantic import ValidationError

    engine = trace.engine.model_dump(mode="json")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise BadInput(f"{item!r}: expected KEY=VALUE", field="--override")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = engine
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                raise BadInput(f"{item!r}: engine has no section {part!r}", field="--override")
            node = node[part]
        if not path and last not in engine:
            raise BadInput(f"{item!r}: unknown engine setting {last!r} (known: {', '.join(sorted(engine))})",
                           field="--override")
        node[last] = value
    data = trace.model_dump(mode="json")
    data["engine"] = engine
    try:
        return Trace.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise BadInput(f"after --override: {where}: {err['msg']}", source=source, field="--override") from None


def in_dtype(trace: Trace, dtype: str) -> Trace:
    """``trace`` on its engine in ``dtype`` (``--dtype``): the KV cache keeps its capacity in
    tokens, so the trace's KV pressure survives (EngineConfig.with_dtype)."""
    return trace.model_copy(update={"engine": trace.engine.with_dtype(dtype)})


@dataclass
class Planned:
    entry: Entry
    arm: str
    toggles: list[str]
    expect_fail: bool = False
    skipped: str | None = None

    @property
    def id(self) -> str:
        return f"{self.entry.name}[{self.arm}]"


def default_runs(kind: str) -> int:
    """Runs per case: one in-process (replays are step-exact), three over HTTP."""
    return 1 if kind == "inprocess" else 3


def gate_plan(entries: list[Entry], arms: dict[str, list[str]]) -> list[Planned]:
    """The gate proper: every file in every arm; nothing is expected to fail."""
    out = [Planned(e, a, list(t)) for e in entries for a, t in arms.items()]
    return _by_engine(out)


def self_test_plan(entries: list[Entry], device: str) -> list[Planned]:
    """Both directions: each file passes in the clean arm, and fails in each arm its
    ``expect.fails_in`` names. Arms whose toggle cannot change outputs on ``device`` (or does
    not apply to the installed vLLM) are skipped with the reason."""
    from kvfuzz.harness import toggles as reg

    clean = reg.clean_set(device)
    out: list[Planned] = []
    for e in entries:
        exp = e.trace.expect
        if exp is None or exp.passes_clean:
            out.append(Planned(e, SELF_TEST_CLEAN, list(clean)))
        for arm in exp.fails_in if exp else []:
            how, _, name = arm.partition(":")
            if name not in reg.names():
                raise BadInput(f"unknown toggle {name!r} in {arm!r} (see `kvfuzz toggles`)",
                               source=str(e.path), field="expect.fails_in")
            t = reg.get(name)
            why = reg.self_check(t)
            if why is not None:
                out.append(Planned(e, arm, [], True, skipped=f"{name} does not apply to the installed vLLM: {why}"))
            elif not t.changes_outputs_on(device):
                out.append(Planned(e, arm, [], True, skipped=f"{name} cannot change outputs on {device} "
                                                          f"(only on {', '.join(t.backends)})"))
            elif how == "with":
                out.append(Planned(e, arm, sorted(set(clean) | {name}), True))
            elif name not in clean:
                out.append(Planned(e, arm, [], True, skipped=f"{name} is not in the clean arm on {device}"))
            else:
                out.append(Planned(e, arm, [x for x in clean if x != name], True))
    return _by_engine(out)


def _by_engine(cases: list[Planned]) -> list[Planned]:
    # Same engine configuration together: one engine (re)start per configuration. Stable, so
    # file order is kept within a configuration.
    first: dict[str, int] = {}
    for i, c in enumerate(cases):
        first.setdefault(c.entry.trace.engine.key(), i)
    return sorted(cases, key=lambda c: first[c.entry.trace.engine.key()])


class GateRunner:
    """Replays planned cases on one ``kvfuzz.driver.session.Session``."""

    def __init__(self, session: Session, *, runs: int, strict: bool = False, engine_args: list[str] | None = None,
                 findings_dir: Path | None = None) -> None:
        self.session = session
        self.runs = runs
        self.strict = strict
        self.engine_args = list(engine_args or [])
        self.findings_dir = findings_dir

    def run(self, p: Planned) -> tuple[Case, Finding | None]:
        case = Case(source=str(p.entry.path), name=p.entry.name, arm=p.arm, toggles=list(p.toggles),
                    expect_fail=p.expect_fail, skipped=p.skipped, strict=self.strict,
                    replay_command=replay_command(str(p.entry.path), "gate", p.toggles, self.runs,
                                                   self.engine_args))
        if p.skipped:
            return case, None
        t0 = time.monotonic()
        try:
            checked = self.session.check(p.entry.trace, runs=self.runs, arms={p.arm: list(p.toggles)})
        except BadInput as e:
            if e.source:
                raise
            # The engine refused the file's configuration: say which file.
            raise BadInput(str(e), source=case.source) from e
        case.seconds = time.monotonic() - t0
        case.verdicts = list(checked.verdicts)
        finding = checked.finding
        if finding is not None and self.findings_dir is not None and (case.diverged and not p.expect_fail):
            from kvfuzz.traces import save
            from kvfuzz.traces.io import finding_path

            finding.provenance.gate = GateCase(source=case.source, arm=p.arm)
            save(finding, finding_path(self.findings_dir, finding))
        return case, finding
