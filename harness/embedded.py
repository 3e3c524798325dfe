"""The embedded default: a tiny random-weight Qwen2 model, its tokenizer and LoRA adapters.

Built locally and deterministically (no hub downloads exist here). Two choices matter:

* ``initializer_range`` is 0.2, not Qwen2's 0.02: with 0.02 the model just repeats its last
  token, so corrupted KV would not change its output and the oracle would be blind. With
  0.2 the continuation depends on the whole context.
* Weights come from numpy's legacy ``RandomState`` (its stream is frozen by numpy's
  compatibility policy) and are written in the safetensors layout by hand, so the bytes — and
  the content hash recorded in every finding — do not depend on torch, transformers or
  safetensors versions.

Shape: 2 layers, hidden 128, 2 attention heads (head_dim 64; the CPU backend rejects 16),
1 KV head, vocab 512, 32768 positions (so 8192-token prompts from the vLLM reports fit in a
16384-token context).

A second model, ``embedded:tiny-hybrid`` (``build_hybrid``), is the same size as a Llama whose
layer 0 is full attention and layer 1 sliding-window attention (window 128): vLLM's hybrid KV
cache manager gives it two KV cache groups (docs/hybrid.md says why this layer order).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.paths import kvfuzz_cache

if TYPE_CHECKING:
    from kvfuzz.traces.trace import PromptEmbeds
    from kvfuzz.traces import EngineConfig

BUILD_VERSION = 2
MODEL_NAME = "tiny-qwen2"
ADAPTERS = ("a", "b", "c")  # three adapters: with max_loras=2, using all three forces swaps
LORA_RANK = 8

VOCAB = 512
HIDDEN = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 256
MAX_POSITIONS = 32768
INIT_STD = 0.2

# Content hash of a correct build (see tests/test_embedded.py): a change here is a change of the
# embedded default and must bump BUILD_VERSION.
EXPECTED_HASH = "f7e501f003f8f558"
MANIFEST = "kvfuzz-model.json"


@dataclass(frozen=True)
class EmbeddedModel:
    root: Path
    model_dir: Path
    adapters: dict[str, Path]
    content_hash: str


# The hybrid model. Layer order matters: vLLM orders KV cache groups by their first layer, and
# only with the full-attention group first can that group's external-token allocation evict
# the sliding-window group's not-yet-touched prefix hits (vllm#44409; docs/hybrid.md).
HYBRID_NAME = "tiny-hybrid"
HYBRID_BUILD_VERSION = 2
HYBRID_LAYER_TYPES = ("full_attention", "sliding_attention")
HYBRID_WINDOW = 128  # 4 blocks of 32: wide enough that the window still holds prefix hits
HYBRID_EXPECTED_HASH = "e897047c16c360e6"


def cache_root(name: str = MODEL_NAME, version: int = BUILD_VERSION) -> Path:
    return kvfuzz_cache() / "models" / f"{name}-v{version}"


# -- writing ------------------------------------------------------------------------------


def _write_safetensors(path: Path, tensors: dict[str, "object"]) -> None:
    """Minimal safetensors writer (F32 only): 8-byte header length, JSON header, raw data."""
    import numpy as np

    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _model_tensors(seed: int, *, layers: int = LAYERS, qkv_bias: bool = True) -> dict[str, object]:
    """Qwen2 layout (q/k/v biases, zero) by default; ``qkv_bias=False`` is the Llama layout of
    the hybrid model. The biases take no random draws, so both share one draw order (and
    content hash) scheme."""
    import numpy as np

    rs = np.random.RandomState(seed)

    def normal(*shape: int) -> object:
        return (rs.standard_normal(size=shape) * INIT_STD).astype("<f4")

    t: dict[str, object] = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            t[p + f"self_attn.{name}_proj.weight"] = normal(rows * HEAD_DIM, HIDDEN)
            if qkv_bias:
                t[p + f"self_attn.{name}_proj.bias"] = np.zeros(rows * HEAD_DIM, "<f4")
        t[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, "<f4")
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, "<f4")
    t["model.norm.weight"] = np.ones(HIDDEN, "<f4")
    t["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return t


def _adapter_tensors(seed: int) -> dict[str, object]:
    import numpy as np

    rs = np.random.RandomState(seed)
    dims = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
            "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN)}
    t: dict[str, object] = {}
    for i in range(LAYERS):
        for proj, (d_in, d_out) in dims.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}."
            # B is random too (peft's init_lora_weights=False): a zero B would be a no-op adapter.
            t[p + "lora_A.weight"] = (rs.standard_normal((LORA_RANK, d_in)) * 0.05).astype("<f4")
            t[p + "lora_B.weight"] = (rs.standard_normal((d_out, LORA_RANK)) * INIT_STD).astype("<f4")
    return t


def _config() -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def _hybrid_config() -> dict[str, object]:
    # vLLM's llama.py reads layer_types + sliding_window per layer (transformers' Llama ignores
    # them; only vLLM runs this model). Qwen2 cannot mix layer types (max_window_layers).
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": len(HYBRID_LAYER_TYPES),
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "mlp_bias": False,
        "attention_bias": False,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "layer_types": list(HYBRID_LAYER_TYPES),
        "sliding_window": HYBRID_WINDOW,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 3,
    }


def _tokenizer() -> dict[str, object]:
    # Word-level: token i is the literal "<ti>". kvfuzz sends token ids; vLLM tokenizes only the
    # words of a request's state (bad words). Every word is also an added token, matched before
    # the model runs: transformers >= 5 replaces a Qwen2 checkpoint's tokenizer model with its
    # byte-level BPE, which would encode no word at all.
    vocab = {f"<t{i}>": i for i in range(VOCAB)}
    specials = [
        {"id": i, "content": f"<t{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": i < 4}
        for i in range(VOCAB)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<t0>"},
    }


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<t0>",
        "eos_token": "<t1>",
        "bos_token": "<t2>",
        "pad_token": "<t3>",
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }


def _adapter_config() -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }


def content_hash(root: Path) -> str:
    """SHA-256 over every file's relative path and bytes (the manifest excluded)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def _build_into(root: Path) -> str:
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    _write_safetensors(model_dir / "model.safetensors", _model_tensors(seed=20261122))
    _write_json(model_dir / "config.json", _config())
    _write_json(model_dir / "generation_config.json", {"bos_token_id": 2, "eos_token_id": 1})
    _write_json(model_dir / "tokenizer.json", _tokenizer())
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config())
    for k, name in enumerate(ADAPTERS):
        d = root / "adapters" / name
        d.mkdir(parents=True)
        _write_safetensors(d / "adapter_model.safetensors", _adapter_tensors(seed=1000 + k))
        _write_json(d / "adapter_config.json", _adapter_config())
    digest = content_hash(root)
    _write_json(root / MANIFEST, {"name": MODEL_NAME, "build_version": BUILD_VERSION, "content_hash": digest,
                                   "adapters": list(ADAPTERS)})
    return digest


def _build_hybrid_into(root: Path) -> str:
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    _write_safetensors(model_dir / "model.safetensors", _model_tensors(seed=20261123, layers=len(HYBRID_LAYER_TYPES), qkv_bias=False))
    _write_json(model_dir / "config.json", _hybrid_config())
    _write_json(model_dir / "generation_config.json", {"bos_token_id": 2, "eos_token_id": 1})
    _write_json(model_dir / "tokenizer.json", _tokenizer())
    _write_json(model_dir / "tokenizer_config.json", _tokenizer_config())
    digest = content_hash(root)
    _write_json(root / MANIFEST, {"name": HYBRID_NAME, "build_version": HYBRID_BUILD_VERSION,
                                   "content_hash": digest, "adapters": []})
    return digest


def _load(root: Path, adapter_names: tuple[str, ...] = ADAPTERS) -> EmbeddedModel | None:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    adapters = {a: root / "adapters" / a for a in adapter_names}
    if not (root / "model" / "model.safetensors").exists() or not all(p.exists() for p in adapters.values()):
        return None
    return EmbeddedModel(root=root, model_dir=root / "model", adapters=adapters,
                         content_hash=str(manifest.get("content_hash")))


def build(root: Path | None = None, *, force: bool = False, verify: bool = False) -> EmbeddedModel:
    """Build the embedded default into ``root`` (default: the cache) unless already there.

    The build happens in a temporary sibling directory that is renamed into place, so a
    concurrent or interrupted build never leaves a half-written model behind.
    """
    return _build(Path(root) if root else cache_root(), _build_into, ADAPTERS, force=force, verify=verify)


def build_hybrid(root: Path | None = None, *, force: bool = False, verify: bool = False) -> EmbeddedModel:
    """Build ``embedded:tiny-hybrid`` (no adapters) like ``build``."""
    root = Path(root) if root else cache_root(HYBRID_NAME, HYBRID_BUILD_VERSION)
    return _build(root, _build_hybrid_into, (), force=force, verify=verify)


def _build(root: Path, build_into: Callable[[Path], str], adapter_names: tuple[str, ...], *, force: bool,
           verify: bool) -> EmbeddedModel:
    if not force:
        existing = _load(root, adapter_names)
        if existing is not None:
            if verify and content_hash(root) != existing.content_hash:
                raise BadInput("embedded model files changed since they were built; rebuild with "
                               "`kvfuzz model build --force`", source=str(root))
            return existing
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        build_into(tmp)
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    model = _load(root, adapter_names)
    assert model is not None
    return model


# Weight variants of the embedded adapters (``embedded:a@v2``): same shape and rank, other
# deterministic weights, for adapter reloads that really change what an adapter computes. v1 is
# the adapter itself. Built on first use next to (not inside) the model, whose content hash
# they must not change; each variant is content-hashed on its own (``adapter_hash``).
VARIANT_SEED_STRIDE = 100


def variants_root(version: int = BUILD_VERSION) -> Path:
    return kvfuzz_cache() / f"{MODEL_NAME}-v{version}-variants"


def build_variant(name: str, version: int, *, root: Path | None = None) -> Path:
    """The directory of embedded adapter ``name``'s weight variant ``version`` (>= 2), built
    atomically (temporary sibling renamed into place) unless already there."""
    if name not in ADAPTERS:
        raise BadInput(f"unknown embedded adapter {name!r} (have {list(ADAPTERS)})", field="source")
    root = Path(root) if root else variants_root()
    target = root / f"{name}@v{version}"
    if (target / "adapter_model.safetensors").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        seed = 1000 + ADAPTERS.index(name) + VARIANT_SEED_STRIDE * (version - 1)
        _write_safetensors(tmp / "adapter_model.safetensors", _adapter_tensors(seed=seed))
        _write_json(tmp / "adapter_config.json", _adapter_config())
        try:
            os.replace(tmp, target)
        except OSError:  # a concurrent builder won the rename: same bytes
            if not (target / "adapter_model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_adapter(spec: str, model: EmbeddedModel | None) -> Path:
    """``embedded:NAME`` -> the embedded adapter's directory, ``embedded:NAME@vN`` -> its
    weight variant N (built on first use); anything else is a path."""
    from kvfuzz.traces.trace import parse_embedded_source

    try:
        parsed = parse_embedded_source(spec)
    except ValueError as e:
        raise BadInput(str(e), field="engine.lora.adapters") from None
    if parsed is None:
        return Path(spec)
    name, version = parsed
    if model is None or name not in model.adapters:
        raise BadInput(f"unknown embedded adapter {name!r} (have {list(ADAPTERS)})", field="engine.lora.adapters")
    return model.adapters[name] if version == 1 else build_variant(name, version)


def adapter_hash(path: str | Path) -> str:
    """Content hash of an adapter directory's files (recorded per binding in every history)."""
    return content_hash(Path(path))


@dataclass(frozen=True)
class ResolvedModel:
    """Where an engine configuration's model and adapters are on disk."""

    model_path: str  # a directory, or a hub name passed to vLLM as is
    model_hash: str | None  # content hash of an embedded build (None for other models)
    adapter_paths: dict[str, str]


def resolve_model(config: "EngineConfig") -> ResolvedModel:
    """The model and LoRA adapters ``config`` names, the embedded ones built if needed. One
    place for every engine: in-process, managed server."""
    from kvfuzz.traces import EMBEDDED_HYBRID, EMBEDDED_MODEL

    if config.model == EMBEDDED_HYBRID and config.lora.enabled:
        # The embedded adapters are shaped for tiny-qwen2 (attention biases, its weights).
        raise BadInput(f"{EMBEDDED_HYBRID} has no LoRA adapters", field="engine.lora.enabled")
    uses_embedded = config.model == EMBEDDED_MODEL or any(
        v.startswith("embedded:") for v in config.lora.adapters.values())
    model = build() if uses_embedded else None
    if config.model == EMBEDDED_MODEL:
        assert model is not None
        path, digest = str(model.model_dir), model.content_hash
    elif config.model == EMBEDDED_HYBRID:
        hybrid = build_hybrid()
        path, digest = str(hybrid.model_dir), hybrid.content_hash
    elif config.model.startswith("embedded:"):
        raise BadInput(f"unknown embedded model {config.model!r} (have {EMBEDDED_MODEL}, {EMBEDDED_HYBRID})",
                       field="engine.model")
    else:
        p = Path(config.model)
        if (p.is_absolute() or config.model.startswith(".")) and not p.exists():
            raise BadInput(f"model directory {p} does not exist", field="engine.model")
        path, digest = config.model, None
    adapters: dict[str, str] = {}
    if config.lora.enabled:
        for name, spec in sorted(config.lora.adapters.items()):
            adapter = resolve_adapter(spec, model)
            if not adapter.exists():
                raise BadInput(f"adapter {name!r}: no such directory {adapter}", field="engine.lora.adapters")
            adapters[name] = str(adapter)
    return ResolvedModel(path, digest, adapters)


# The embedding table's name in a Qwen2 / Llama checkpoint (the embedded models use both).
EMBED_TABLE = "model.embed_tokens.weight"
_TABLES: dict[str, "object"] = {}


def embedding_table(model_path: str) -> "object":
    """The model's input embedding table (a float32 torch tensor, vocab x hidden), read from its
    safetensors files once per process."""
    if model_path not in _TABLES:
        from safetensors import safe_open

        files = sorted(Path(model_path).glob("*.safetensors"))
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                if EMBED_TABLE in st.keys():
                    _TABLES[model_path] = st.get_tensor(EMBED_TABLE).float()
                    break
        else:
            raise BadInput(f"prompt embeddings need the model's embedding table ({EMBED_TABLE}), which no "
                           f"safetensors file in {model_path} holds", field="events.embeds")
    return _TABLES[model_path]


def prompt_embeddings(model_path: str, tokens: list[int], spec: "PromptEmbeds") -> "object":
    """A prompt's embeddings (``PromptEmbeds``): each token's own row of the table, perturbed
    rows with deterministic noise (``spec.seed``) of ``spec.scale`` times the table's spread."""
    import torch

    table = embedding_table(model_path)
    rows = table[torch.tensor(tokens, dtype=torch.long)].clone()  # type: ignore[index]
    if spec.perturbed:
        gen = torch.Generator().manual_seed(spec.seed)
        noise = torch.randn((len(spec.perturbed), rows.shape[1]), generator=gen) * spec.scale * float(table.std())  # type: ignore[attr-defined]
        rows[torch.tensor(spec.perturbed, dtype=torch.long)] += noise
    return rows
