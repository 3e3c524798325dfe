"""Errors with an exit code. The CLI prints ``str(err)`` as one line and exits with ``code``."""

from __future__ import annotations


class KvfuzzError(Exception):
    code = 1


class BadInput(KvfuzzError):
    """Bad user input: a file, field or flag. Exit code 2."""

    code = 2

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        parts = [p for p in (source, field) if p]
        # One line, always: field names and messages can come from a hostile file's keys.
        text = ": ".join(parts + [message])
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))


class InfraError(KvfuzzError):
    """The engine or server could not start, died, hung, or the URL does not answer. Exit 3."""

    code = 3
