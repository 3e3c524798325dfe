"""A moved persistent-batch row leaves its sampling state behind (fault).

When a request finishes, vLLM fills its row of the persistent batch with the batch's last row
(``InputBatch.condense``), copying by hand every per-row field the sampler reads: temperature,
top-k/p, the three penalties, the allowed-token mask, bad words, the generator (the logits
processors' own state moves through ``BatchUpdate``). With this fault the hand-copied sampling
fields stay where they were: the moved request samples with the finished request's penalties
and allowed-token mask (or none), while its KV, tokens and block table move correctly. The
class of bug the persistent batch's row moves risk, on every device (the copy is the same on
CPU and GPU).
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

ROW_STATE = "fault-condense-leaves-sampling-state"
_IB = "vllm.v1.worker.gpu_input_batch"
_FIELDS = ("temperature_cpu", "top_k_cpu", "frequency_penalties_cpu", "presence_penalties_cpu",
           "repetition_penalties_cpu")


def _check() -> str | None:
    return first_problem(
        expect_params(_IB, "InputBatch.condense", "self"),
        expect_source(_IB, "InputBatch.condense", "self.presence_penalties_cpu[empty_index]",
                      "self.allowed_token_ids_mask_cpu_tensor[empty_index]"),
    )


def _patch() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original):
        def condense(self, *args, **kwargs):
            if not is_active(ROW_STATE):
                return original(self, *args, **kwargs)
            kept = {f: getattr(self, f).copy() for f in _FIELDS}
            mask = self.allowed_token_ids_mask_cpu_tensor
            kept_mask = mask.clone() if mask is not None else None
            out = original(self, *args, **kwargs)
            for f, values in kept.items():
                getattr(self, f)[:] = values
            if kept_mask is not None and self.allowed_token_ids_mask_cpu_tensor is not None:
                self.allowed_token_ids_mask_cpu_tensor.copy_(kept_mask)
            return out

        return condense

    wrap_method(InputBatch, "condense", make, tag=ROW_STATE)


register(Toggle(
    name=ROW_STATE,
    kind="fault",
    models="per-request sampling state in the persistent batch (InputBatch.condense); its vacated row "
           "keeping the moved request's mask is vllm#43894",
    process="worker",
    target=f"{_IB}.InputBatch.condense",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="When a finished request's row is filled with the batch's last row, the moved request's "
                "temperature, top-k, penalties and allowed-token mask stay behind: it samples with the "
                "finished request's rules.",
    check=_check,
    patch=_patch,
))
