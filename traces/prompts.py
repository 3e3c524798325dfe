"""Deterministic expansion of generated prompts into token ids.

The stream is BLAKE2b in counter mode, not Python's ``random``: the same spec must expand to
the same tokens on every Python version and machine, forever, because finding files attached
to bug reports carry only the spec. Tokens are drawn from ``[TOKEN_LOW, TOKEN_HIGH)`` so a
prompt is valid for any model whose vocabulary has at least 512 entries and never contains
the low ids that tokenizers reserve for special tokens.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from .trace import GenPrompt, Prompt, TokenPrompt

TOKEN_LOW = 16
TOKEN_HIGH = 512
_SPAN = TOKEN_HIGH - TOKEN_LOW


# Bounded: long prompts are ~200 KB as tuples; a campaign must keep memory flat.
@lru_cache(maxsize=256)
def _stream(key: str, n: int) -> tuple[int, ...]:
    out: list[int] = []
    counter = 0
    while len(out) < n:
        digest = hashlib.blake2b(f"{key}#{counter}".encode(), digest_size=64).digest()
        # 2 bytes per token; modulo bias over 65536/496 is < 0.8%, irrelevant here.
        for j in range(0, 64, 2):
            out.append(TOKEN_LOW + int.from_bytes(digest[j : j + 2], "little") % _SPAN)
        counter += 1
    return tuple(out[:n])


def prefix_tokens(group: str, n: int) -> list[int]:
    """The first ``n`` tokens of a prefix group; a prefix of every longer request."""
    return list(_stream(f"kvfuzz/prefix/{group}", n))


def expand(prompt: Prompt) -> list[int]:
    """Token ids of a prompt (explicit ones are returned unchanged)."""
    if isinstance(prompt, TokenPrompt):
        return list(prompt.token_ids)
    assert isinstance(prompt, GenPrompt)
    head = prefix_tokens(prompt.prefix_group, prompt.prefix_len) if prompt.prefix_len and prompt.prefix_group else []
    tail_len = prompt.length - len(head)
    # The tail depends on the group too, so two groups with equal seeds still differ.
    tail = list(_stream(f"kvfuzz/tail/{prompt.prefix_group}/{prompt.seed}", tail_len)) if tail_len else []
    return head + tail
