"""The CLI commands, one module each. Importing this package registers every command on
``kvfuzz.cli.app.app``."""

from . import bench, bisect, calibrate, explain, export, gate, minimize, model, replay, report, run, toggles  # noqa: F401
