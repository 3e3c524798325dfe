"""Errors with an exit code. The CLI prints ``str(err)`` as one line and exits with ``code``."""

from __future__ import annotations


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
    in an engine-crash finding); ``hang`` says the engine stopped answering rather than died."""

    code = 3

    def __init__(self, message: str, *, history: object = None, hang: bool = False):
        super().__init__(message)
        self.history = history
        self.hang = hang
