"""Type-check kvfuzz with mypy, the way CI's fast tier does (tests/test_typecheck.py).

The repository keeps the rooms as top-level folders that pyproject's ``package-dir`` maps into
``kvfuzz.*``; a type checker reading the tree does not follow that mapping (nor the editable
install's import hook). So this builds the package as Python sees it: a link tree in a
temporary directory (``kvfuzz/`` with ``kvfuzz/traces`` -> ``traces/`` ...; real folders, one
symlink per file, which mypy follows), runs mypy over it with pyproject's ``[tool.mypy]``,
and prints the errors with repository paths. Exit status: mypy's (0: no error).

    .venv/bin/python scripts/typecheck.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import name under kvfuzz/ -> folder, as pyproject.toml's package-dir maps them.
ROOMS = {"traces": "traces", "harness": "harness", "oracle": "oracle", "fuzzer": "fuzzer", "triage": "triage"}


def link_tree(dest: Path) -> dict[str, str]:
    """``dest/kvfuzz``: the package as imported, one symlink per source file. Returns the
    link-tree prefix -> repository prefix map for the error paths."""
    def mirror(src: Path, dst: Path) -> None:
        for p in src.rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.symlink_to(p)

    mirror(ROOT / "kvfuzz", dest / "kvfuzz")
    for name, folder in ROOMS.items():
        mirror(ROOT / folder, dest / "kvfuzz" / name)
    return {f"kvfuzz/{name}/": f"{folder}/" for name, folder in ROOMS.items()}


def check(extra: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """mypy's exit status and output lines (repository paths). ``extra``: modules to add to
    the link tree (path under it -> source), e.g. a test's deliberate error."""
    with tempfile.TemporaryDirectory(prefix="kvfuzz-typecheck-") as tmp:
        paths = link_tree(Path(tmp))
        for rel, text in (extra or {}).items():
            (Path(tmp) / rel).write_text(text)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(Path(tmp) / ".mypy_cache"), "--python-executable", sys.executable, "-p", "kvfuzz"]
        out = subprocess.run(cmd, cwd=tmp, env={**os.environ, "MYPYPATH": tmp}, capture_output=True, text=True)
    lines = []
    for line in (out.stdout + out.stderr).splitlines():
        for link, repo in paths.items():
            if line.startswith(link):
                line = repo + line[len(link):]
                break
        lines.append(line)
    return out.returncode, lines


def main() -> int:
    code, lines = check()
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
