"""The adapter lifecycle in the trace format (schema 2) and the oracle's lifecycle contract, on
hand-written traces and histories (no engine)."""

import json
from pathlib import Path

import pytest

from kvfuzz.oracle.check import classify_run, reloaded_while_running
from kvfuzz.oracle.noise import default_bounds
from kvfuzz.traces import BadInput, EventRecord, History, RequestRecord, json_schemas, load_trace, parse_trace
from kvfuzz.traces.trace import Binding, parse_embedded_source

REGRESSIONS = Path(__file__).resolve().parent.parent / "traces" / "regressions"


def _send(rid, step, adapter=None, **extra):
    e = {"kind": "send", "request_id": rid, "at": {"step": step}, "prompt": {"length": 40}, "max_tokens": 4}
    if adapter:
        e["adapter"] = adapter
    return {**e, **extra}


def _trace(events, version=2, **lora):
    return {"schema_version": version, "engine": {"lora": {"enabled": True, "adapters": {"a": "embedded:a"}, **lora}},
            "events": events}


def test_bindings_follow_the_plan_not_the_list_order():
    t = parse_trace(_trace([
        _send("r3", 9, "x"),  # listed first, admitted last
        {"kind": "load-adapter", "name": "x", "source": "embedded:b", "at": {"step": 2}},
        _send("r1", 2, "x"),  # same step as the load, after it in the list: bound
        {"kind": "reload-adapter", "name": "x", "source": "embedded:b@v2", "at": {"step": 5}},
        {"kind": "reload-adapter", "name": "a", "source": "embedded:c", "same_path": True, "at": {"step": 5}},
        _send("r2", 6, "a"),
        {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v3", "same_path": True, "at": {"step": 7}},
        _send("r4", 8, "a"),
        _send("r0", 0),
    ]))
    b = t.bindings_at_admission()
    assert b["r0"] is None
    assert (b["r1"].source, b["r1"].generation) == ("embedded:b", 1)
    assert (b["r3"].source, b["r3"].generation) == ("embedded:b@v2", 2)
    # Same-path reloads remember the generation whose directory they overwrite (the first one).
    assert (b["r2"].source, b["r2"].same_path_of) == ("embedded:c", 0)
    assert (b["r4"].source, b["r4"].same_path_of) == ("embedded:a@v3", 0)
    assert Binding.initial(t.engine, "a") == Binding(name="a", source="embedded:a")


@pytest.mark.parametrize("events,field,needle", [
    ([_send("r", 0, "x")], "events[0].adapter", "unknown adapter 'x'"),
    ([_send("r", 1, "x"), {"kind": "load-adapter", "name": "x", "source": "embedded:b", "at": {"step": 2}}],
     "events[0].adapter", "adapter 'x' is not loaded at this point of the schedule"),
    ([{"kind": "load-adapter", "name": "a", "source": "embedded:b", "at": {"step": 0}}],
     "events[0].name", "already loaded (use reload-adapter)"),
    ([{"kind": "unload-adapter", "name": "zz", "at": {"step": 0}}], "events[0].name", "which is not loaded"),
    ([{"kind": "unload-adapter", "name": "a", "at": {"step": 0}}, _send("r", 1, "a")],
     "events[1].adapter", "adapter 'a' is not loaded"),
    ([{"kind": "reload-adapter", "name": "q", "source": "embedded:b", "at": {"step": 0}}], "events[0].name",
     "reload of adapter 'q', which is not loaded"),
    ([{"kind": "load-adapter", "name": "x", "source": "embedded:b@v0", "at": {"step": 0}}], "source",
     "malformed embedded adapter source"),
    ([{"kind": "load-adapter", "name": "x", "source": "embedded:b", "at": {"after_tokens": 3}}], "at",
     "after_tokens is only meaningful for cancel events"),
    ([{"kind": "load-adapter", "name": "bad name", "source": "embedded:b", "at": {"step": 0}}], "name",
     "should match pattern"),
])
def test_bad_lifecycle_schedules_name_the_event(events, field, needle):
    with pytest.raises(BadInput) as ei:
        parse_trace(_trace(events), "t.json")
    msg = str(ei.value)
    assert msg.startswith("t.json: ") and needle in msg and field in msg and "\n" not in msg
    assert ei.value.code == 2


def test_lifecycle_needs_lora_and_schema_2():
    with pytest.raises(BadInput, match="needs schema_version 2"):
        parse_trace(_trace([{"kind": "unload-adapter", "name": "a", "at": {"step": 0}}], version=1))
    with pytest.raises(BadInput, match="cache_salt: needs schema_version 2"):
        parse_trace(_trace([_send("r", 0, cache_salt="t1")], version=1))
    d = _trace([{"kind": "load-adapter", "name": "x", "source": "embedded:b", "at": {"step": 0}}])
    d["engine"]["lora"] = {"enabled": False}
    with pytest.raises(BadInput, match="load-adapter needs engine.lora.enabled"):
        parse_trace(d)


def test_version_1_files_load_unchanged_and_new_fields_stay_out_of_old_traces():
    for p in sorted(REGRESSIONS.glob("*.json")):
        data = json.loads(p.read_text())
        t = load_trace(p)
        if t.lifecycle or t.engine.enable_prompt_embeds or any(s.per_request_fields for s in t.sends):
            continue  # lifecycle events and per-request state cannot be written in version 1
        data["schema_version"] = 1
        old = parse_trace(data)
        # Same trace id in either version; no new key appears in a trace that does not use it.
        assert old.trace_id() == t.trace_id()
        dumped = old.model_dump_json()
        assert "cache_salt" not in dumped and "max_cpu_loras" not in dumped and old.schema_version == 1


def test_new_fields_round_trip_and_reach_the_json_schema():
    t = parse_trace(_trace([
        {"kind": "load-adapter", "name": "x", "source": "embedded:b@v2", "at": {"offset_ms": 20}},
        _send("r", 3, "x", cache_salt="tenant-1"),
        {"kind": "reload-adapter", "name": "x", "source": "embedded:c", "same_path": True, "at": {"step": 9}},
        {"kind": "unload-adapter", "name": "x", "at": {"step": 12}},
    ], max_cpu_loras=2))
    again = parse_trace(json.loads(t.model_dump_json()))
    assert again == t and again.trace_id() == t.trace_id()
    assert again.engine.lora.max_cpu_loras == 2 and again.send("r").cache_salt == "tenant-1"
    kinds = json.dumps(json_schemas()["trace"])
    for k in ("load-adapter", "unload-adapter", "reload-adapter", "cache_salt", "max_cpu_loras", "same_path"):
        assert k in kinds
    assert parse_embedded_source("embedded:a@v12") == ("a", 12)
    assert parse_embedded_source("embedded:a") == ("a", 1)
    assert parse_embedded_source("some/dir") is None


# -- the contract: which requests a reload leaves unconstrained ------------------------------------

def _history(reload_step, *, sent=0, finished=10, cancel=None, adapter="a", reload_of="a"):
    rec = RequestRecord(request_id="r", adapter=adapter, sent_step=sent, finished_step=finished, cancel_step=cancel,
                        cancelled=cancel is not None, token_ids=[1, 2, 3], max_tokens=3, finish_reason="length")
    events = [EventRecord(index=0, kind="send", request_id="r", actual_step=sent)]
    reload = EventRecord(index=1, kind="reload-adapter", adapter=reload_of, actual_step=reload_step)
    events = events + [reload] if reload_step >= sent else [reload] + events
    return History(trace_id="t", engine="inprocess", events=events, requests={"r": rec}), rec


@pytest.mark.parametrize("reload_step,kw,unconstrained", [
    (5, {}, True),                          # reloaded while it ran
    (10, {}, True),                         # before its last step
    (11, {}, False),                        # after it finished
    (0, {"sent": 1}, False),                # before it was admitted: it was bound to the new weights
    (5, {"reload_of": "b"}, False),         # another adapter's reload
    (5, {"adapter": None}, False),          # a base-model request
    (5, {"finished": None, "cancel": 4}, False),  # cancelled before the reload
    (5, {"finished": None, "cancel": 7}, True),
])
def test_reload_while_running(reload_step, kw, unconstrained):
    h, rec = _history(reload_step, **kw)
    assert (reloaded_while_running(h, rec) is not None) == unconstrained


def test_unconstrained_only_when_the_output_differs():
    from kvfuzz.traces import At, GenPrompt, SendEvent

    send = SendEvent(request_id="r", at=At(step=0), prompt=GenPrompt(length=8), max_tokens=3, adapter="a")
    h, rec = _history(5)
    same = rec.model_copy()
    other = rec.model_copy(update={"token_ids": [9, 9, 9]})
    bounds = default_bounds("float32")
    assert classify_run(send, same, rec, h, bounds).cls == "ok"
    v = classify_run(send, other, rec, h, bounds)
    assert v.cls == "unconstrained" and "reloaded in place at step 5" in v.detail


def test_adapter_book_gives_every_binding_of_an_in_place_name_its_own_directory(tmp_path):
    """A load never rewrites files a request of an earlier binding may still re-read; only a
    same-path reload writes into an existing directory (its binding's own); sources are never
    written to."""
    from kvfuzz.harness.adapters import AdapterBook
    from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

    sources = {}
    for name in ("s1", "s2", "s3"):
        d = tmp_path / "src" / name
        d.mkdir(parents=True)
        (d / "adapter_model.safetensors").write_bytes(name.encode() * 10)
        sources[f"embedded:{name[-1]}"] = d
    t = parse_trace(_trace([
        {"kind": "reload-adapter", "name": "a", "source": "embedded:2", "same_path": True, "at": {"step": 1}},
    ], adapters={"a": "embedded:1"}))
    book = AdapterBook(t, lambda s: sources[s], tmp_path / "work")
    first = book.bound["a"]
    book.unload(UnloadAdapterEvent(name="a", at={"step": 1}))
    again = book.load(LoadAdapterEvent(name="a", source="embedded:2", at={"step": 2}))
    assert again.path != first.path and (Path(first.path) / "adapter_model.safetensors").read_bytes() == b"s1" * 10
    moved = book.reload(ReloadAdapterEvent(name="a", source="embedded:3", same_path=True, at={"step": 3}))
    assert moved.path == again.path and moved.lora_id == again.lora_id and moved.content_hash != again.content_hash
    newpath = book.reload(ReloadAdapterEvent(name="a", source="embedded:1", at={"step": 4}))
    assert newpath.path not in (first.path, again.path)
    assert all((d / "adapter_model.safetensors").read_bytes() == d.name.encode() * 10 for d in sources.values())
