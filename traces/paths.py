"""Paths inside trace and finding files are untrusted: they may not point outside the allowed
directories, and a file may not ask the engine to run code.

A finding comes from a stranger. Its ``engine.model`` and ``engine.lora.adapters`` name
directories the engine will read; a file naming ``/home/you/.ssh`` or ``../../elsewhere``
must be refused, not loaded. Allowed: ``embedded:NAME``, hub-style names (``org/model``,
no ``..``), and paths that resolve inside the kvfuzz cache, the current directory, or a
directory listed in ``KVFUZZ_ALLOWED_PATHS`` (``os.pathsep``-separated). ``trust_remote_code``
in ``engine.extra_args`` would execute Python shipped with a model: refused unless
``KVFUZZ_ALLOW_REMOTE_CODE=1``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BadInput

if TYPE_CHECKING:
    from .trace import EngineConfig

ALLOWED_ENV = "KVFUZZ_ALLOWED_PATHS"
REMOTE_CODE_ENV = "KVFUZZ_ALLOW_REMOTE_CODE"


def kvfuzz_cache() -> Path:
    """The kvfuzz cache directory (the embedded model lives under it); see harness/embedded.py."""
    env = os.environ.get("KVFUZZ_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvfuzz"


def allowed_roots() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(ALLOWED_ENV, "").split(os.pathsep) if p]
    return [kvfuzz_cache(), Path.cwd(), *extra]


def allow(path: str | os.PathLike[str]) -> None:
    """Add ``path`` to this process's allowed directories (a path the user named on the
    command line, such as ``kvfuzz run --model DIR``, is trusted)."""
    have = [p for p in os.environ.get(ALLOWED_ENV, "").split(os.pathsep) if p]
    p = str(Path(path).resolve())
    if p not in have:
        os.environ[ALLOWED_ENV] = os.pathsep.join([*have, p])


def is_path_like(value: str) -> bool:
    """A value the engine would read as a local path (not ``embedded:NAME``)."""
    if value.startswith("embedded:"):
        return False
    return value.startswith(("/", ".", "~")) or ".." in Path(value).parts or Path(value).exists()


def check_path(value: str, *, field: str, source: str | None = None) -> None:
    try:
        if not is_path_like(value):
            return
        p = Path(value).expanduser()
        resolved = (p if p.is_absolute() else Path.cwd() / p).resolve()
    except (ValueError, OSError, RuntimeError) as e:  # NUL bytes, names too long, symlink loops
        raise BadInput(f"not a usable path {value[:80]!r} ({type(e).__name__})", source=source, field=field) from None
    for root in allowed_roots():
        try:
            if resolved.is_relative_to(root.expanduser().resolve()):
                return
        except OSError:
            continue
    raise BadInput(f"path {value!r} is outside the allowed directories (the kvfuzz cache, the current "
                   f"directory, {ALLOWED_ENV})", source=source, field=field)


def check_engine(engine: "EngineConfig", *, source: str | None = None, prefix: str = "engine") -> None:
    """Refuse an engine section that reads outside the allowed directories or runs code."""
    check_path(engine.model, field=f"{prefix}.model", source=source)
    for name, spec in sorted(engine.lora.adapters.items()):
        check_path(spec, field=f"{prefix}.lora.adapters.{name}", source=source)
    if engine.extra_args.get("trust_remote_code") and os.environ.get(REMOTE_CODE_ENV) != "1":
        raise BadInput(f"trust_remote_code would run code shipped with the model; set {REMOTE_CODE_ENV}=1 "
                       f"to allow it", source=source, field=f"{prefix}.extra_args.trust_remote_code")
    for key, value in engine.extra_args.items():
        if isinstance(value, str) and ("dir" in key or "path" in key):
            check_path(value, field=f"{prefix}.extra_args.{key}", source=source)


def check_exists(engine: "EngineConfig", *, source: str | None = None, prefix: str = "engine") -> None:
    """Before a local engine starts: every local directory the engine section names exists
    (a missing model directory is bad input, reported with the file and field)."""
    named = [(f"{prefix}.model", engine.model)]
    if engine.lora.enabled:
        named += [(f"{prefix}.lora.adapters.{n}", v) for n, v in sorted(engine.lora.adapters.items())]
    for field, value in named:
        if value.startswith("embedded:") or not value.startswith(("/", ".", "~")):
            continue
        try:
            ok = Path(value).expanduser().is_dir()
        except (ValueError, OSError, RuntimeError):
            ok = False
        if not ok:
            raise BadInput(f"no such directory {value!r}", source=source, field=field)
