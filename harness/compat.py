"""What kvfuzz's engines need from the installed vLLM release, checked before an engine starts.

The in-process engine (harness/inprocess.py) drives ``LLMEngine`` step by step and hooks
scheduler and block-pool internals; a release whose internals differ is refused with one line
naming the release and suggesting ``--engine server``, never a traceback mid-run. Both engines
pass engine arguments that older releases may lack (``kv_cache_memory_bytes`` ...); those are
refused by name too. Measured per release in docs/releases.md. Imports vLLM lazily.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfuzz.traces.errors import BadInput

from .toggles.checks import expect_attr, expect_params, first_problem

# (module, qualname, leading parameters or None): what harness/inprocess.py calls or wraps.
_LLM = "vllm.v1.engine.llm_engine"
INPROCESS_NEEDS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    (_LLM, "LLMEngine.from_engine_args", None),
    (_LLM, "LLMEngine.add_request", ("self", "request_id", "prompt", "params")),
    (_LLM, "LLMEngine.abort_request", ("self", "request_ids", "internal")),
    (_LLM, "LLMEngine.step", ("self",)),
    (_LLM, "LLMEngine.has_unfinished_requests", ("self",)),
    (_LLM, "LLMEngine.reset_prefix_cache", ("self", "reset_running_requests", "reset_connector")),
    (_LLM, "LLMEngine.collective_rpc", ("self", "method")),
    (_LLM, "LLMEngine.add_lora", ("self", "lora_request")),
    (_LLM, "LLMEngine.remove_lora", ("self", "lora_id")),
    (_LLM, "LLMEngine.list_loras", ("self",)),
    ("vllm.v1.engine.core_client", "InprocClient.get_output", ("self",)),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self",)),
    ("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", ("self", "block")),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.allocate_new_computed_blocks",
     ("self", "request_id", "new_computed_blocks", "num_local_computed_tokens", "num_external_computed_tokens")),
    ("vllm.v1.core.kv_cache_utils", "FreeKVCacheBlockQueue", ("blocks",)),
    ("vllm.v1.engine.core", "cleanup_dist_env_and_memory", None),
    ("vllm.distributed.kv_transfer.kv_transfer_state", "_KV_CONNECTOR_AGENT", None),
    ("vllm.sampling_params", "RequestOutputKind.DELTA", None),
)


def release() -> str:
    from .environment import vllm_version

    return vllm_version() or "no vLLM installed"


def inprocess_problem(needs: Iterable[tuple[str, str, tuple[str, ...] | None]] | None = None) -> str | None:
    """None when the installed vLLM has every internal the in-process engine uses (``needs``,
    default INPROCESS_NEEDS), else the first one missing or changed."""
    return first_problem(*(expect_attr(m, q) if params is None else expect_params(m, q, *params)
                           for m, q, params in (INPROCESS_NEEDS if needs is None else needs)))


def check_inprocess(args: Iterable[str] = ()) -> None:
    """Refuse (exit 2, one line naming the release) to run the in-process engine on a vLLM
    release whose internals it does not know, or with engine arguments ``args`` it lacks."""
    problem = inprocess_problem()
    if problem:
        raise BadInput(f"the in-process engine cannot drive {release()} ({problem}); use --engine server",
                       field="--engine")
    check_engine_args(args)


def engine_arg_names() -> set[str] | None:
    """The fields of the installed vLLM's ``EngineArgs`` (None if it cannot be imported)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 - no vLLM: the engine's own start reports that
        return None
    return {f.name for f in dataclasses.fields(EngineArgs)}


def check_engine_args(keys: Iterable[str], *, known: set[str] | None = None) -> None:
    """Refuse engine arguments the installed release does not have (exit 2, naming them and the
    release) instead of a server that dies on an unknown flag or an EngineArgs TypeError."""
    known = engine_arg_names() if known is None else known
    if known is None:
        return
    missing = sorted(k for k in keys if k != "model" and k not in known)
    if missing:
        raise BadInput(f"{release()} has no engine setting {', '.join(missing)}", field="engine")


def tolerate_kernel_scan() -> None:
    """Let another in-process engine start after one with ngram speculative decoding. vLLM's CPU
    build registers its kernel fallbacks at each engine start by walking every loaded module
    and reading ``vars(x)`` of each value with a ``__dict__`` (vllm/triton_utils/dispatcher.py).
    Ngram drafting loads numba, and with it llvmlite's library wrapper, which answers every
    attribute name — ``__dict__`` with a function wrapper — so that walk raised
    AttributeError and the engine failed to start. The wrapper is made to answer no dunder
    name (nothing in llvmlite asks it for one). A no-op until llvmlite is loaded.

    ``kvfuzz export`` copies this function verbatim into a speculative finding's in-process
    script (its reference engines start after the schedule's): keep it standalone, standard
    library only."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    if lib is None:
        return
    cls = type(lib)
    original = cls.__getattr__
    if getattr(original, "kvfuzz_no_dunders", False):
        return

    def __getattr__(self: object, name: str) -> object:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__.kvfuzz_no_dunders = True  # type: ignore[attr-defined]
    cls.__getattr__ = __getattr__  # type: ignore[method-assign]
    getattr(lib, "_fntab", {}).pop("__dict__", None)
