"""The trace: an engine configuration plus a schedule of send / cancel events.

A trace is data, versioned by ``schema_version``. It names *when* each event happens in two
clocks: ``step`` (an engine step, exact for the in-process engine) and ``offset_ms`` (wall
clock from the trace start, for HTTP servers). Either may be given; the harness that lacks
one derives it from the other with ``EngineConfig.ms_per_step``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

SCHEMA_VERSION = 1

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


class _Strict(BaseModel):
    # extra="forbid": a misspelt field in a hand-written trace is an error, not silently ignored.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class LoraSettings(_Strict):
    """LoRA serving settings. ``adapters`` maps adapter name -> path, or ``embedded:NAME``."""

    enabled: bool = False
    adapters: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default=2, ge=1, le=1024)
    max_lora_rank: int = Field(default=8, ge=1, le=1024)


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
        data = handler(self)
        if isinstance(data, dict) and data.get("kv_connector") is None:
            data.pop("kv_connector", None)
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


class SendEvent(_Strict):
    kind: Literal["send"] = "send"
    request_id: str = Field(min_length=1)
    at: At
    prompt: Prompt
    adapter: str | None = None
    max_tokens: int = Field(default=16, ge=1, le=MAX_LEN)
    stream: bool = True

    @field_validator("at")
    @classmethod
    def _no_relative_send(cls, at: At) -> At:
        if at.after_tokens is not None:
            raise ValueError("after_tokens is only meaningful for cancel events")
        return at


class CancelEvent(_Strict):
    kind: Literal["cancel"] = "cancel"
    request_id: str = Field(min_length=1)
    at: At


Event = Annotated[Union[SendEvent, CancelEvent], Field(discriminator="kind")]


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
    schema_version: Literal[1] = SCHEMA_VERSION
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
                if ev.adapter is not None:
                    if not self.engine.lora.enabled:
                        raise ValueError(
                            f"events[{i}].adapter: {ev.adapter!r} used but engine.lora.enabled is false"
                        )
                    if ev.adapter not in self.engine.lora.adapters:
                        raise ValueError(
                            f"events[{i}].adapter: unknown adapter {ev.adapter!r} "
                            f"(known: {sorted(self.engine.lora.adapters)})"
                        )
                need = ev.prompt.length + ev.max_tokens
                if need > self.engine.max_model_len:
                    raise ValueError(
                        f"events[{i}].prompt: {ev.prompt.length} prompt + {ev.max_tokens} new tokens "
                        f"exceed engine.max_model_len {self.engine.max_model_len}"
                    )
        for i, ev in enumerate(self.events):
            if isinstance(ev, CancelEvent) and ev.request_id not in sends:
                raise ValueError(f"events[{i}].request_id: cancel of unknown request {ev.request_id!r}")
        return self

    # -- convenience -------------------------------------------------------------------------
    @property
    def sends(self) -> list[SendEvent]:
        return [e for e in self.events if isinstance(e, SendEvent)]

    @property
    def cancels(self) -> list[CancelEvent]:
        return [e for e in self.events if isinstance(e, CancelEvent)]

    def send(self, request_id: str) -> SendEvent:
        for e in self.sends:
            if e.request_id == request_id:
                return e
        raise KeyError(request_id)

    def trace_id(self) -> str:
        """Content hash of engine + events (names and lineage excluded)."""
        data = self.model_dump(mode="json", include={"engine", "events"})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
