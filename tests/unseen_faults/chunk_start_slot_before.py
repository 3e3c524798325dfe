"""Fault Z (the worker's slot mapping for prefill chunks): written after rules 5.4–5.6 and the
per-key victim (f2bfa8c), which fault Y and the pair Y + P had shown; the bucket rule was not
changed for it.

Each step the worker maps every scheduled token to a KV slot (``BlockTable
.compute_slot_mapping``). With this fault, in a batch of two requests or more, a prefill that
starts past position 0 — a chunk continuing a prompt, or the first chunk after a prefix-cache
hit — writes its first token's KV into the slot before it (over the previous chunk's last
token, or the last token of a cached block other requests may share) and leaves its own slot
as it was. Nothing in the scheduler's or the persistent batch's records changes, so no
post-condition kvfuzz checks breaks. A request alone is never hit, so its reference is right.
"""

from __future__ import annotations

from . import wrap

_TAG = "unseen-fault-chunk-start-slot-before"


def install() -> None:
    from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

    def make(original):
        def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
            original(self, num_reqs, query_start_loc, positions)
            if num_reqs < 2 or self.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                return
            starts = query_start_loc[: num_reqs + 1].tolist()
            for r in range(num_reqs):
                s, e = starts[r], starts[r + 1]
                if e - s < 2 or int(positions[s]) == 0:
                    continue  # prefills that start past position 0 only
                self.slot_mapping.gpu[s] = self.slot_mapping.gpu[s] - 1  # the bug: the slot before

        return compute_slot_mapping

    wrap(BlockTable, "compute_slot_mapping", _TAG, make)
