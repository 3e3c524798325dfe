"""The built-in toggles, one module each; importing this registers them all.

Each patch is installed once and gated by ``is_active(name)``, so it is inert until activated.
Names are stable: findings, traces and docs refer to them.
"""

from __future__ import annotations

from .block_table import STALE_TAIL
from .cancel import CANCEL_FREES_SHARED
from .cross_group import CROSS_GROUP_ONE_PHASE
from .early_hit import EARLY_HIT
from .embeds import PENALTY_IDS
from .lora import LORA_BATCH_IDS, LORA_CPU_MASK, LORA_IDENTITY, LORA_NS
from .preempt import PREEMPT_STALE
from .prefix_guard import SAME_STEP_GUARD
from .rows import ROW_STATE
from .speculative import (
    CPU_KERNELS_UNBOUND,
    EMPTY_TOPK,
    EXPAND_FILLS,
    EXPAND_UNWRITTEN,
    MASKED_ROW_RECOVERED,
    MIN_TOKENS_ROWS,
)
from .zeroing import ZERO_RECYCLED

__all__ = ["CANCEL_FREES_SHARED", "CPU_KERNELS_UNBOUND", "EMPTY_TOPK", "EXPAND_FILLS", "EXPAND_UNWRITTEN", "LORA_BATCH_IDS", "CROSS_GROUP_ONE_PHASE", "EARLY_HIT", "LORA_CPU_MASK", "MASKED_ROW_RECOVERED", "MIN_TOKENS_ROWS", "PENALTY_IDS", "LORA_IDENTITY", "LORA_NS", "PREEMPT_STALE", "ROW_STATE",
           "SAME_STEP_GUARD", "STALE_TAIL", "ZERO_RECYCLED"]
