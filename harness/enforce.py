"""The enforcer: hands vLLM's worker, in place, what the monitor's checks expect of a step
(harness/postconditions.py reads vLLM's state and records breaks; this writes). A replay that
enforces a post-condition shows whether a victim is still wrong once that check holds: the
evidence of a second cause, or that a named break caused a victim that broke nothing else
(docs/oracle.md). Only the worker's inputs a check fully determines are enforced
(``oracle.postconditions.REPAIRABLE``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .postconditions import Monitor


class Enforcer:
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def inputs(self, batch: Any, input_ids: Any, positions: Any, names: Iterable[str]) -> None:
        """Each row's own positions (``worker-position``) and token ids (``worker-token``) in
        the step's buffers, right before the forward pass, so whatever put another value there
        (a fault, a toggle) had its say. A batch of another layout is left as it is."""
        import torch

        names = set(names)
        for rid, start, off, n in self.monitor.row_spans(batch):
            if positions is not None and "worker-position" in names and getattr(positions, "ndim", 0) == 1:
                positions[off:off + n].copy_(torch.arange(start, start + n, dtype=positions.dtype))
            want = self.monitor.own_tokens(rid)
            if input_ids is not None and want is not None and "worker-token" in names:
                input_ids[off:off + n].copy_(torch.from_numpy(want).to(input_ids.dtype))

    def adapters(self, batch: Any) -> None:
        """Each scheduled row's LoRA mapping made its request's adapter (``worker-adapter``),
        with the batch's record of the adapters its rows use, right before the runner builds the
        step's LoRA inputs from them. The persistent batch keeps the repair: the next step
        starts from the right state."""
        if self.monitor.disabled:
            return
        mapping = getattr(batch, "request_lora_mapping", None)
        if mapping is None:
            return
        for rid, row in batch.req_id_to_index.items():
            own = self.monitor.own_adapter(rid)
            if own is None:
                continue
            want, lora_request = own
            got = int(mapping[row])
            if got == want:
                continue
            if got:
                users = batch.lora_id_to_request_ids.get(got)
                if users is not None:
                    users.discard(rid)
                    if not users:
                        del batch.lora_id_to_request_ids[got]
                        batch.lora_id_to_lora_request.pop(got, None)
            mapping[row] = want
            if want:
                batch.lora_id_to_request_ids.setdefault(want, set()).add(rid)
                batch.lora_id_to_lora_request[want] = lora_request
