"""Loading and saving traces and findings: untrusted input in, atomic writes out."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .errors import BadInput
from .finding import FINDING_SCHEMA_VERSIONS, Finding
from .paths import check_engine
from .trace import SCHEMA_VERSIONS, Trace

if TYPE_CHECKING:
    from .foreign import ForeignFinding

log = logging.getLogger("kvfuzz.traces")

# Finding files come from strangers; a bound keeps a hostile file from exhausting memory.
MAX_FILE_BYTES = 256 * 2**20


# An atomic write's temporary file: ``.NAME.<random>.tmp`` beside its target (hidden, and
# never a name kvfuzz reads).
_TMP_PREFIX, _TMP_SUFFIX = ".", ".tmp"


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write via a temporary file in the same directory, fsync, rename: a reader (or a crash)
    sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{path.name}.", suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sweep_partial_writes(root: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files (``.NAME.*.tmp``) that an ``atomic_write_text`` killed before
    its rename left under ``root``, and return them. The files they were meant to replace are
    intact (old or new, never half); the leftovers are only clutter. Call it only on a directory
    no live process writes into, e.g. a campaign's output when it resumes."""
    root = Path(root)
    if not root.is_dir():
        return []
    swept = sorted(p for p in root.rglob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}") if p.is_file())
    for p in swept:
        p.unlink(missing_ok=True)
    return swept


def save(model: BaseModel, path: str | os.PathLike[str]) -> None:
    atomic_write_text(path, model.model_dump_json(indent=2, by_alias=True) + "\n")


def validation_message(err: ValidationError) -> tuple[str, str]:
    """(field path, message) of the first pydantic error, in one line."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-"))
    msg = first.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    # Union errors repeat the field once per member: keep the path readable.
    loc = loc.replace(".TokenPrompt", "").replace(".GenPrompt", "")
    return loc or "(root)", msg


def read_json(path: str | os.PathLike[str]) -> Any:
    p = Path(path)
    if not p.exists():
        raise BadInput("no such file", source=str(p))
    if p.is_dir():
        raise BadInput("is a directory, expected a JSON file", source=str(p))
    if p.stat().st_size > MAX_FILE_BYTES:
        raise BadInput(f"larger than {MAX_FILE_BYTES} bytes", source=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 text ({e.reason} at byte {e.start})", source=str(p)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})", source=str(p)) from None
    except RecursionError:
        raise BadInput("malformed JSON: nested too deeply", source=str(p)) from None


def _check_version(data: Any, source: str, versions: tuple[int, ...] = SCHEMA_VERSIONS) -> None:
    if not isinstance(data, dict):
        raise BadInput(f"expected a JSON object, got {type(data).__name__}", source=source)
    v = data.get("schema_version", max(versions))
    if v not in versions or isinstance(v, bool):
        raise BadInput(
            f"unsupported schema_version {v!r} (this kvfuzz reads {', '.join(map(str, versions))})",
            source=source,
            field="schema_version",
        )


def parse_trace(data: Any, source: str = "<trace>") -> Trace:
    _check_version(data, source)
    try:
        trace = Trace.model_validate(data)
    except ValidationError as e:
        field, msg = validation_message(e)
        raise BadInput(msg, source=source, field=field) from None
    check_engine(trace.engine, source=source)
    return trace


def parse_finding(data: Any, source: str = "<finding>") -> Finding:
    _check_version(data, source, FINDING_SCHEMA_VERSIONS)
    # An older kvfuzz kept a finding's buckets in notes["buckets"], keyed by text; they are not
    # read (the note stays, for people).
    notes = data.get("notes")
    if not data.get("buckets") and isinstance(notes, dict) and isinstance(notes.get("buckets"), list):
        log.warning("kvfuzz: warning: %s: its bucket memberships were written by an older kvfuzz (text keys) and "
                    "are not read", source)
    try:
        finding = Finding.model_validate(data)
    except ValidationError as e:
        field, msg = validation_message(e)
        raise BadInput(msg, source=source, field=field) from None
    # Paths the engine would read: the finding's trace and any control arm's trace.
    check_engine(finding.trace.engine, source=source, prefix="trace.engine")
    for i, c in enumerate(finding.controls):
        if c.trace is not None:
            check_engine(c.trace.engine, source=source, prefix=f"controls[{i}].trace.engine")
    return finding


def load_trace(path: str | os.PathLike[str]) -> Trace:
    return parse_trace(read_json(path), str(path))


def load_finding(path: str | os.PathLike[str]) -> Finding:
    return parse_finding(read_json(path), str(path))


def load_any(path: str | os.PathLike[str]) -> "Trace | Finding | ForeignFinding":
    """A kvfuzz finding, a kvfuzz trace, or a finding of the fuzzer behind vLLM #39146 et al."""
    data = read_json(path)
    source = str(path)
    if isinstance(data, dict) and data.get("kind") == "finding":
        return parse_finding(data, source)
    if isinstance(data, dict) and "reproduction" in data or _looks_foreign(data):
        from .foreign import parse_foreign

        return parse_foreign(data, source)
    return parse_trace(data, source)


def _looks_foreign(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    events = (data.get("trace") or {}).get("events") if isinstance(data.get("trace"), dict) else None
    return isinstance(events, list) and any(isinstance(e, dict) and "action" in e for e in events)


def finding_path(directory: str | os.PathLike[str], finding: Finding) -> Path:
    """Where a finding is written in ``directory``: ``<worst class>-<id>.json``, so a directory
    listing sorts crashes and corruptions apart."""
    return Path(directory) / f"{finding.worst_class()}-{finding.id}.json"
