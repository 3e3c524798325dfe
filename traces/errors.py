"""Errors with an exit code. The CLI prints ``str(err)`` as one line and exits with ``code``.

The kind of an infrastructure failure is its class, never words in its message: a campaign
treats a hang (``EngineHang``) differently from a death (``EngineDied``) and from a server it
cannot reach at all (``Unreachable``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .history import History


def one_line(text: str) -> str:
    """Escape control characters: field names and values come from untrusted files, and the
    error must stay one line on the terminal."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class KvfuzzError(Exception):
    code = 1


class BadInput(KvfuzzError):
    """Bad user input: a file, field or flag. Exit code 2."""

    code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        parts = [p for p in (source, field) if p]
        super().__init__(one_line(": ".join(parts + [message])))


class InfraError(KvfuzzError):
    """The engine or server could not start, died, hung, or the URL does not answer. Exit 3.

    ``history`` is the run that was under way when it happened, if any (a campaign records it
    in an engine-crash finding)."""

    code = 3

    def __init__(self, message: str, *, history: History | None = None):
        super().__init__(message)
        self.history = history


class EngineDied(InfraError):
    """The engine or server process exited (or a step raised) while running a trace."""


class EngineHang(InfraError):
    """The engine or server stopped answering (a step past its deadline, /health silent)."""


class ConfigRefused(KvfuzzError):
    """An engine configuration that fails to start where another one started: the release or
    backend refuses the configuration, not the machine. A campaign skips the trace and counts
    ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Unreachable(InfraError):
    """A server kvfuzz does not manage does not answer (bad URL, refused connection)."""
