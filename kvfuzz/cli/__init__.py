"""The ``kvfuzz`` command line. Thin: each command wires the rooms together and reports.

Exit codes everywhere: 0 done (findings or not), 1 divergence reproduced / gate failed,
2 bad input (one line naming the file and field), 3 infrastructure failure (engine or server
would not start, died, or a URL does not answer).
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from kvfuzz.traces.errors import KvfuzzError

from .app import app, debug_enabled, err_console


def main() -> None:
    # One OpenMP thread per engine process, as vLLM already runs torch for serving (set before
    # anything loads torch; OMP_NUM_THREADS in the environment wins). vLLM's CPU kernels
    # otherwise start one OpenMP thread per core, and several engines on one machine (kvfuzz
    # bench arms, two campaigns, a test run) spin against each other: two concurrent gate runs
    # took 3x longer each (docs/benchmarks.md, "OpenMP threads"); one alone is no faster.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from kvfuzz.harness.logs import route_vllm_logs

    from . import commands  # noqa: F401  (each command module registers itself on app)

    # Until an engine names its log file: vLLM's records and library warnings (a toggle's
    # self-check imports vLLM) stay off the terminal. --verbose shows them.
    route_vllm_logs(None)

    sys.argv[1:] = bare_ray(sys.argv[1:])
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


_RAY_ADDRESS = re.compile(r"^(auto|local|ray://.*|\[?[\w.:-]*\]?:\d+)$")


def bare_ray(args: list[str]) -> list[str]:
    """``--ray`` with no address means a local Ray instance (``--ray local``): Click options
    cannot take an optional value, so a bare ``--ray`` (next word absent, an option, or not
    an address, e.g. a gate PATH) gets ``local`` inserted."""
    out = list(args)
    for k, a in enumerate(out):
        if a == "--":
            break
        if a == "--ray" and (k + 1 == len(out) or not _RAY_ADDRESS.match(out[k + 1])):
            out.insert(k + 1, "local")
            break
    return out


__all__ = ["app", "bare_ray", "main"]
