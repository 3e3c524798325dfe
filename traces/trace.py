"""The trace: an engine configuration plus a schedule of send / cancel / adapter-lifecycle /
prefix-cache reset events.

A trace is data, versioned by ``schema_version``. It names *when* each event happens in two
clocks: ``step`` (an engine step, exact for the in-process engine) and ``offset_ms`` (wall
clock from the trace start, for HTTP servers). Either may be given; the harness that lacks
one derives it from the other with ``EngineConfig.ms_per_step``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Final, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

# 2: adapter lifecycle events (load / unload / reload), ``cache_salt`` on sends,
# ``lora.max_cpu_loras``. 3: a send's per-request state (``sampling``, ``priority``, ``embeds``)
# and the engine's ``scheduling_policy`` and ``enable_prompt_embeds``. 4: the engine's
# ``speculative`` decoding. 6: ``reset-prefix-cache`` events. Older files still load (they cannot
# carry those).
SCHEMA_VERSION: Final = 5
SCHEMA_VERSIONS = (1, 2, 3, 4, 5)

# Embedded default model (see harness/embedded.py); a path or hub name selects another model.
EMBEDDED_MODEL = "embedded:tiny-qwen2"
# Embedded hybrid model: full-attention + sliding-window layers, two KV cache groups (docs/hybrid.md).
EMBEDDED_HYBRID = "embedded:tiny-hybrid"

# KV connectors kvfuzz can attach (harness/vllm_args.py maps a name to vLLM's kv_transfer_config).
# "kvfuzz-store": harness/kv_connector.py, external KV with correct contents (docs/hybrid.md).
KV_CONNECTORS = ("kvfuzz-store",)

# Upper bounds: finding files come from strangers; absurd numbers are bad input, not a
# reason to allocate memory or wait forever.
MAX_LEN = 2**21  # tokens
MAX_STEP = 10**7
MAX_OFFSET_MS = 24 * 3600 * 1000.0


def _drop_none(data: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(data, dict):
        for k in keys:
            if data.get(k) is None:
                data.pop(k, None)
    return data


class _Strict(BaseModel):
    # extra="forbid": a misspelt field in a hand-written trace is an error, not silently ignored.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class LoraSettings(_Strict):
    """LoRA serving settings. ``adapters`` maps adapter name -> path, or ``embedded:NAME``."""

    enabled: bool = False
    adapters: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default=2, ge=1, le=1024)
    max_lora_rank: int = Field(default=8, ge=1, le=1024)
    # Adapters vLLM keeps in CPU memory; past it the least recently used one is evicted and
    # reloaded from its path on next use (LRU churn). None: vLLM's default (= max_loras).
    max_cpu_loras: int | None = Field(default=None, ge=1, le=1024)

    @model_validator(mode="after")
    def _cpu_holds_the_slots(self) -> "LoraSettings":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM refuses it at engine start (LoRAConfig): say so when the trace is read.
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} is less than max_loras {self.max_loras}")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> Any:
        # Written only when set: traces without it keep their bytes, trace ids and reference keys.
        return _drop_none(handler(self), ("max_cpu_loras",))


class Speculative(_Strict):
    """vLLM's speculative decoding (``speculative_config``): ngram prompt lookup proposes up to
    ``num_speculative_tokens`` draft tokens a step from the last ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens' earlier occurrence in the request; the target model verifies
    them in one pass and the rejected ones' KV is rolled back. At temperature 0 it is lossless."""

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    prompt_lookup_max: int = Field(default=3, ge=1, le=16)
    prompt_lookup_min: int = Field(default=1, ge=1, le=16)

    @model_validator(mode="after")
    def _lookup_range(self) -> "Speculative":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        return self

    def config(self) -> dict[str, Any]:
        """vLLM's ``speculative_config``."""
        return self.model_dump(mode="json")


class EngineConfig(_Strict):
    """Everything about the engine that can change a schedule or an output."""

    model: str = EMBEDDED_MODEL
    block_size: int = Field(default=32, ge=1, le=4096)
    max_model_len: int = Field(default=16384, ge=16, le=MAX_LEN)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = Field(default=16, ge=1, le=65536)
    max_num_batched_tokens: int = Field(default=2048, ge=1, le=MAX_LEN)
    # Explicit KV cache size. On CPU the default memory-fraction sizing fails (see notes);
    # a small cache forces preemption, which is one of the things we fuzz.
    kv_cache_bytes: int | None = Field(default=64 * 2**20, ge=1, le=2**44)
    dtype: str = "float32"
    seed: int = 0
    lora: LoraSettings = Field(default_factory=LoraSettings)
    # Toggle names applied to this engine (see harness/toggles); part of the config because a
    # fault changes outputs exactly as a flag would.
    toggles: list[str] = Field(default_factory=list)
    # Pass-through engine arguments for deployments (e.g. attention_backend on GPU).
    extra_args: dict[str, Any] = Field(default_factory=dict)
    # Conversion between the two clocks when a trace gives only one of them.
    ms_per_step: float = Field(default=10.0, gt=0, le=60_000)
    # A KV connector serving external KV (one of KV_CONNECTORS), or none. Written out only when
    # set, so traces without it keep their bytes, trace ids and reference keys.
    kv_connector: str | None = None
    # vLLM's scheduling policy: "priority" admits and preempts by each send's ``priority``.
    # None is vLLM's default (fcfs), and is not written out.
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    # Prompts may be given as embeddings (``SendEvent.embeds``; vLLM's ``enable_prompt_embeds``,
    # which also routes id prompts through the embeddings path). Written out only when on.
    enable_prompt_embeds: bool = False
    # Speculative decoding, or none (not written out). A request's reference runs without it.
    speculative: Speculative | None = None
    # vLLM's long_prefill_token_threshold: a prompt longer than this is prefilled at most this
    # many tokens a step (None: vLLM's default, no cap; not written out).
    long_prefill_token_threshold: int | None = Field(default=None, ge=1, le=MAX_LEN)

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, v: str | None) -> str | None:
        if v is not None and v not in KV_CONNECTORS:
            raise ValueError(f"unknown KV connector {v!r} (known: {', '.join(KV_CONNECTORS)})")
        return v

    @model_validator(mode="after")
    def _connector_without_lora(self) -> "EngineConfig":
        if self.kv_connector is not None and self.lora.enabled:
            # The store's keys are token ids only: adapters would share each other's KV.
            raise ValueError("kv_connector: the kvfuzz store does not key blocks by LoRA adapter; "
                             "turn lora off or the connector off")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_connector(self, handler: Any) -> Any:
        data = _drop_none(handler(self), ("kv_connector", "scheduling_policy", "speculative",
                                          "long_prefill_token_threshold"))
        if isinstance(data, dict) and data.get("enable_prompt_embeds") is False:
            data.pop("enable_prompt_embeds")
        return data

    def with_dtype(self, dtype: str) -> "EngineConfig":
        """This engine in another dtype, its KV cache keeping its capacity in tokens (16-bit KV
        takes half float32's bytes): a trace's KV pressure — which request is preempted when,
        which blocks are recycled — is part of its schedule, and must not vanish with the dtype."""
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        update: dict[str, Any] = {"dtype": dtype}
        if self.kv_cache_bytes is not None and self.dtype in size and dtype in size:
            update["kv_cache_bytes"] = self.kv_cache_bytes * size[dtype] // size[self.dtype]
        return self.model_copy(update=update)

    def key(self) -> str:
        """Stable hash of the fields that affect outputs (used to memoise references)."""
        data = self.model_dump(mode="json", exclude={"toggles", "ms_per_step"})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def engine_key(self) -> str:
        """``key`` without the adapter map: what a started engine is. Adapters are bound per
        request (and rebound by lifecycle events), so one engine serves any adapter map."""
        data = self.model_dump(mode="json", exclude={"toggles", "ms_per_step"})
        data["lora"].pop("adapters", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class At(_Strict):
    """When an event happens. ``after_tokens`` (cancels only) is relative to the target
    request's life: cancel once it has produced that many tokens (0 = still in prefill)."""

    step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    offset_ms: float | None = Field(default=None, ge=0, le=MAX_OFFSET_MS, allow_inf_nan=False)
    after_tokens: int | None = Field(default=None, ge=0, le=MAX_LEN)

    @model_validator(mode="after")
    def _one_clock(self) -> "At":
        if self.step is None and self.offset_ms is None and self.after_tokens is None:
            raise ValueError("give at least one of step, offset_ms, after_tokens")
        return self

    def step_or(self, ms_per_step: float) -> int:
        if self.step is not None:
            return self.step
        return int((self.offset_ms or 0.0) // ms_per_step)

    def offset_or(self, ms_per_step: float) -> float:
        if self.offset_ms is not None:
            return self.offset_ms
        return (self.step or 0) * ms_per_step


class TokenPrompt(_Strict):
    """An explicit prompt of token ids."""

    token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(min_length=1, max_length=MAX_LEN)

    @property
    def length(self) -> int:
        return len(self.token_ids)


class GenPrompt(_Strict):
    """A prompt generated deterministically (see traces/prompts.py). Requests in one
    ``prefix_group`` share their first ``prefix_len`` tokens."""

    length: int = Field(ge=1, le=MAX_LEN)
    prefix_group: str | None = None
    prefix_len: int = Field(default=0, ge=0, le=MAX_LEN)
    seed: int = Field(default=0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _prefix_fits(self) -> "GenPrompt":
        if self.prefix_len > self.length:
            raise ValueError(f"prefix_len {self.prefix_len} exceeds length {self.length}")
        if self.prefix_len and self.prefix_group is None:
            raise ValueError("prefix_len needs a prefix_group")
        return self


Prompt = Union[TokenPrompt, GenPrompt]

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
# vLLM's own bounds (vllm/sampling_params.py): penalties, bias and the fan-out it accepts.
MAX_N = 16


class Sampling(_Strict):
    """The per-request state vLLM keeps for a temperature-0 request beside its KV: what it may
    sample, how its logits are processed, and when it stops. vLLM carries all of it in the
    persistent batch's row (``InputBatch``), which moves when other requests finish, so a wrong
    row shows as a request answering with another's rules. Defaults are vLLM's, except
    ``ignore_eos``: true, as every send before schema 3 was (they ran to ``max_tokens``). Only
    fields that differ from the defaults are written out."""

    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=4096)
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = \
        Field(default=None, max_length=4096)
    # Words as the tokenizer reads them; each bans its last token after the ones before it.
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = \
        Field(default=None, min_length=1, max_length=64)
    min_tokens: int = Field(default=0, ge=0, le=MAX_LEN)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = \
        Field(default=None, min_length=1, max_length=16)
    stop_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=64)
    ignore_eos: bool = True
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0, le=2, allow_inf_nan=False)
    # Completions of the same prompt; at temperature 0 each equals the request with n = 1.
    n: int = Field(default=1, ge=1, le=MAX_N)
    # Logprobs of the prompt's tokens (top-k), computed by the prefill.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is not None:
            for k in v:
                if not 0 <= k < 2**31:
                    raise ValueError(f"token id {k} out of range")
        return v

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name, f in type(self).model_fields.items():
                if name in data and data[name] == f.default:
                    data.pop(name)
        return data

    @property
    def is_default(self) -> bool:
        return self == Sampling()

    @property
    def processes_logits(self) -> bool:
        """Whether vLLM changes this request's logits before choosing (a mask, a bias, a
        penalty): its logprobs are then not the model's own, and a prompt scored alone (teacher
        forcing, prompt logprobs) is not comparable with them."""
        return bool(self.allowed_token_ids or self.logit_bias or self.bad_words or self.min_tokens
                    or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_prompt_ids(self) -> bool:
        """Whether vLLM's processing reads the prompt's token ids: the repetition penalty counts
        them, and a prompt given as embeddings carries none (vLLM sees placeholders there)."""
        return self.repetition_penalty != 1.0

    def alone(self) -> "Sampling":
        """These parameters for one completion: what a child of ``n`` is referenced by."""
        return self.model_copy(update={"n": 1})

    def fields_set(self) -> list[str]:
        """The fields that differ from vLLM's defaults (for coverage and the campaign summary)."""
        default = Sampling()
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(default, name)]


class PromptEmbeds(_Strict):
    """The prompt given to vLLM as embeddings (``prompt_embeds``) instead of token ids: at each
    position the row of the model's own embedding table for the prompt's token there, except at
    ``perturbed`` positions (that row plus deterministic noise, ``scale`` times the table's
    spread: no token's row); the ``as_ids`` ranges [start, end) go as token ids instead (a mixed
    prompt: vLLM's ``prompt_is_token_ids``)."""

    perturbed: list[Annotated[int, Field(ge=0, lt=MAX_LEN)]] = Field(default_factory=list, max_length=4096)
    scale: float = Field(default=0.5, gt=0, le=10, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, lt=2**63)
    as_ids: list[tuple[Annotated[int, Field(ge=0, lt=MAX_LEN)], Annotated[int, Field(ge=1, le=MAX_LEN)]]] = \
        Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _ranges(self) -> "PromptEmbeds":
        for a, b in self.as_ids:
            if a >= b:
                raise ValueError(f"as_ids range [{a}, {b}) is empty")
        return self

    def check_length(self, length: int) -> None:
        """ValueError naming what lies past a prompt of ``length`` tokens."""
        past = [p for p in self.perturbed if p >= length] + [b for _, b in self.as_ids if b > length]
        if past:
            raise ValueError(f"position {past[0]} lies past the prompt's {length} tokens")

    def id_mask(self, length: int) -> list[bool]:
        """Per position, whether it goes as a token id (vLLM's ``prompt_is_token_ids``)."""
        mask = [False] * length
        for a, b in self.as_ids:
            mask[a:b] = [True] * (b - a)
        return mask

    def fit(self, length: int) -> "PromptEmbeds":
        """These embeddings on a prompt of ``length`` tokens: what lies past it dropped."""
        ranges = [(a, min(b, length)) for a, b in self.as_ids if a < length]
        return self.model_copy(update={"perturbed": [p for p in self.perturbed if p < length], "as_ids": ranges})

    @property
    def own_rows(self) -> bool:
        """Every embedding is its token's own row: the prompt means the same as its token ids."""
        return not self.perturbed


class SendEvent(_Strict):
    kind: Literal["send"] = "send"
    request_id: str = Field(min_length=1)
    at: At
    prompt: Prompt
    adapter: str | None = None
    max_tokens: int = Field(default=16, ge=1, le=MAX_LEN)
    stream: bool = True
    # Multi-tenant isolation: vLLM mixes the salt into the first block's hash, so requests of
    # different salts never share prefix-cache blocks. It cannot change a solo output.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    sampling: Sampling = Field(default_factory=Sampling)
    # Lower is served first under ``engine.scheduling_policy`` "priority" (vLLM's rule); it
    # cannot change a solo output.
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    # The prompt goes as embeddings (needs ``engine.enable_prompt_embeds``).
    embeds: PromptEmbeds | None = None

    @field_validator("at")
    @classmethod
    def _no_relative_send(cls, at: At) -> At:
        return _absolute(at, "send")

    @model_validator(mode="after")
    def _state_fits(self) -> "SendEvent":
        problem = self.state_problem()
        if problem is not None:
            raise ValueError(" ".join(problem))
        return self

    def state_problem(self) -> tuple[str, str] | None:
        """(field, why) where its per-request state does not fit the send itself, else None.
        Checked when a send is built and again when a trace is (an edited copy is not rebuilt)."""
        if self.sampling.min_tokens > self.max_tokens:
            return "sampling.min_tokens", f"{self.sampling.min_tokens} exceeds max_tokens {self.max_tokens}"
        if self.embeds is not None:
            try:
                self.embeds.check_length(self.prompt.length)
            except ValueError as e:
                return "embeds", str(e)
        return None

    def fitted(self) -> "SendEvent":
        """This send with its embeddings fitted to its prompt (after an edit of the prompt)."""
        if self.embeds is None:
            return self
        return self.model_copy(update={"embeds": self.embeds.fit(self.prompt.length)})

    @property
    def completion_ids(self) -> list[str]:
        """The ids its completions are recorded under: its own, then ``ID#k`` for the other
        children of ``n``."""
        return [self.request_id] + [f"{self.request_id}#{k}" for k in range(1, self.sampling.n)]

    def alone(self, max_tokens: int | None = None) -> "SendEvent":
        """This send as its reference runs it: first, by itself, one completion (every child
        of ``n`` is judged by it) and the default priority (alone, no one to be ahead of)."""
        return self.model_copy(update={"at": At(step=0), "max_tokens": max_tokens or self.max_tokens,
                                       "sampling": self.sampling.alone(), "priority": 0,
                                       # Embeddings of the tokens' own rows mean the token ids,
                                       # unless the request's processing reads those ids.
                                       "embeds": None if self.embeds is None or (
                                           self.embeds.own_rows and not self.sampling.reads_prompt_ids) else self.embeds})

    @property
    def per_request_fields(self) -> list[str]:
        """The per-request state this send sets beyond a plain greedy request."""
        return (self.sampling.fields_set() + (["priority"] if self.priority else [])
                + (["embeds"] if self.embeds is not None else []))

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> Any:
        data = _drop_none(handler(self), ("cache_salt", "embeds"))
        if isinstance(data, dict):
            # Written only when set: older sends keep their bytes, trace ids and reference keys.
            if not data.get("sampling"):
                data.pop("sampling", None)
            if data.get("priority") == 0:
                data.pop("priority", None)
        return data


class CancelEvent(_Strict):
    kind: Literal["cancel"] = "cancel"
    request_id: str = Field(min_length=1)
    at: At


def _absolute(at: At, kind: str) -> At:
    if at.after_tokens is not None:
        raise ValueError(f"after_tokens is only meaningful for cancel events, not {kind}")
    return at


# An adapter source: ``embedded:NAME`` (an embedded adapter), ``embedded:NAME@vN`` (its
# deterministic weight variant N; v1 is the adapter itself), or a directory.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
EMBEDDED_SOURCE = re.compile(r"^embedded:([a-z0-9][a-z0-9-]{0,31})(?:@v([1-9][0-9]{0,2}))?$")


def parse_embedded_source(source: str) -> tuple[str, int] | None:
    """``embedded:a@v2`` -> ("a", 2); ``embedded:a`` -> ("a", 1); a path -> None."""
    m = EMBEDDED_SOURCE.match(source)
    if m is None:
        if source.startswith("embedded:"):
            raise ValueError(f"malformed embedded adapter source {source!r} (embedded:NAME or embedded:NAME@vN)")
        return None
    return m.group(1), int(m.group(2) or 1)


def _check_source(source: str) -> str:
    parse_embedded_source(source)
    return source


class _AdapterEvent(_Strict):
    """What every adapter lifecycle event has: the adapter name and an absolute time."""

    name: str = Field(pattern=ADAPTER_NAME)
    at: At

    @field_validator("at")
    @classmethod
    def _absolute_at(cls, at: At) -> At:
        return _absolute(at, cls.model_fields["kind"].default)


class _SourcedEvent(_AdapterEvent):
    source: str = Field(min_length=1, max_length=4096)

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        return _check_source(v)


class LoadAdapterEvent(_SourcedEvent):
    """Bind adapter ``name`` to the weights at ``source`` (vLLM: ``add_lora`` offline,
    ``/v1/load_lora_adapter`` on a server). The name must not be bound already."""

    kind: Literal["load-adapter"] = "load-adapter"


class UnloadAdapterEvent(_AdapterEvent):
    """Unbind adapter ``name`` (``remove_lora`` / ``/v1/unload_lora_adapter``)."""

    kind: Literal["unload-adapter"] = "unload-adapter"


class ReloadAdapterEvent(_SourcedEvent):
    """Rebind the bound adapter ``name`` to new weights in place: vLLM's ``load_inplace``, which
    keeps the adapter's id, so the engine replaces its weights under the same identity.
    ``same_path`` false: the new weights come from ``source``'s own path. ``same_path`` true: the
    files at the name's current path are overwritten with ``source``'s and reloaded from that
    same path (how a deployment that updates an adapter directory in place does it)."""

    kind: Literal["reload-adapter"] = "reload-adapter"
    same_path: bool = False


AdapterEvent = Union[LoadAdapterEvent, UnloadAdapterEvent, ReloadAdapterEvent]
ADAPTER_EVENT_TYPES = (LoadAdapterEvent, UnloadAdapterEvent, ReloadAdapterEvent)


class ResetPrefixCacheEvent(_Strict):
    """Empty vLLM's prefix cache (``LLMEngine.reset_prefix_cache`` in-process, ``POST
    /reset_prefix_cache`` on a server). vLLM declines a plain reset while any block is held
    (requests running); with ``reset_running_requests`` it first preempts every running request
    back to the waiting queue (they are recomputed), so the reset always happens. Never changes a
    temperature-0 output (docs/oracle.md)."""

    kind: Literal["reset-prefix-cache"] = "reset-prefix-cache"
    at: At
    reset_running_requests: bool = False

    @field_validator("at")
    @classmethod
    def _absolute_at(cls, at: At) -> At:
        return _absolute(at, "reset-prefix-cache")


Event = Annotated[Union[SendEvent, CancelEvent, LoadAdapterEvent, UnloadAdapterEvent, ReloadAdapterEvent,
                        ResetPrefixCacheEvent],
                  Field(discriminator="kind")]


class Binding(BaseModel):
    """What an adapter name is bound to at one moment of a trace's plan: its weights' source,
    which generation of binding it is (each load or reload makes a new one), and whether the
    binding shares its path with an earlier one whose files were overwritten in place."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    generation: int = 0
    same_path_of: int | None = None  # generation whose path this binding overwrote

    @classmethod
    def initial(cls, engine: "EngineConfig", adapter: str | None) -> "Binding | None":
        """The binding of ``adapter`` before any lifecycle event (the engine section's)."""
        if adapter is None:
            return None
        return cls(name=adapter, source=engine.lora.adapters[adapter])


class Lineage(_Strict):
    """Where a trace came from: its parent and the mutation operators applied (fuzzer/)."""

    parent: str | None = None
    operators: list[str] = Field(default_factory=list)
    generator: str | None = None
    seed: int | None = None


class Expectation(_Strict):
    """What a regression trace must do in ``kvfuzz gate --self-test``: pass in the clean arm,
    and fail (a ``corruption`` divergence) in each listed arm — ``with:FAULT`` for a fault that
    models the report, ``without:FIX`` for a fix whose absence reproduces it. An arm whose
    toggle cannot change outputs on the device (GPU-only) is skipped and said so."""

    models: str = Field(min_length=1, max_length=500)  # e.g. "vLLM #39146 finding_00450"
    fails_in: list[Annotated[str, Field(pattern=r"^(with|without):[a-z0-9][a-z0-9-]{0,80}$")]] = \
        Field(default_factory=list, max_length=64)
    passes_clean: bool = True


class Trace(_Strict):
    schema_version: Literal[1, 2, 3, 4, 5] = SCHEMA_VERSION
    name: str | None = None
    engine: EngineConfig = Field(default_factory=EngineConfig)
    events: list[Event] = Field(default_factory=list)
    lineage: Lineage = Field(default_factory=Lineage)
    # Free-form notes (e.g. which vLLM report a regression trace models); not interpreted.
    notes: dict[str, Any] = Field(default_factory=dict)
    # Regression traces (traces/regressions/) say what the gate's self-test expects of them.
    expect: Expectation | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "Trace":
        sends: dict[str, SendEvent] = {}
        for i, ev in enumerate(self.events):
            if isinstance(ev, SendEvent):
                if ev.request_id in sends:
                    raise ValueError(f"events[{i}].request_id: {ev.request_id!r} is sent twice")
                sends[ev.request_id] = ev
                if ev.adapter is not None and not self.engine.lora.enabled:
                    raise ValueError(f"events[{i}].adapter: {ev.adapter!r} used but engine.lora.enabled is false")
                if ev.cache_salt is not None and self.schema_version < 2:
                    raise ValueError(f"events[{i}].cache_salt: needs schema_version 2")
                problem = ev.state_problem()
                if problem is not None:
                    raise ValueError(f"events[{i}].{problem[0]}: {problem[1]}")
                if ev.per_request_fields and self.schema_version < 3:
                    raise ValueError(f"events[{i}].{ev.per_request_fields[0]}: needs schema_version 3")
                if ev.embeds is not None and not self.engine.enable_prompt_embeds:
                    raise ValueError(f"events[{i}].embeds: needs engine.enable_prompt_embeds")
                if ev.priority and self.engine.scheduling_policy != "priority":
                    raise ValueError(f"events[{i}].priority: needs engine.scheduling_policy \"priority\" "
                                     f"(vLLM refuses a priority under fcfs)")
                need = ev.prompt.length + ev.max_tokens
                if need > self.engine.max_model_len:
                    raise ValueError(
                        f"events[{i}].prompt: {ev.prompt.length} prompt + {ev.max_tokens} new tokens "
                        f"exceed engine.max_model_len {self.engine.max_model_len}"
                    )
            elif isinstance(ev, ADAPTER_EVENT_TYPES):
                if not self.engine.lora.enabled:
                    raise ValueError(f"events[{i}]: {ev.kind} needs engine.lora.enabled")
                if self.schema_version < 2:
                    raise ValueError(f"events[{i}]: {ev.kind} needs schema_version 2")
            elif isinstance(ev, ResetPrefixCacheEvent) and self.schema_version < 5:
                raise ValueError(f"events[{i}]: {ev.kind} needs schema_version 5")
        if self.engine.scheduling_policy is not None and self.schema_version < 3:
            raise ValueError("engine.scheduling_policy: needs schema_version 3")
        if self.engine.enable_prompt_embeds and self.schema_version < 3:
            raise ValueError("engine.enable_prompt_embeds: needs schema_version 3")
        if self.engine.long_prefill_token_threshold is not None and self.schema_version < 5:
            raise ValueError("engine.long_prefill_token_threshold: needs schema_version 5")
        if self.engine.speculative is not None:
            if self.schema_version < 4:
                raise ValueError("engine.speculative: needs schema_version 4")
            for i, ev in enumerate(self.events):
                if isinstance(ev, SendEvent) and ev.sampling.logit_bias:
                    raise ValueError(f"events[{i}].sampling.logit_bias: vLLM refuses logit_bias with speculative "
                                     f"decoding (engine.speculative)")
        for i, ev in enumerate(self.events):
            if isinstance(ev, CancelEvent) and ev.request_id not in sends:
                raise ValueError(f"events[{i}].request_id: cancel of unknown request {ev.request_id!r}")
        self._plan_bindings()  # every send's adapter bound at its admission, every unload/reload of a bound name
        return self

    def planned_order(self) -> list[int]:
        """Indices of the events with an absolute time, in the order the harness applies them:
        by planned engine step, then by position in the trace (relative cancels excluded)."""
        mps = self.engine.ms_per_step
        timed = [i for i, ev in enumerate(self.events)
                 if not (isinstance(ev, CancelEvent) and ev.at.after_tokens is not None)]
        return sorted(timed, key=lambda i: (self.events[i].at.step_or(mps), i))

    def _plan_bindings(self) -> dict[str, Binding | None]:
        """Walk the plan: request id -> the binding of its adapter at its admission (None for
        the base model). Raises ValueError naming the event for an adapter used while unbound."""
        bound: dict[str, Binding] = {n: Binding(name=n, source=s) for n, s in self.engine.lora.adapters.items()}
        known = set(bound) | {e.name for e in self.events if isinstance(e, LoadAdapterEvent)}
        generation = 0
        at_admission: dict[str, Binding | None] = {}
        for i in self.planned_order():
            ev = self.events[i]
            if isinstance(ev, SendEvent):
                if ev.adapter is not None and ev.adapter not in bound:
                    if ev.adapter not in known:
                        raise ValueError(f"events[{i}].adapter: unknown adapter {ev.adapter!r} "
                                         f"(known: {sorted(known)})")
                    raise ValueError(f"events[{i}].adapter: adapter {ev.adapter!r} is not loaded at this point of the "
                                     f"schedule (bound: {sorted(bound)})")
                at_admission[ev.request_id] = bound.get(ev.adapter) if ev.adapter is not None else None
            elif isinstance(ev, LoadAdapterEvent):
                if ev.name in bound:
                    raise ValueError(f"events[{i}].name: adapter {ev.name!r} is already loaded (use reload-adapter)")
                generation += 1
                bound[ev.name] = Binding(name=ev.name, source=ev.source, generation=generation)
            elif isinstance(ev, UnloadAdapterEvent):
                if bound.pop(ev.name, None) is None:
                    raise ValueError(f"events[{i}].name: unload of adapter {ev.name!r}, which is not loaded")
            elif isinstance(ev, ReloadAdapterEvent):
                old = bound.get(ev.name)
                if old is None:
                    raise ValueError(f"events[{i}].name: reload of adapter {ev.name!r}, which is not loaded")
                generation += 1
                bound[ev.name] = Binding(name=ev.name, source=ev.source, generation=generation,
                                         same_path_of=(old.same_path_of if old.same_path_of is not None
                                                       else old.generation) if ev.same_path else None)
        return at_admission

    def bindings_at_admission(self) -> dict[str, Binding | None]:
        """Request id (and each completion id of its ``n``) -> the adapter binding it is
        admitted with (None: the base model). The oracle's contract: a request's reference runs
        with these weights (docs/oracle.md)."""
        plan = self._plan_bindings()
        for s in self.sends:
            for cid in s.completion_ids[1:]:
                plan[cid] = plan.get(s.request_id)
        return plan

    @property
    def lifecycle(self) -> list[AdapterEvent]:
        return [e for e in self.events if isinstance(e, ADAPTER_EVENT_TYPES)]

    # -- convenience -------------------------------------------------------------------------
    @property
    def sends(self) -> list[SendEvent]:
        return [e for e in self.events if isinstance(e, SendEvent)]

    @property
    def cancels(self) -> list[CancelEvent]:
        return [e for e in self.events if isinstance(e, CancelEvent)]

    @property
    def resets(self) -> list[ResetPrefixCacheEvent]:
        return [e for e in self.events if isinstance(e, ResetPrefixCacheEvent)]

    def send(self, request_id: str) -> SendEvent:
        """The send of ``request_id``: a send's own id, or a completion id of its ``n``
        (``ID#k``), whose send is the same request."""
        for e in self.sends:
            if e.request_id == request_id:
                return e
        base, _, k = request_id.rpartition("#")
        if base and k.isdigit():
            for e in self.sends:
                if e.request_id == base and 0 < int(k) < e.sampling.n:
                    return e
        raise KeyError(request_id)

    def trace_id(self) -> str:
        """Content hash of engine + events (names and lineage excluded)."""
        data = self.model_dump(mode="json", include={"engine", "events"})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
