"""``kvfuzz export``: a finding as a self-contained Python script for vLLM maintainers.

The script imports vLLM and the standard library (plus torch, numpy and safetensors, which ship
with vLLM), never kvfuzz. Everything kvfuzz knows about the finding is computed here, at export
time, and written into the script as literals: the engine arguments (``harness/vllm_args.py``,
the same mapping the in-process engine and the managed server use), every prompt's token ids
(``traces/prompts.py``), the schedule of sends, cancels and adapter events at their engine steps
(as ``harness/inprocess.py`` applies them), the adapter bindings and working copies
(``harness/adapters.py``), each victim's reference request (``SendEvent.alone``, on the
reference configuration of ``harness/base.py``). The embedded model is rebuilt by the script
from a copy of ``harness/embedded.py``'s recipe, and checked against kvfuzz's content hash. A
speculative finding's in-process script also holds a copy of ``harness/compat.py``'s
``tolerate_kernel_scan``: its reference engines start after one that loaded numba's llvmlite.

Two forms: in-process (``LLMEngine.add_request`` / ``step`` / ``abort_request`` / ``add_lora`` /
``remove_lora``, step-exact like kvfuzz's in-process engine) and ``--server`` (vLLM's
OpenAI-compatible server, driven by wall-clock offsets like ``harness/server.py``: best-effort).

A finding that needs one of kvfuzz's toggles (a planted fault, or a fix patching vLLM) is not
vLLM as shipped, and is refused (``BadInput``: exit 2, one line naming the toggle).
"""

from __future__ import annotations

import inspect
import os
import pprint
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfuzz.oracle.buckets import crash_state
from kvfuzz.traces import BadInput, Finding, SendEvent, Trace, expand, load_any
from kvfuzz.traces.finding import DIVERGENT_CLASSES
from kvfuzz.traces.foreign import ForeignFinding
from kvfuzz.traces.trace import (
    EMBEDDED_HYBRID,
    EMBEDDED_MODEL,
    Binding,
    CancelEvent,
    LoadAdapterEvent,
    ReloadAdapterEvent,
    UnloadAdapterEvent,
    parse_embedded_source,
)

from . import export_runtime

# The oracle's pseudo request id of an engine crash that hit no live request.
_ENGINE = "<engine>"
# Mirrors harness/inprocess.py: a trace unfinished after this many steps beyond its plan is hung.
_MAX_IDLE_STEPS = 100_000


@dataclass
class ExportSource:
    """What an export starts from: a trace, the requests to judge, and where it came from."""

    path: str
    kind: str  # "finding", "trace", "foreign"
    trace: Trace
    victims: list[str]  # completion ids (a send's id, or ID#k for a child of its n)
    arm: str | None = None
    finding: Finding | None = None
    notes: list[str] = field(default_factory=list)


# -- reading and refusing ---------------------------------------------------------------------------


def _toggle_refusal(toggles: list[str], *, source: str, field_name: str, arm: str | None) -> BadInput:
    from kvfuzz.harness.toggles import kinds

    known = kinds()
    name = sorted(toggles, key=lambda t: (known.get(t) != "fault", t))[0]
    where = f"its arm {arm!r}" if arm else "the trace"
    if known.get(name) == "fault" or name.startswith("fault-"):
        why = f"{where} needs kvfuzz's fault toggle {name!r}, a planted bug"
    else:
        why = (f"{where} ran with kvfuzz's toggle {name!r}, which patches vLLM (replay it with "
               f"`kvfuzz replay FILE --arms vanilla` and export the finding that writes)")
    return BadInput(f"{why}: not a vLLM bug as shipped, so there is nothing to export", source=source,
                    field=field_name)


def _completion_ids(trace: Trace) -> list[str]:
    return [c for s in trace.sends for c in s.completion_ids]


def read_source(path: Path, requests: list[str] | None = None) -> ExportSource:
    """The trace and victims of a finding, trace or foreign finding file. Refuses (BadInput)
    what cannot run on vLLM as shipped without kvfuzz."""
    src = str(path)
    obj = load_any(path)
    if isinstance(obj, Finding):
        arms = dict(obj.arms)
        divergent = [d for d in obj.divergences if d.class_ in DIVERGENT_CLASSES]
        if not divergent:
            raise BadInput("the finding has no divergence to reproduce", source=src, field="divergences")

        def toggles_of(arm: str) -> list[str]:
            return list(arms[arm]) if arm in arms else list(obj.environment.toggles or obj.trace.engine.toggles)

        # Arms in the order a maintainer reads them (the leading divergence's first).
        lead = obj.leading(divergent)
        order = [lead.arm] if lead is not None else []
        order += [d.arm for d in divergent if d.arm not in order]
        plain = [a for a in order if not toggles_of(a)]
        if not plain:
            raise _toggle_refusal(toggles_of(order[0]), source=src, field_name=f"arms.{order[0]}", arm=order[0])
        arm = plain[0]
        victims = [d.request_id for d in divergent if d.arm == arm]
        trace = obj.trace.model_copy(update={"engine": obj.trace.engine.model_copy(update={"toggles": []})})
        if _ENGINE in victims:
            victims = _completion_ids(trace)
        out = ExportSource(src, "finding", trace, victims, arm=arm, finding=obj)
        if lead is not None and lead.arm != arm:
            out.notes.append(f"exported arm {arm!r}; the leading divergence is in arm {lead.arm!r}, which needs toggles")
    elif isinstance(obj, ForeignFinding):
        out = ExportSource(src, "foreign", obj.trace, list(obj.expected_diverged) or _completion_ids(obj.trace))
        out.notes += [f"foreign finding: {n}" for n in obj.notes]
    else:
        assert isinstance(obj, Trace)
        if obj.engine.toggles:
            raise _toggle_refusal(list(obj.engine.toggles), source=src, field_name="engine.toggles", arm=None)
        out = ExportSource(src, "trace", obj, _completion_ids(obj))
        if obj.expect is not None:
            fails_in = list(obj.expect.fails_in)
            if fails_in and all(a.startswith("with:") for a in fails_in):
                out.notes.append(f"this trace's expectation names only kvfuzz fault arms ({', '.join(fails_in)}): on the "
                                 f"vLLM kvfuzz runs on it passes as shipped (a release with the bug it models may "
                                 f"still fail it)")
    known = set(_completion_ids(out.trace))
    if requests:
        for r in requests:
            if r not in known:
                raise BadInput(f"no request {r!r} in the trace (requests: {', '.join(sorted(known))})",
                               source=src, field="--request")
        out.victims = list(dict.fromkeys(requests))
    out.victims = [v for v in out.victims if v in known]
    if not out.victims:
        raise BadInput("no request of the trace to judge", source=src, field="divergences")
    _check_exportable(out)
    return out


def _check_exportable(src: ExportSource) -> None:
    engine = src.trace.engine
    prefix = "trace.engine" if src.kind == "finding" else "engine"
    if engine.kv_connector is not None:
        raise BadInput(f"KV connector {engine.kv_connector!r} is kvfuzz's own (harness/kv_connector.py): the script "
                       f"would need kvfuzz", source=src.path, field=f"{prefix}.kv_connector")
    if engine.model.startswith("embedded:") and engine.model not in (EMBEDDED_MODEL, EMBEDDED_HYBRID):
        raise BadInput(f"unknown embedded model {engine.model!r}", source=src.path, field=f"{prefix}.model")
    if engine.model == EMBEDDED_HYBRID and engine.lora.enabled:
        raise BadInput(f"{EMBEDDED_HYBRID} has no LoRA adapters", source=src.path, field=f"{prefix}.lora.enabled")
    for key, value in engine.extra_args.items():
        if "kvfuzz" in repr(value):
            raise BadInput(f"engine argument {key!r} names kvfuzz code ({value!r}): the script would need kvfuzz",
                           source=src.path, field=f"{prefix}.extra_args.{key}")


# -- the plan: literals for the script ------------------------------------------------------------------


def _path_spec(kind: str, value: str) -> list[str]:
    return [kind, value]


class _Book:
    """``harness.adapters.AdapterBook`` without touching a disk: each binding's adapter id, its
    directory (``["source", SOURCE]``: the source's own directory; ``["work", REL]``: a working
    copy, for names the trace reloads in place) and whether it was made by an in-place reload.
    Same ids, same copies, in the same order as the harness makes them."""

    def __init__(self, trace: Trace) -> None:
        self.in_place = {e.name for e in trace.lifecycle if isinstance(e, ReloadAdapterEvent) and e.same_path}
        self.bound: dict[str, list[Any]] = {}  # name -> [name, id, path spec, inplace]
        self.copies: list[list[str]] = []  # [rel, source] made before the run
        self._next_id = 1
        self._n_copies = 0
        for name, source in sorted(trace.engine.lora.adapters.items()):
            self._bind(name, source, lora_id=self._take(), copies=self.copies)

    def _take(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _bind(self, name: str, source: str, *, lora_id: int, copies: list[list[str]], inplace: bool = False,
              path: list[str] | None = None) -> list[Any]:
        if name in self.in_place:
            if path is None:
                self._n_copies += 1
                path = _path_spec("work", f"{name}/{self._n_copies}")
            copies.append([path[1], source])
        else:
            path = _path_spec("source", source)
        lora = [name, lora_id, path, inplace]
        self.bound[name] = lora
        return lora

    def load(self, ev: LoadAdapterEvent, copies: list[list[str]]) -> list[Any]:
        return self._bind(ev.name, ev.source, lora_id=self._take(), copies=copies)

    def unload(self, ev: UnloadAdapterEvent) -> list[Any]:
        return self.bound.pop(ev.name)

    def reload(self, ev: ReloadAdapterEvent, copies: list[list[str]]) -> list[Any]:
        old = self.bound[ev.name]
        if ev.same_path:
            return self._bind(ev.name, ev.source, lora_id=old[1], inplace=True, path=old[2], copies=copies)
        return self._bind(ev.name, ev.source, lora_id=old[1], inplace=True, copies=copies)


def _embeds(send: SendEvent) -> dict[str, Any] | None:
    if send.embeds is None:
        return None
    return {"perturbed": list(send.embeds.perturbed), "scale": send.embeds.scale, "seed": send.embeds.seed,
            "as_ids": [list(r) for r in send.embeds.as_ids]}


def _send_literal(send: SendEvent, lora: list[Any] | None, *, model: str) -> dict[str, Any]:
    from kvfuzz.harness.http.wire import completion_payload
    from kvfuzz.harness.vllm_args import request_fields

    body = completion_payload(send.model_copy(update={"embeds": None}), model, stream=True)
    body.pop("prompt", None)
    body.pop("model", None)
    return {"id": send.request_id, "prompt": send.request_id, "max_tokens": send.max_tokens,
            "params": {"max_tokens": send.max_tokens, **request_fields(send.sampling)},
            "n": send.sampling.n, "completions": send.completion_ids, "adapter": send.adapter, "lora": lora,
            "priority": send.priority, "cache_salt": send.cache_salt, "embeds": _embeds(send), "body": body}


def _engine_kwargs(config: Any) -> dict[str, Any]:
    from kvfuzz.harness.vllm_args import engine_args

    args = engine_args(config, "<model>")
    args.pop("model")
    return args


def _server_flags(config: Any) -> list[str]:
    from kvfuzz.harness.vllm_args import args_to_flags, engine_args

    flags = args_to_flags(engine_args(config, "<model>"))
    # As harness/vllm_args.server_command: the model's generation_config.json must not set
    # sampling defaults the in-process engine's plain SamplingParams do not have.
    return flags + ["--generation-config", "vllm", "--disable-uvicorn-access-log"]


def _source_info(sources: set[str]) -> dict[str, Any]:
    """Per adapter source: how the script gets its directory, and the content hash kvfuzz's
    build of it has (embedded adapters and their variants)."""
    from kvfuzz.harness.adapters import resolve_source
    from kvfuzz.harness.embedded import adapter_hash

    out: dict[str, Any] = {}
    for s in sorted(sources):
        parsed = parse_embedded_source(s)
        if parsed is None:
            out[s] = {"embedded": None, "version": None, "hash": None}
        else:
            out[s] = {"embedded": parsed[0], "version": parsed[1], "hash": adapter_hash(resolve_source(s))}
    return out


def _model_info(src: ExportSource) -> dict[str, Any]:
    from kvfuzz.harness import embedded

    model = src.trace.engine.model
    recorded = src.finding.environment.model_hash if src.finding is not None else None
    if model == EMBEDDED_MODEL:
        built = embedded.build()
        info = {"embedded": embedded.MODEL_NAME, "path": None, "hash": built.content_hash}
    elif model == EMBEDDED_HYBRID:
        built = embedded.build_hybrid()
        info = {"embedded": embedded.HYBRID_NAME, "path": None, "hash": built.content_hash}
    else:
        info = {"embedded": None, "path": model, "hash": None}
    if recorded and info["hash"] and recorded != info["hash"]:
        src.notes.append(f"the finding was recorded with embedded model build {recorded}; this kvfuzz (and the "
                         f"script) builds {info['hash']}, as `kvfuzz replay` would")
    return info


def plan(src: ExportSource) -> dict[str, Any]:
    """Everything the script needs, as plain data (the ``FINDING`` literal)."""
    from kvfuzz.harness.base import reference_config

    trace = src.trace
    config = trace.engine
    mps = config.ms_per_step
    book = _Book(trace) if config.lora.enabled else None
    initial_copies = list(book.copies) if book is not None else []
    initial = {n: list(b) for n, b in sorted(book.bound.items())} if book is not None else {}
    prompts: dict[str, list[int]] = {s.request_id: expand(s.prompt) for s in trace.sends}
    schedule: list[dict[str, Any]] = []
    relative: list[dict[str, Any]] = []
    sources = set(config.lora.adapters.values()) if config.lora.enabled else set()
    for i in trace.planned_order():
        ev = trace.events[i]
        base = {"index": i, "step": ev.at.step_or(mps), "offset_ms": ev.at.offset_or(mps)}
        if isinstance(ev, SendEvent):
            lora = None
            if ev.adapter is not None:
                assert book is not None
                lora = list(book.bound[ev.adapter])
            schedule.append({**base, "op": "send", "send": _send_literal(ev, lora, model=config.model)})
        elif isinstance(ev, CancelEvent):
            schedule.append({**base, "op": "cancel", "id": ev.request_id})
        elif ev.kind == "reset-prefix-cache":
            # LLMEngine.reset_prefix_cache between two steps (POST /reset_prefix_cache on a server).
            schedule.append({**base, "op": "reset",
                             "reset_running_requests": bool(getattr(ev, "reset_running_requests", False))})
        else:
            assert book is not None
            copies: list[list[str]] = []
            if isinstance(ev, LoadAdapterEvent):
                sources.add(ev.source)
                schedule.append({**base, "op": "load", "name": ev.name, "lora": list(book.load(ev, copies)),
                                 "copies": copies})
            elif isinstance(ev, ReloadAdapterEvent):
                sources.add(ev.source)
                schedule.append({**base, "op": "reload", "name": ev.name, "lora": list(book.reload(ev, copies)),
                                 "copies": copies})
            else:
                assert isinstance(ev, UnloadAdapterEvent)
                gone = book.unload(ev)
                schedule.append({**base, "op": "unload", "name": ev.name, "lora_id": gone[1]})
    for i, ev in enumerate(trace.events):
        if isinstance(ev, CancelEvent) and ev.at.after_tokens is not None:
            floor = ev.at.offset_ms if ev.at.offset_ms is not None else (
                ev.at.step * mps if ev.at.step is not None else None)
            relative.append({"index": i, "id": ev.request_id, "after_tokens": ev.at.after_tokens,
                             "step": ev.at.step, "floor_ms": floor})
    # References: each victim's send alone (its n children share one), with the weights its
    # adapter name was bound to at its admission.
    bindings = trace.bindings_at_admission()
    references: dict[str, Any] = {}
    victim_sends: list[str] = []
    for v in src.victims:
        s = trace.send(v)
        if s.request_id not in victim_sends:
            victim_sends.append(s.request_id)
    for rid in victim_sends:
        s = trace.send(rid)
        alone = s.alone()
        binding: Binding | None = bindings.get(rid)
        lora = None
        if s.adapter is not None and binding is not None:
            adapters = {**config.lora.adapters, s.adapter: binding.source}
            lora = [s.adapter, sorted(adapters).index(s.adapter) + 1, _path_spec("source", binding.source), False]
            sources.add(binding.source)
        references[rid] = _send_literal(alone, lora, model=config.model)
    total = sum(s.prompt.length + s.max_tokens for s in trace.sends)
    last = max((e["step"] for e in schedule), default=0)
    recorded = _recorded(src)
    finding = src.finding
    env = finding.environment if finding is not None else None
    return {
        "source": Path(src.path).name,
        "kind": src.kind,
        "finding_id": finding.id if finding is not None else None,
        "name": trace.name,
        "arm": src.arm,
        "recorded_vllm": env.vllm_version if env is not None else None,
        "recorded_kvfuzz": env.kvfuzz_version if env is not None else None,
        "model": _model_info(src),
        "model_name": config.model,
        "dtype": config.dtype,
        "engine": _engine_kwargs(config),
        "reference_engine": _engine_kwargs(reference_config(config)),
        "server_flags": _server_flags(config),
        "reference_server_flags": _server_flags(reference_config(config)),
        "speculative": config.speculative is not None,
        "lora": config.lora.enabled,
        "initial_adapters": initial,
        "initial_copies": initial_copies,
        "adapter_sources": _source_info(sources),
        "prompts": prompts,
        "schedule": schedule,
        "relative_cancels": relative,
        "max_steps": last + min(_MAX_IDLE_STEPS, 4 * total + 1000),
        "victims": list(src.victims),
        "references": references,
        "recorded": recorded,
        "failure": _failure(src),
    }


def _failure(src: ExportSource) -> dict[str, Any] | None:
    """What went wrong when kvfuzz recorded the finding: a crash (with what it raised, when it
    names an exception) or changed outputs. None for a trace: anything that differs counts."""
    f = src.finding
    if f is None:
        return None
    crashes = [d for d in f.divergences if d.arm == src.arm and d.class_ == "engine-crash"]
    if not crashes:
        return {"kind": "output"}
    detail = str(crashes[0].detail or "")
    return {"kind": "crash", "state": crash_state(detail) if " raised " in detail else None}


def _recorded(src: ExportSource) -> dict[str, Any]:
    """What kvfuzz recorded for each victim (a finding's reference and first diverged run)."""
    f = src.finding
    if f is None:
        return {}
    out: dict[str, Any] = {}
    for v in src.victims:
        entry: dict[str, Any] = {}
        ref = f.references.get(v)
        if ref is not None:
            entry["reference"] = list(ref.token_ids)
        for h in f.runs:
            if h.arm == src.arm and v in h.requests:
                entry["run"] = list(h.requests[v].token_ids)
                break
        div = next((d for d in f.divergences if d.request_id == v and d.arm == src.arm), None)
        if div is not None:
            entry["class"] = div.class_
        out[v] = entry
    return out


# -- rendering ---------------------------------------------------------------------------------------


def _literal(obj: Any) -> str:
    return pprint.pformat(obj, width=110, compact=True, sort_dicts=False)


_RECIPE_CONSTANTS = ("BUILD_VERSION", "MODEL_NAME", "ADAPTERS", "LORA_RANK", "VOCAB", "HIDDEN", "LAYERS", "HEADS",
                     "KV_HEADS", "HEAD_DIM", "INTERMEDIATE", "MAX_POSITIONS", "INIT_STD", "MANIFEST", "HYBRID_NAME",
                     "HYBRID_BUILD_VERSION", "HYBRID_LAYER_TYPES", "HYBRID_WINDOW", "VARIANT_SEED_STRIDE",
                     "EMBED_TABLE")
_RECIPE_FUNCTIONS = ("_write_safetensors", "_write_json", "_model_tensors", "_adapter_tensors", "_config",
                     "_hybrid_config", "_tokenizer", "_tokenizer_config", "_adapter_config", "content_hash",
                     "_build_into", "_build_hybrid_into", "prompt_embeddings")


def recipe_source() -> str:
    """harness/embedded.py's build recipe (its constants and functions, verbatim), standalone."""
    from kvfuzz.harness import embedded

    lines = [f"{name} = {getattr(embedded, name)!r}" for name in _RECIPE_CONSTANTS]
    funcs = [inspect.getsource(getattr(embedded, name)).rstrip() for name in _RECIPE_FUNCTIONS]
    return "\n".join(lines) + "\n\n\n" + "\n\n\n".join(funcs) + "\n"


def kernel_scan_source() -> str:
    """harness/compat.py's ``tolerate_kernel_scan``, verbatim."""
    from kvfuzz.harness import compat

    return inspect.getsource(compat.tolerate_kernel_scan)


def _inprocess_code(speculative: bool) -> list[str]:
    """The in-process form's code. A speculative finding's references start after an engine that
    loaded numba's llvmlite: its script calls harness/compat.py's ``tolerate_kernel_scan`` (a
    copy) before each engine start, as harness/inprocess.py does."""
    code = export_runtime.INPROCESS.strip()
    if not speculative:
        return [code]
    start = export_runtime.ENGINE_START
    assert code.count(start) == 1, "export_runtime.INPROCESS: new_engine's start is not where it was"
    code = code.replace(start, export_runtime.KERNEL_SCAN_CALL + start)
    return [export_runtime.KERNEL_SCAN.strip(), "", "", kernel_scan_source().rstrip(), "", "", code]


def _docstring(data: dict[str, Any], src: ExportSource, *, server: bool) -> str:
    what = f"kvfuzz finding {data['finding_id']}" if data["finding_id"] else f"kvfuzz {data['kind']}"
    sends = [e for e in data["schedule"] if e["op"] == "send"]
    events = len(data["schedule"]) + len(data["relative_cancels"])
    life = sum(1 for e in data["schedule"] if e["op"] in ("load", "unload", "reload"))
    resets = sum(1 for e in data["schedule"] if e["op"] == "reset")
    extra = [f"{life} adapter load/unload/reload"] * bool(life) + [f"{resets} prefix-cache reset"] * bool(resets)
    lines = [
        f"Reproduce {what} ({data['source']}{', ' + repr(data['name']) if data['name'] else ''}) on vLLM, "
        f"without kvfuzz.",
        "",
        f"Model {data['model_name']} ({data['dtype']}), {len(sends)} requests, {events} events"
        + (f" ({', '.join(extra)})" if extra else "") + f"; judged: {', '.join(data['victims'])}.",
    ]
    if data["recorded_vllm"]:
        lines.append(f"kvfuzz {data['recorded_kvfuzz']} recorded it on {data['recorded_vllm']}"
                     + (f", arm {data['arm']!r} (no kvfuzz toggle: vLLM as shipped)." if data["arm"] else "."))
    lines.append("")
    if server:
        lines += [
            "Form: vLLM's OpenAI-compatible server. The script starts one (python -m",
            "vllm.entrypoints.openai.api_server, with the finding's engine flags) or drives the one given",
            "with --url (started with the same flags, VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache and,",
            "for adapter events, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; adapter paths must be readable by",
            "it). Each send goes to /v1/completions at its wall-clock offset, a cancel closes its",
            "connection. BEST-EFFORT by nature: the server's schedule depends on timing, so a run may",
            "batch requests otherwise than kvfuzz's step-exact run did; run it a few times, or use the",
            "in-process form (kvfuzz export without --server), which replays the exact engine steps.",
            "Each judged request's reference is the same request alone, after /reset_prefix_cache",
            "(speculative decoding off, on a second server, when the finding uses it).",
        ]
    else:
        lines += [
            "Form: in-process vLLM (LLMEngine.add_request / step / abort_request / add_lora /",
            "remove_lora), every event applied before the engine step kvfuzz applied it at, with",
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 so that the engine core steps in this process: the same",
            "schedule as kvfuzz's run. Each judged request's reference is the same request alone on a",
            "fresh engine (speculative decoding off when the finding uses it), as kvfuzz's oracle defines it.",
        ]
    lines += [
        "",
        "Token ids are compared exactly (temperature 0). In a 16-bit dtype (bfloat16, float16) a",
        "near tie between two tokens can flip legitimately when batch shapes change; the script prints",
        "the reference's top-1/top-2 logprob margin at the first differing token: a margin of a few",
        "hundredths of a nat or less in 16 bits may be such a tie, not a bug.",
        "",
        "Prints, per request, the expected (reference) and actual tokens, then REPRODUCED (exit 1)",
        "when any judged request differs from its reference, else NOT REPRODUCED (exit 0).",
        "INCONCLUSIVE (exit 4): another failure than the one kvfuzz recorded (a crash where it",
        "recorded changed outputs, changed outputs or another exception where it recorded a crash):",
        "another bug hides this one. Exit 3: the script could not run (an engine failed to start, a",
        "model build mismatch).",
        "",
        f"Usage: python {'repro_server.py [--url http://HOST:PORT]' if server else 'repro.py'} "
        "[--only REQUEST_ID] [--workdir DIR]",
        "",
        "Written by `kvfuzz export`; the data below is computed by kvfuzz, the embedded model's build",
        "recipe is a copy of kvfuzz's harness/embedded.py. Nothing here imports kvfuzz.",
    ]
    for n in src.notes:
        lines += ["", f"Note: {n}"]
    return '"""' + "\n".join(lines).replace('"""', "'''").replace("\\", "\\\\") + '\n"""'


def _check_server(src: ExportSource) -> None:
    """What vLLM's server cannot be sent (harness/http/wire.py ``prompt_fields`` refuses the same)."""
    for i, ev in enumerate(src.trace.events):
        if isinstance(ev, SendEvent) and ev.embeds is not None:
            if ev.embeds.as_ids:
                raise BadInput("a prompt part token ids, part embeddings cannot be sent to vLLM's server "
                               "(/v1/completions has no prompt_is_token_ids); export it without --server",
                               source=src.path, field=f"events[{i}].embeds.as_ids")
            if ev.sampling.prompt_logprobs is not None:
                raise BadInput("vLLM's server refuses prompt_logprobs with prompt embeddings; export it without "
                               "--server", source=src.path, field=f"events[{i}].sampling.prompt_logprobs")


def render(src: ExportSource, *, server: bool = False) -> str:
    """The script's text."""
    if server:
        _check_server(src)
    data = plan(src)
    parts = [
        "#!/usr/bin/env python3",
        _docstring(data, src, server=server),
        "",
        export_runtime.PRELUDE.strip(),
        "",
        "# -- the finding, as kvfuzz computed it at export time " + "-" * 44,
        "FINDING = " + _literal(data),
        "",
        "",
        "# -- the embedded model's build recipe (a copy of kvfuzz's harness/embedded.py) " + "-" * 18,
        recipe_source().rstrip(),
        "",
        "",
        export_runtime.COMMON.strip(),
        "",
        "",
        "# -- what a crash raised, its numbers masked (a copy of kvfuzz's oracle/buckets.py) " + "-" * 15,
        inspect.getsource(crash_state).rstrip(),
        "",
        "",
        *([export_runtime.SERVER.strip()] if server else _inprocess_code(data["speculative"])),
        "",
        "",
        export_runtime.ENTRY.strip(),
        "",
    ]
    return "\n".join(parts)


def export(path: Path, out: Path, *, server: bool = False, requests: list[str] | None = None) -> ExportSource:
    """Write the script for ``path`` to ``out`` (atomically); returns what was exported."""
    from kvfuzz.traces import atomic_write_text

    src = read_source(path, requests)
    text = render(src, server=server)
    compile(text, str(out), "exec")  # a broken script is kvfuzz's bug: fail here, not at the maintainer's
    atomic_write_text(out, text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o755 & ~umask)  # a script: readable and runnable as ./repro.py
    return src
