"""Block-table rows keep stale tails: the fix for vllm#39589 (PR #39591) turned off.

vLLM 0.32 clears a row's block ids when its request leaves the persistent batch
(``BlockTable.clear_row``) and clears the vacated source row when ``condense`` moves a row
(``BlockTable.move_row``). With this fault both keep the old ids past the row's logical end,
which is what the report's FlashInfer page-index copy could read. On CPU the attention kernel
never reads past a row's logical end (``num_blocks_per_row``), so outputs cannot change here:
the toggle is GPU-only in effect and tested on CPU only for being applied (stale ids visible in
the worker's block table).
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

STALE_TAIL = "fault-block-table-stale-tail"
_BT = "vllm.v1.worker.block_table"


def _check() -> str | None:
    return first_problem(
        expect_params(_BT, "BlockTable.clear_row", "self", "row_idx"),
        expect_source(_BT, "BlockTable.clear_row", "num_blocks_per_row[row_idx]", "= 0"),
        expect_params(_BT, "BlockTable.move_row", "self", "src", "tgt"),
        expect_source(_BT, "BlockTable.move_row", "num_blocks_per_row[src]", "block_table_np[src, :num_blocks] = 0"),
        expect_source(_BT, "BlockTable.add_row", "num_blocks_per_row[row_idx] = 0"),
    )


def _patch() -> None:
    from vllm.v1.worker.block_table import BlockTable

    def make_clear(original):
        def clear_row(self, row_idx: int) -> None:
            if not is_active(STALE_TAIL):
                return original(self, row_idx)
            # Forget the row's length but leave its block ids in place.
            self.num_blocks_per_row[row_idx] = 0

        return clear_row

    def make_move(original):
        def move_row(self, src: int, tgt: int) -> None:
            if not is_active(STALE_TAIL):
                return original(self, src, tgt)
            # The pre-fix move: copy the live prefix, leave tgt's old tail and src's ids.
            n = self.num_blocks_per_row[src]
            self.block_table.np[tgt, :n] = self.block_table.np[src, :n]
            self.num_blocks_per_row[tgt] = n
            self.num_blocks_per_row[src] = 0

        return move_row

    wrap_method(BlockTable, "clear_row", make_clear, tag=STALE_TAIL)
    wrap_method(BlockTable, "move_row", make_move, tag=STALE_TAIL)


register(Toggle(
    name=STALE_TAIL,
    kind="fault",
    models="vllm#39589 (fix PR #39591 turned off)",
    process="worker",
    target=f"{_BT}.BlockTable.clear_row / move_row",
    backends=("cuda",),
    versions="0.32",
    description="Rows of the persistent batch's block table keep the previous occupant's block "
                "ids past their logical end. GPU kernels that derive the page count from sequence "
                "lengths (FlashInfer page-index copy, FA2 paged KV) can read them; the CPU kernel "
                "never does, so on CPU the patch is applied but outputs cannot change.",
    check=_check,
    patch=_patch,
))
