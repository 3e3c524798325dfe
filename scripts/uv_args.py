"""Print, one per line, the `uv pip install` options that make uv see the package sources this
machine's pip is configured with. scripts/setup.sh runs it before anything is installed; the
logic lives in kvfuzz/versions/uv_args.py (stdlib only), which kvfuzz/versions/releases.py uses too, and is
loaded here by path so that nothing of kvfuzz needs to be importable yet."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "kvfuzz_uv_args", Path(__file__).resolve().parent.parent / "kvfuzz" / "versions" / "uv_args.py")
assert _spec is not None and _spec.loader is not None
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

OPTIONS = _mod.OPTIONS
uv_options = _mod.uv_options
pip_sources = _mod.pip_sources
main = _mod.main

if __name__ == "__main__":
    sys.exit(main())
