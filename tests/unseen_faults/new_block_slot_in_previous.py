"""Fault W (the worker's slot mapping, where each scheduled token's KV is written): written after
bucket rule 5.3 was committed (0da9af8), for the acceptance runs of issue 30; the rule was not
changed for it.

Each step the worker maps every scheduled token to a KV slot (block id x block size + offset,
``BlockTable.compute_slot_mapping``). With this fault, in a batch of two requests or more, a
decode token that opens a new block is written to offset 0 of the request's *previous* block:
it overwrites the KV of that block's first token and leaves its own slot unwritten. Nothing in
the scheduler's or the persistent batch's records changes (block tables, reference counts and
the prefix-cache map are all right), so none of vLLM's post-conditions that kvfuzz checks
breaks: the bucket falls back to the ablation verdicts. Where the previous block is a
prefix-cache block that other requests share, their KV is overwritten too. A request alone is
never hit, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-new-block-slot-in-previous"


def install() -> None:
    from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

    def make(original):
        def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
            original(self, num_reqs, query_start_loc, positions)
            if num_reqs < 2 or self.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                return
            starts = query_start_loc[: num_reqs + 1].tolist()
            bs = self.block_size
            for r in range(num_reqs):
                s, e = starts[r], starts[r + 1]
                if e - s != 1:
                    continue  # decode tokens only
                p = int(positions[s])
                if p < bs or p % bs:
                    continue
                prev = int(self.block_table.np[r, p // bs - 1])
                self.slot_mapping.gpu[s] = prev * bs  # the bug: the new block's first slot is the previous block's

        return compute_slot_mapping

    wrap(BlockTable, "compute_slot_mapping", _TAG, make)
