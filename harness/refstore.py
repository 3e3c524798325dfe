"""The reference store's disk tiers (docs/oracle.md "Reference store").

A reference (one request alone on a clean cache, greedy) is a pure function of what
determines that solo run, so it is computed once and kept: in memory (harness/runner.py
``ReferenceStore``, least recently used out), in the campaign's ``OUT/references/`` and in the
kvfuzz cache's ``references/`` across campaigns. Teacher-forced scorings are kept the same way.

Layout: ``<root>/<namespace>/{ref,score}/<key hash>.json``. The namespace is a hash of the
vLLM release, the model's content hash, dtype, device and engine kind (``namespace.json`` in
its directory says which): an entry of another release, model or dtype lives in another
directory and can never be looked up. Inside it, the key (``solo_settings``) holds the engine
settings that reach a solo run, the reference toggles, the adapter's content hash and the
prompt's token ids; the file repeats the key, so a file under the wrong name is not trusted.

Writes are atomic (temporary file, fsync, rename). A file that cannot be read or does not
hold its key is one warning line naming it, then recomputed and overwritten: never a verdict.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import TypeAdapter, ValidationError

from kvfuzz.traces import EngineConfig, RequestRecord, SendEvent, atomic_write_text, expand
from kvfuzz.traces.errors import KvfuzzError
from kvfuzz.traces.history import TopLogprobs
from kvfuzz.traces.paths import kvfuzz_cache
from kvfuzz.traces.trace import Binding

if TYPE_CHECKING:
    from .base import Engine

FORMAT = 1
REFERENCES_DIR = "references"
CACHE_ENV = "KVFUZZ_REFERENCE_CACHE"
_SCORES = TypeAdapter(list[TopLogprobs])


class ReferenceMismatch(KvfuzzError):
    """A stored reference differs from the same reference computed again (``--verify-references``):
    the store's key misses something that changes a solo run. Never a verdict: the campaign stops."""


def warn_stderr(line: str) -> None:
    print(f"kvfuzz: warning: {line}", file=sys.stderr, flush=True)


def solo_settings(config: EngineConfig, reference_toggles: list[str]) -> dict[str, object]:
    """The engine settings that can change a request's solo greedy output (docs/oracle.md,
    "Reference store", gives the reason for each one left out: kv_cache_bytes, max_num_seqs,
    max_loras / max_cpu_loras, enable_prefix_caching, seed, ms_per_step, the adapter map)."""
    return {
        "block_size": config.block_size,  # attention kernels walk the block table per block
        "max_model_len": config.max_model_len,  # caps a run (and a teacher-forced scoring)
        "chunked_prefill": config.enable_chunked_prefill,  # these two split a long prefill
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "lora": config.lora.enabled,  # LoRA layers wrap every projection, adapter or not
        "max_lora_rank": config.lora.max_lora_rank if config.lora.enabled else None,  # padded kernels
        "extra_args": config.extra_args,  # attention backend, enforce_eager, ...: all of them
        "kv_connector": config.kv_connector,
        "reference_toggles": sorted(reference_toggles),  # the clean arm's fixes run with references
        # Id prompts too go through the embeddings path with it on (keyed only when on, so the
        # keys of every engine without it stay as they were).
        **({"prompt_embeds": True} if config.enable_prompt_embeds else {}),
    }


_MODEL_HASHES: dict[str, str] = {}
_ADAPTER_HASHES: dict[str, str] = {}


def model_identity(config: EngineConfig) -> str:
    """The model's content hash: the embedded build's, a local directory's files, or (a hub
    name, whose revision kvfuzz does not pin) ``hub:<name>``."""
    if config.model in _MODEL_HASHES:
        return _MODEL_HASHES[config.model]
    from .embedded import content_hash, resolve_model

    resolved = resolve_model(config.model_copy(update={"lora": config.lora.model_copy(update={"enabled": False})}))
    if resolved.model_hash is not None:
        got = resolved.model_hash
    elif Path(resolved.model_path).is_dir():
        got = content_hash(Path(resolved.model_path))
    else:
        got = f"hub:{config.model}"
    _MODEL_HASHES[config.model] = got
    return got


def adapter_identity(source: str) -> str:
    """Content hash of the adapter weights ``source`` names (a binding's source)."""
    if source not in _ADAPTER_HASHES:
        from .adapters import resolve_source
        from .embedded import adapter_hash

        _ADAPTER_HASHES[source] = adapter_hash(resolve_source(source))
    return _ADAPTER_HASHES[source]


@dataclass(frozen=True)
class Namespace:
    """What no key inside a namespace can tell apart: another release, model or dtype is
    another directory."""

    release: str
    model: str
    dtype: str
    device: str
    engine: str
    # The user's own vLLM patches (KVFUZZ_PLUGIN_MODULES) in the engine's process: a patched
    # engine's references never serve an unpatched one, nor the reverse: a reference that
    # carries a patch's damage hides it in the run, or passes for a bug beside a clean one.
    # "" = none.
    patches: str = ""

    @property
    def dirname(self) -> str:
        # Unpatched namespaces keep the directory they had before ``patches`` existed.
        fields = {k: v for k, v in self.__dict__.items() if k != "patches" or v}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def namespace_of(engine: Engine) -> Namespace:
    from .environment import vllm_version

    # A URL server's release and weights are not known here: its entries stay in its campaign.
    release = (vllm_version() or "unknown") if engine.kind != "url" else "url"
    return Namespace(release=release, model=model_identity(engine.config) if engine.kind != "url" else
                     f"url:{engine.config.model}", dtype=engine.config.dtype, device=engine.device,
                     engine=engine.kind, patches=_patches())


def _patches() -> str:
    from .toggles.plugin import plugin_modules

    return ",".join(sorted(f"{m}:{f}" for m, f in plugin_modules()))


def reference_key(engine: Engine, send: SendEvent, binding: Binding | None) -> dict[str, object]:
    """The key of ``send``'s reference inside its namespace (max_tokens is not in it: a longer
    reference serves a shorter request with its prefix; cache_salt is not: it only partitions
    the prefix cache, which a solo run on a clean cache does not read)."""
    return reference_key_for(engine, engine.config, send, binding)


def reference_key_for(engine: Engine, config: EngineConfig, send: SendEvent, binding: Binding | None) -> dict[str, object]:
    """``reference_key`` of ``send`` on an engine of ``config`` (the reference's configuration,
    ``base.reference_config`` of ``engine``'s) with ``engine``'s reference toggles: the key
    without starting the reference's own engine."""
    adapter = None
    if send.adapter is not None:
        source = binding.source if binding is not None else config.lora.adapters.get(send.adapter)
        adapter = adapter_identity(source) if source is not None else f"name:{send.adapter}"
    prompt = hashlib.sha256(json.dumps(expand(send.prompt)).encode()).hexdigest()
    return {"settings": solo_settings(config, list(engine.reference_toggles)), "adapter": adapter,
            "prompt_sha256": prompt, "sampling": sampling_key(send)}


def sampling_key(send: SendEvent) -> object:
    """What of a send's per-request state can change its solo output: its sampling fields for
    one completion ("greedy" when it sets none, the key of every reference before they existed),
    and embeddings that are not the tokens' own rows."""
    alone = send.alone()
    key: object = "greedy" if alone.sampling.is_default else alone.sampling.model_dump(mode="json")
    if alone.embeds is not None:
        key = {"sampling": key, "embeds": alone.embeds.model_dump(mode="json")}
    return key


def complete(rec: RequestRecord, max_tokens: int, *, prompt_logprobs: bool = False) -> bool:
    """Whether a stored reference answers a request of ``max_tokens``: it ran that far, or it
    stopped (EOS or a stop rule) before: a longer budget would not have made it go on. A
    request that asks for prompt logprobs needs them recorded."""
    if prompt_logprobs and rec.prompt_logprobs is None:
        return False
    return len(rec.token_ids) >= max_tokens or rec.finish_reason == "stop"


def _hash(key: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class DiskTiers:
    """The on-disk tiers, first the campaign's, then the cache: a lookup reads them in order, a
    new entry is written to all of them (write-through)."""

    roots: list[Path]
    writer: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    warn: Callable[[str], None] = warn_stderr
    _namespaces: dict[tuple[str, str, str, str, str], Namespace] = field(default_factory=dict, repr=False)

    @classmethod
    def for_campaign(cls, out: Path | None, *, cache: bool = True, **kw: object) -> "DiskTiers":
        """The campaign's tier (``out/references``) and the cache's: the kvfuzz cache, or
        ``$KVFUZZ_REFERENCE_CACHE`` (a directory, or ``off``: campaigns compared side by side
        must not serve each other)."""
        roots = [out / REFERENCES_DIR] if out is not None else []
        where = os.environ.get(CACHE_ENV, "")
        if cache and where != "off":
            roots.append(Path(where) if where else kvfuzz_cache() / REFERENCES_DIR)
        return cls(roots=roots, **kw)  # type: ignore[arg-type]

    def namespace(self, engine: Engine) -> Namespace:
        # Memoised by what ``namespace_of`` reads (the release is the process's), not by the
        # engine object: a restarted engine of another dtype may reuse a closed engine's id().
        k = (engine.kind, engine.device, engine.config.model, engine.config.dtype, _patches())
        ns = self._namespaces.get(k)
        if ns is None:
            ns = self._namespaces[k] = namespace_of(engine)
        return ns

    def _roots_for(self, ns: Namespace) -> list[Path]:
        # A URL server's entries never leave its campaign (nothing names its weights).
        return self.roots[:1] if ns.engine == "url" else self.roots

    def _path(self, root: Path, ns: Namespace, kind: str, key: dict[str, object]) -> Path:
        return root / ns.dirname / kind / f"{_hash(key)}.json"

    def _load(self, ns: Namespace, kind: str, key: dict[str, object]) -> tuple[dict, Path] | None:
        for root in self._roots_for(ns):
            path = self._path(root, ns, kind, key)
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            except OSError as e:
                self.warn(f"unreadable reference store entry {path} ({e.strerror}): recomputed")
                continue
            try:
                data = json.loads(text)
                if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
                    raise ValueError("it does not hold its key")
            except ValueError as e:
                self.warn(f"corrupt reference store entry {path} ({str(e)[:80]}): recomputed")
                continue
            return data, path
        return None

    def _save(self, ns: Namespace, kind: str, key: dict[str, object], body: dict[str, object],
              writer: str | None) -> None:
        text = json.dumps({"format": FORMAT, "key": key, "writer": writer or self.writer, **body}, sort_keys=True)
        for root in self._roots_for(ns):
            d = root / ns.dirname
            if not (d / "namespace.json").exists():
                atomic_write_text(d / "namespace.json", json.dumps(ns.__dict__, indent=2, sort_keys=True) + "\n")
            atomic_write_text(self._path(root, ns, kind, key), text)

    # -- references ----------------------------------------------------------------------------
    def load_reference(self, ns: Namespace, key: dict[str, object], min_tokens: int, *,
                       prompt_logprobs: bool = False) -> tuple[RequestRecord, str] | None:
        """A stored reference of at least ``min_tokens`` tokens, and who wrote it."""
        got = self._load(ns, "ref", key)
        if got is None:
            return None
        data, path = got
        try:
            rec = RequestRecord.model_validate(data["record"])
        except (KeyError, ValidationError) as e:
            self.warn(f"corrupt reference store entry {path} ({str(e).splitlines()[0][:80]}): recomputed")
            return None
        if not complete(rec, min_tokens, prompt_logprobs=prompt_logprobs):
            return None  # too short: computed again, longer, and overwritten
        return rec, str(data.get("writer"))

    def save_reference(self, ns: Namespace, key: dict[str, object], rec: RequestRecord,
                       writer: str | None = None) -> None:
        self._save(ns, "ref", key, {"record": rec.model_dump(mode="json")}, writer)

    # -- teacher-forced scorings -----------------------------------------------------------------
    def load_score(self, ns: Namespace, key: dict[str, object]) -> list[TopLogprobs] | None:
        got = self._load(ns, "score", key)
        if got is None:
            return None
        data, path = got
        try:
            return _SCORES.validate_python(data["logprobs"])
        except (KeyError, ValidationError) as e:
            self.warn(f"corrupt reference store entry {path} ({str(e).splitlines()[0][:80]}): recomputed")
            return None

    def save_score(self, ns: Namespace, key: dict[str, object], logprobs: list[TopLogprobs],
                   writer: str | None = None) -> None:
        self._save(ns, "score", key, {"logprobs": logprobs}, writer)


class StoreService:
    """The store of a campaign on many workers (a Ray actor on the driver's node, made in
    kvfuzz/cluster.py): workers read and add entries through it; it writes each one to the
    driver's ``OUT/references`` (and cache) when it arrives, so a dead worker loses none and
    workers on other nodes need no shared filesystem. Plain Python: Ray is not imported here."""

    def __init__(self, out: str, cache: bool = True) -> None:
        self.tiers = DiskTiers.for_campaign(Path(out), cache=cache)

    def load_reference(self, ns: Namespace, key: dict[str, object], min_tokens: int, *,
                       prompt_logprobs: bool = False) -> tuple[RequestRecord, str] | None:
        return self.tiers.load_reference(ns, key, min_tokens)

    def save_reference(self, ns: Namespace, key: dict[str, object], rec: RequestRecord, writer: str) -> None:
        self.tiers.save_reference(ns, key, rec, writer)

    def load_score(self, ns: Namespace, key: dict[str, object]) -> list[TopLogprobs] | None:
        return self.tiers.load_score(ns, key)

    def save_score(self, ns: Namespace, key: dict[str, object], logprobs: list[TopLogprobs], writer: str) -> None:
        self.tiers.save_score(ns, key, logprobs, writer)


class RemoteTiers(DiskTiers):
    """A worker's view of a ``StoreService``: ``call(method, *args)`` runs the service's method
    (kvfuzz/cluster.py passes one that goes through Ray) — read-through and write-through."""

    def __init__(self, call: Callable[..., object], writer: str) -> None:
        super().__init__(roots=[], writer=writer)
        self._call = call

    def load_reference(self, ns: Namespace, key: dict[str, object], min_tokens: int, *,
                       prompt_logprobs: bool = False) -> tuple[RequestRecord, str] | None:
        return self._call("load_reference", ns, key, min_tokens)  # type: ignore[return-value]

    def save_reference(self, ns: Namespace, key: dict[str, object], rec: RequestRecord,
                       writer: str | None = None) -> None:
        self._call("save_reference", ns, key, rec, writer or self.writer)

    def load_score(self, ns: Namespace, key: dict[str, object]) -> list[TopLogprobs] | None:
        return self._call("load_score", ns, key)  # type: ignore[return-value]

    def save_score(self, ns: Namespace, key: dict[str, object], logprobs: list[TopLogprobs],
                   writer: str | None = None) -> None:
        self._call("save_score", ns, key, logprobs, writer or self.writer)


def same_reference(stored: RequestRecord, fresh: RequestRecord, *, exact: bool) -> str | None:
    """None when ``fresh`` (just computed) agrees with the prefix of ``stored``, else what differs.
    ``exact`` (a step-exact engine): logprobs too, to the bit; otherwise the token ids."""
    n = len(fresh.token_ids)
    if stored.token_ids[:n] != fresh.token_ids:
        return f"token ids differ: stored {stored.token_ids[:n]}, computed {fresh.token_ids}"
    if exact:
        for i, (a, b) in enumerate(zip(stored.logprobs, fresh.logprobs)):
            if not _same_top(a, b):
                return f"logprobs differ at position {i}: stored {a[:2]}, computed {b[:2]}"
        if len(stored.logprobs) < len(fresh.logprobs):
            return "logprobs differ in length"
    return None


def _same_top(a: TopLogprobs, b: TopLogprobs) -> bool:
    # NaN is what vLLM reports where every token was masked (allowed tokens and bad words that
    # leave none): the same answer twice, though NaN != NaN.
    return len(a) == len(b) and all(ta == tb and (la == lb or (math.isnan(la) and math.isnan(lb)))
                                    for (ta, la), (tb, lb) in zip(a, b))


__all__ = ["DiskTiers", "Namespace", "ReferenceMismatch", "RemoteTiers", "StoreService", "namespace_of",
           "reference_key", "reference_key_for", "same_reference", "solo_settings"]
