"""The ``kvfuzz`` command line. Thin: each command wires the rooms together and reports.

Exit codes everywhere: 0 done (findings or not), 1 divergence reproduced / gate failed,
2 bad input (one line naming the file and field), 3 infrastructure failure (engine or server
would not start, died, or a URL does not answer).
"""

from __future__ import annotations

import sys
import traceback

from kvfuzz.traces.errors import KvfuzzError

from .app import app, debug_enabled, err_console


def main() -> None:
    from kvfuzz.harness.logs import route_vllm_logs

    from . import commands  # noqa: F401  (each command module registers itself on app)

    # Until an engine names its log file: vLLM's records and library warnings (a toggle's
    # self-check imports vLLM) stay off the terminal. --verbose shows them.
    route_vllm_logs(None)

    try:
        app(standalone_mode=True)
    except KvfuzzError as e:
        if debug_enabled():
            traceback.print_exc()
        err_console.print(f"kvfuzz: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        err_console.print("kvfuzz: interrupted", markup=False)
        sys.exit(130)


__all__ = ["app", "main"]
