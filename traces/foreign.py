"""Finding files of the fuzzer behind vLLM issues #39146, #38606 and #39589 ("foreign" findings).

That format is known only from the files attached to those issues and from what a
third-party replayer of them reads (tests/data/foreign_finding_00030.json is one such file): a
JSON object with ``trace.events[]`` of
``{action: "send"|"cancel", request_id, offset_ms, prompt_len, prefix_len, max_tokens,
stream, adapter}``, optional ``server_flags``, and the expected victims in
``reproduction.evidence.kv_corruption.diverged_requests`` (or ``...inconsistency...``).

Conversion to a kvfuzz trace follows that replayer's semantics:

* sends are ordered by ``offset_ms``; when a request id is sent twice the later send wins;
* ``max_tokens`` defaults to 64 (``or 64``: 0 and null too); ``stream`` defaults to true;
* a cancel is honoured only if its offset is later than its request's send (the replayer
  implements a cancel as a timeout of ``cancel - send``); for a repeated cancel the last
  one in the file wins;
* prompts: the original builder is not public, so prompts are rebuilt deterministically
  from ``prompt_len``/``prefix_len`` — requests with the same ``prefix_len`` share that
  prefix, the rest depends on the request id. Prompt *content* therefore differs from the
  original, and every report of a replay says so (``PROMPT_NOTE``).

Server flags that map onto ``EngineConfig`` are applied, the rest are listed as ignored
(e.g. ``--gpu-memory-utilization``, ``--speculative-config``, the model — a replay serves
the embedded default unless ``--base-url`` points at the user's own server).
"""

from __future__ import annotations

import hashlib
import shlex
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import BadInput
from .trace import At, CancelEvent, EngineConfig, GenPrompt, LoraSettings, SendEvent, Trace

FORMAT = "vllm-issue-fuzzer"
DEFAULT_MAX_TOKENS = 64
EMBEDDED_ADAPTERS = ("a", "b", "c")
# Positions of the embedded default model.
MAX_POSITIONS = 32768
PROMPT_NOTE = ("prompt content differs from the original: the original fuzzer's prompt builder is not public, "
               "so prompts were rebuilt deterministically from prompt_len/prefix_len (requests with the same "
               "prefix_len share that prefix)")

_BOOL_FLAGS = {"enable_prefix_caching", "enable_chunked_prefill", "enable_lora"}
_INT_FLAGS = {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "max_loras",
              "max_lora_rank", "seed"}


class ForeignFinding(BaseModel):
    """A foreign finding converted for replay, with what the file expects to diverge."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["foreign-finding"] = "foreign-finding"
    format: str = FORMAT
    source: str
    finding_id: str | None = None
    trace: Trace
    # Request ids the file reports as diverged, and under which evidence key.
    expected_diverged: list[str] = Field(default_factory=list)
    evidence_key: str | None = None
    server_flags: Any = None
    applied_flags: dict[str, Any] = Field(default_factory=dict)
    ignored_flags: list[str] = Field(default_factory=list)
    # The file's adapter name -> the embedded adapter replaying it.
    adapter_map: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


def _tail_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"kvfuzz/foreign/{request_id}".encode(), digest_size=8).digest()[:4], "little")


def _num(v: Any, *, source: str, field: str, integer: bool = False, minimum: float = 0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"expected a number, got {type(v).__name__}", source=source, field=field)
    if integer and int(v) != v:
        raise BadInput(f"expected an integer, got {v!r}", source=source, field=field)
    if v != v or v in (float("inf"), float("-inf")) or v < minimum:
        raise BadInput(f"must be a finite number >= {minimum:g}, got {v!r}", source=source, field=field)
    return v


def normalize_flags(flags: Any, *, source: str) -> dict[str, Any]:
    """``server_flags`` as {snake_case name: value}: a dict ({"max-num-seqs": 8}), a list of
    command-line tokens (["--no-enable-prefix-caching", "--max-num-seqs", "8"]) or one string."""
    if flags is None:
        return {}
    if isinstance(flags, str):
        flags = shlex.split(flags)
    if isinstance(flags, dict):
        return {str(k).lstrip("-").replace("-", "_"): v for k, v in flags.items()}
    if not isinstance(flags, list) or not all(isinstance(t, (str, int, float)) for t in flags):
        raise BadInput("expected an object, a list of command-line flags, or a string", source=source,
                       field="server_flags")
    out: dict[str, Any] = {}
    tokens = [str(t) for t in flags]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            continue  # a positional (e.g. `vllm serve MODEL`): the model
        name, eq, value = tok[2:].partition("=")
        name = name.replace("-", "_")
        if eq:
            out[name] = value
        elif i < len(tokens) and not tokens[i].startswith("--"):
            out[name] = tokens[i]
            i += 1
        elif name.startswith("no_"):
            out[name[3:]] = False
        else:
            out[name] = True
    return out


def _coerce(name: str, value: Any) -> Any:
    if name in _BOOL_FLAGS:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    if name in _INT_FLAGS:
        if isinstance(value, bool):
            raise ValueError(f"not an integer: {value!r}")
        return int(str(value))
    return value


def _events(data: dict[str, Any], source: str) -> list[dict[str, Any]]:
    trace = data.get("trace")
    if not isinstance(trace, dict):
        raise BadInput("missing or not an object", source=source, field="trace")
    events = trace.get("events")
    if not isinstance(events, list):
        raise BadInput("missing or not a list", source=source, field="trace.events")
    if not events:
        raise BadInput("no events", source=source, field="trace.events")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise BadInput("expected an object", source=source, field=f"trace.events[{i}]")
        if e.get("action") not in ("send", "cancel"):
            raise BadInput(f"action must be 'send' or 'cancel', got {e.get('action')!r}", source=source,
                           field=f"trace.events[{i}].action")
        rid = e.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise BadInput("must be a non-empty string", source=source, field=f"trace.events[{i}].request_id")
        _num(e.get("offset_ms"), source=source, field=f"trace.events[{i}].offset_ms")
    return events


def _expected(data: dict[str, Any], source: str) -> tuple[list[str], str | None]:
    repro = data.get("reproduction")
    if repro is None:
        return [], None
    if not isinstance(repro, dict):
        raise BadInput("expected an object", source=source, field="reproduction")
    ev = repro.get("evidence") or {}
    if not isinstance(ev, dict):
        raise BadInput("expected an object", source=source, field="reproduction.evidence")
    for key in ("kv_corruption", "inconsistency"):
        block = ev.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise BadInput("expected an object", source=source, field=f"reproduction.evidence.{key}")
        ids = block.get("diverged_requests")
        if not ids:
            continue
        if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
            raise BadInput("expected a list of request ids", source=source,
                           field=f"reproduction.evidence.{key}.diverged_requests")
        return list(ids), key
    return [], None


def parse_foreign(data: Any, source: str = "<foreign finding>") -> ForeignFinding:
    """Convert a foreign finding to a kvfuzz trace plus its expected diverged requests."""
    if not isinstance(data, dict):
        raise BadInput(f"expected a JSON object, got {type(data).__name__}", source=source)
    events = _events(data, source)
    notes: list[str] = [PROMPT_NOTE]

    # Sends: by offset (stable), the later send of a request id wins.
    sends: dict[str, tuple[int, dict[str, Any]]] = {}
    order = sorted(((i, e) for i, e in enumerate(events) if e["action"] == "send"), key=lambda ie: ie[1]["offset_ms"])
    for i, e in order:
        if e["request_id"] in sends:
            notes.append(f"request {e['request_id']!r} is sent twice: the later send (offset "
                         f"{e['offset_ms']:g} ms) replaces the one at {sends[e['request_id']][1]['offset_ms']:g} ms")
        sends[e["request_id"]] = (i, e)
    if not sends:
        raise BadInput("no send events", source=source, field="trace.events")

    cancels: dict[str, tuple[int, float]] = {}
    for i, e in enumerate(events):
        if e["action"] == "cancel":
            cancels[e["request_id"]] = (i, float(e["offset_ms"]))

    adapters: dict[str, str] = {}
    converted: list[tuple[float, int, SendEvent | CancelEvent]] = []
    need_len = 0
    for rid, (i, e) in sends.items():
        f = f"trace.events[{i}]"
        prompt_len = int(_num(e.get("prompt_len"), source=source, field=f"{f}.prompt_len", integer=True, minimum=1))
        prefix_len = int(_num(e.get("prefix_len", 0) or 0, source=source, field=f"{f}.prefix_len", integer=True))
        if prefix_len > prompt_len:
            raise BadInput(f"prefix_len {prefix_len} exceeds prompt_len {prompt_len}", source=source,
                           field=f"{f}.prefix_len")
        max_tokens = e.get("max_tokens") or DEFAULT_MAX_TOKENS
        max_tokens = int(_num(max_tokens, source=source, field=f"{f}.max_tokens", integer=True, minimum=1))
        stream = e.get("stream", True)
        if stream is None:
            stream = True
        if not isinstance(stream, bool):
            raise BadInput(f"expected true or false, got {stream!r}", source=source, field=f"{f}.stream")
        adapter = e.get("adapter")
        if adapter is not None:
            if not isinstance(adapter, str) or not adapter:
                raise BadInput("must be a non-empty string or null", source=source, field=f"{f}.adapter")
            if adapter not in adapters:
                if len(adapters) >= len(EMBEDDED_ADAPTERS):
                    raise BadInput(f"more than {len(EMBEDDED_ADAPTERS)} adapters; the embedded default has "
                                   f"{len(EMBEDDED_ADAPTERS)}", source=source, field=f"{f}.adapter")
                adapters[adapter] = EMBEDDED_ADAPTERS[len(adapters)]
        need_len = max(need_len, prompt_len + max_tokens)
        prompt = GenPrompt(length=prompt_len, prefix_group=f"len{prefix_len}" if prefix_len else None,
                           prefix_len=prefix_len, seed=_tail_seed(rid))
        offset = float(e["offset_ms"])
        converted.append((offset, i, SendEvent(request_id=rid, at=At(offset_ms=offset), prompt=prompt,
                                               adapter=adapter, max_tokens=max_tokens, stream=stream)))
    for rid, (i, offset) in sorted(cancels.items(), key=lambda kv: kv[1][0]):
        if rid not in sends:
            notes.append(f"cancel of {rid!r} (events[{i}]) dropped: that request is never sent")
            continue
        send_offset = float(sends[rid][1]["offset_ms"])
        if offset <= send_offset:
            notes.append(f"cancel of {rid!r} at {offset:g} ms dropped: not after its send at {send_offset:g} ms "
                         f"(the original replayer honours only later cancels)")
            continue
        converted.append((offset, i, CancelEvent(request_id=rid, at=At(offset_ms=offset))))
    converted.sort(key=lambda x: (x[0], x[1]))

    # Engine configuration: defaults, then the file's server flags where they map.
    raw_flags = data.get("server_flags")
    flags = normalize_flags(raw_flags, source=source)
    cfg: dict[str, Any] = {}
    applied: dict[str, Any] = {}
    ignored: list[str] = []
    for name, value in flags.items():
        if name in _BOOL_FLAGS or name in _INT_FLAGS:
            try:
                v = _coerce(name, value)
            except ValueError as e:
                raise BadInput(str(e), source=source, field=f"server_flags.{name}") from None
            if name == "block_size" and v % 32:
                ignored.append(f"block_size={v} (the CPU build needs a multiple of 32; kept the default)")
                continue
            if name == "enable_lora":
                continue  # adapters in the trace decide
            applied[name] = v
            if name not in ("max_loras", "max_lora_rank"):
                cfg[name] = v
        elif name != "model":
            ignored.append(f"{name}={value}" if value is not True else name)
    if "model" in flags:
        notes.append(f"the file's model {flags['model']!r} is replaced by the engine kvfuzz replays on")
    if cfg.get("max_model_len", 0) > MAX_POSITIONS:
        notes.append(f"max_model_len {cfg['max_model_len']} capped at {MAX_POSITIONS} (the embedded default's positions)")
        cfg["max_model_len"] = MAX_POSITIONS
    max_len = max(cfg.get("max_model_len", EngineConfig().max_model_len), need_len)
    if need_len > MAX_POSITIONS:
        raise BadInput(f"a request needs {need_len} positions; the embedded default has {MAX_POSITIONS}",
                       source=source, field="trace.events")
    if max_len != cfg.get("max_model_len", max_len):
        notes.append(f"max_model_len raised from {cfg['max_model_len']} to {max_len} so every request fits")
    cfg["max_model_len"] = max_len
    if adapters:
        cfg["lora"] = LoraSettings(enabled=True, adapters={k: f"embedded:{v}" for k, v in adapters.items()},
                                   max_loras=int(applied.get("max_loras", min(2, len(adapters)))),
                                   max_lora_rank=int(applied.get("max_lora_rank", 8)))
        notes.append("adapters replayed with the embedded ones: "
                     + ", ".join(f"{k} -> {v}" for k, v in adapters.items()))
    if ignored:
        notes.append("server flags not applied: " + ", ".join(ignored))

    expected, key = _expected(data, source)
    finding_id = data.get("finding_id") or data.get("id") or data.get("name")
    finding_id = str(finding_id) if isinstance(finding_id, (str, int)) else None
    name = finding_id or source.rsplit("/", 1)[-1].removesuffix(".json")
    try:
        engine = EngineConfig(**cfg)
        trace = Trace(name=name, engine=engine, events=[ev for _, _, ev in converted],
                      notes={"foreign": {"format": FORMAT, "source": source, "finding_id": finding_id,
                                         "expected_diverged": expected, "prompt_note": PROMPT_NOTE}})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise BadInput(f"cannot convert to a kvfuzz trace: {first.get('msg')}", source=source,
                       field=loc or "trace") from None
    unknown = [r for r in expected if r not in sends]
    if unknown:
        notes.append(f"expected diverged requests never sent in the trace: {', '.join(unknown)}")
    return ForeignFinding(source=source, finding_id=finding_id, trace=trace, expected_diverged=expected,
                          evidence_key=key, server_flags=raw_flags, applied_flags=applied, ignored_flags=ignored,
                          adapter_map=adapters, notes=notes)
