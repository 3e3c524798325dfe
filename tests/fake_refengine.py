"""A fake reference engine child (tests/test_refengine.py): it speaks the reference engine's
protocol (harness/refengine.py ``serve``) and computes a solo output that is a pure function of
the prompt (``solo``), with no vLLM. ``FAKE_REFENGINE`` says how it misbehaves:

- ``ok``: answers every request;
- ``die-after:N``: exits (code 3) on receiving request N+1, unanswered, every time it starts
  (``FAKE_REFENGINE_STARTS`` names a file that counts starts; ``die-first:N``: only the
  first start dies so);
- ``error``: answers every request with an error;
- ``silent``: begins the first request and never answers;
- ``slow:S``: takes S seconds a reference;
- ``late:S``: is up only after S seconds (a reference engine whose engine is still starting).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from kvfuzz.traces import RequestRecord, expand


def solo(send, salt: str = "") -> RequestRecord:
    n = send.max_tokens
    seed = hashlib.sha256((repr(expand(send.prompt)) + salt).encode()).digest()
    toks = [seed[i % 32] for i in range(n)]
    return RequestRecord(request_id=send.request_id, prompt_len=len(expand(send.prompt)), max_tokens=n,
                         token_ids=toks, logprobs=[[(t, -0.5), (t + 1, -1.5)] for t in toks],
                         finish_reason="length")


def main(argv: list[str]) -> None:
    from kvfuzz.harness.refengine import serve

    mode = os.environ.get("FAKE_REFENGINE", "ok")
    starts_file = os.environ.get("FAKE_REFENGINE_STARTS")
    start = 1
    if starts_file:
        p = Path(starts_file)
        start = int(p.read_text() or 0) + 1 if p.exists() else 1
        p.write_text(str(start))
    seen = [0]

    def compute(config, device, send, binding):
        seen[0] += 1
        kind, _, n = mode.partition(":")
        if kind in ("die-after", "die-first") and seen[0] > int(n) and (kind == "die-after" or start == 1):
            os._exit(3)
        if kind == "error":
            raise RuntimeError("no engine here")
        if kind == "silent":
            time.sleep(3600)
        if kind == "slow":
            time.sleep(float(n))
        return solo(send)

    if mode.startswith("late:"):
        time.sleep(float(mode.partition(":")[2]))
    serve(os.fdopen(int(argv[0]), "r"), os.fdopen(int(argv[1]), "w"), compute)


if __name__ == "__main__":
    main(sys.argv[1:])
