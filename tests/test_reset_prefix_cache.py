"""Prefix-cache resets (issue 57, item 2), fast tier: the trace format (schema 5), the history
record, the generator's draw, the mutation operator and the graft, the minimizer's schedule
pass, coverage, the oracle (no rule of its own), the report, and the HTTP replay against a
small fake of vLLM's dev-mode route. The real engine is tests/test_reset_prefix_cache_engine.py;
the real server, tests/test_server.py."""

from __future__ import annotations

import json
import random
import threading
from urllib.parse import parse_qs, urlsplit

import pytest
from http_fakes import JsonHandler, serve

from kvfuzz.fuzzer import GenOptions, default_engine, generate
from kvfuzz.fuzzer.feedback import signature
from kvfuzz.fuzzer.generate import GENERATOR
from kvfuzz.fuzzer.mutate import OPERATORS, apply, choose_operators, graft, mutate
from kvfuzz.fuzzer.shapes import shared_prefix_tokens
from kvfuzz.harness.http import wire
from kvfuzz.harness.url import UrlEngine
from kvfuzz.oracle import check
from kvfuzz.traces import (At, BadInput, EngineConfig, EventRecord, GenPrompt, History, RequestRecord,
                           ResetPrefixCacheEvent, SendEvent, Trace, json_schemas, parse_trace)
from kvfuzz.triage.minimize import Minimizer, Options, Target


def _send(rid, step, *, group="g", prefix=96, length=128, max_tokens=8, seed=None):
    prompt = GenPrompt(length=length, prefix_group=group, prefix_len=prefix,
                       seed=sum(map(ord, rid)) if seed is None else seed)
    return SendEvent(request_id=rid, at=At(step=step, offset_ms=step * 10.0), prompt=prompt, max_tokens=max_tokens)


def _trace(*, running=True, step=3, **kw):
    return Trace(events=[_send("r0", 0), ResetPrefixCacheEvent(at=At(step=step, offset_ms=step * 10.0),
                                                               reset_running_requests=running),
                         _send("r1", 4)], **kw)


# -- the format ------------------------------------------------------------------------------------

def test_reset_round_trips_with_its_json_type_name():
    t = _trace()
    data = json.loads(t.model_dump_json())
    assert data["schema_version"] == 5
    assert data["events"][1] == {"kind": "reset-prefix-cache", "at": {"step": 3, "offset_ms": 30.0, "after_tokens": None},
                                 "reset_running_requests": True}
    again = parse_trace(data)
    assert again == t and again.resets == [t.events[1]] and again.trace_id() == t.trace_id()
    plain = parse_trace({"schema_version": 5, "events": [{"kind": "reset-prefix-cache", "at": {"step": 2}}]})
    assert plain.resets[0].reset_running_requests is False
    assert "reset-prefix-cache" in json.dumps(json_schemas()["trace"])


@pytest.mark.parametrize("edit,field,needle", [
    (lambda d: d.update(schema_version=4), "events[1]", "reset-prefix-cache needs schema_version 5"),
    (lambda d: d["events"][1]["at"].update(after_tokens=2), "events.1.reset-prefix-cache.at",
     "after_tokens is only meaningful for cancel events, not reset-prefix-cache"),
    (lambda d: d["events"][1].update(reset_running=True), "events.1.reset-prefix-cache.reset_running",
     "Extra inputs are not permitted"),
    (lambda d: d["events"][1].update(reset_running_requests="often"), "events.1.reset-prefix-cache.reset_running_requests",
     "valid boolean"),
    (lambda d: d["events"][1].pop("at"), "events.1.reset-prefix-cache.at", "Field required"),
])
def test_bad_resets_are_one_line_naming_the_field(edit, field, needle):
    d = json.loads(_trace().model_dump_json())
    edit(d)
    with pytest.raises(BadInput) as ei:
        parse_trace(d, source="t.json")
    msg = str(ei.value)
    assert "\n" not in msg and field in msg and needle in msg, msg


def test_older_traces_still_load_and_the_history_record_keeps_its_bytes():
    old = parse_trace({"schema_version": 4, "events": [_send("r0", 0).model_dump(mode="json")]})
    assert old.schema_version == 4 and not old.resets
    plain = EventRecord(index=0, kind="send", request_id="r0")
    assert "reset" not in plain.model_dump(mode="json") and "preempted" not in plain.model_dump(mode="json")
    rec = EventRecord(index=1, kind="reset-prefix-cache", actual_step=3, reset="done", preempted=["r0"])
    h = History(trace_id="t", engine="inprocess", events=[plain, rec])
    assert History.model_validate_json(h.model_dump_json()) == h


# -- the generator -----------------------------------------------------------------------------------

def test_the_generator_draws_a_reset_in_a_tenth_of_traces_half_with_running_requests():
    eng = default_engine()
    seeds = range(600)
    drawn = [generate(s, eng) for s in seeds]
    with_reset = [t for t in drawn if t.resets]
    assert 40 <= len(with_reset) <= 85, len(with_reset)  # p_reset 0.1: 60 expected
    running = sum(t.resets[0].reset_running_requests for t in with_reset)
    assert 0.3 <= running / len(with_reset) <= 0.7
    paired = 0
    for t in with_reset:
        assert len(t.resets) == 1 and t.lineage.generator == GENERATOR == "random-v7"
        assert parse_trace(t.model_dump(mode="json")) == t
        i = t.events.index(t.resets[0])
        step = t.resets[0].at.step
        earlier = [e for e in t.events[:i] if isinstance(e, SendEvent)]
        later = [e for e in t.events[i + 1:] if isinstance(e, SendEvent)]
        assert earlier and any(e.at.step < step for e in earlier)  # after a send: while it runs
        if any(min(shared_prefix_tokens(a, b), b.prompt.length - 1) >= eng.block_size for a in earlier for b in later):
            paired += 1
    assert paired >= len(with_reset) // 2, paired  # mostly between requests that share a full block


def test_other_traces_are_drawn_as_before():
    eng = default_engine(lora=True)
    opts = GenOptions(adapters=sorted(eng.lora.adapters))
    off = GenOptions(adapters=sorted(eng.lora.adapters), p_reset=0.0)
    for s in range(200):
        t, before = generate(s, eng, opts), generate(s, eng, off)
        assert t.engine == before.engine
        assert [e for e in t.events if not isinstance(e, ResetPrefixCacheEvent)] == before.events, s
        if not t.resets:
            assert t.trace_id() == before.trace_id()
    plain = generate(3, eng, GenOptions(adapters=opts.adapters, request_state=0.0, p_priority=0.0, p_embeds=0.0,
                                        p_spec=0.0, p_reset=0.0))
    assert plain.lineage.generator == "random-v2" and not plain.resets


# -- mutation and grafts --------------------------------------------------------------------------------

def test_the_reset_operator_adds_moves_flips_and_removes():
    eng = default_engine()
    plain = Trace(schema_version=4, engine=eng, events=[_send("r0", 0), _send("r1", 4)])
    added = apply(plain, ["reset_cache"], random.Random(1))
    assert added is not None and added.schema_version == 5 and len(added.resets) == 1
    assert added.events.index(added.resets[0]) == 1  # between the two sharers
    seen = set()
    t = _trace()
    for k in range(60):
        m = apply(t, ["reset_cache"], random.Random(k))
        if m is None:
            continue
        if not m.resets:
            seen.add("removed")
        elif len(m.resets) == 2:
            seen.add("added")
        elif m.resets[0].reset_running_requests != t.resets[0].reset_running_requests:
            seen.add("flipped")
        elif m.resets[0].at != t.resets[0].at:
            seen.add("moved")
    assert seen == {"removed", "added", "flipped", "moved"}
    # shift and drop handle a reset like any event
    shifted = [apply(t, ["shift"], random.Random(k)) for k in range(40)]
    assert any(s is not None and s.resets and s.resets[0].at.step != 3 for s in shifted)
    assert any(d is not None and not d.resets for d in (apply(t, ["drop"], random.Random(k)) for k in range(40)))


def test_the_reset_operator_is_drawn_only_for_traces_with_a_reset_or_when_named():
    assert OPERATORS["reset_cache"].resets
    plain = {n for s in range(400) for n in choose_operators(random.Random(s))}
    assert "reset_cache" not in plain
    assert "reset_cache" in {n for s in range(400) for n in choose_operators(random.Random(s), resets=True)}
    assert set(choose_operators(random.Random(0), allowed=["reset_cache"])) == {"reset_cache"}
    without = Trace(events=[_send("r0", 0), _send("r1", 4)])
    assert all("reset_cache" not in mutate(without, random.Random(s)).lineage.operators for s in range(60))
    assert any("reset_cache" in mutate(_trace(), random.Random(s)).lineage.operators for s in range(60))


def test_a_graft_carries_the_donors_resets_within_its_window():
    base = Trace(schema_version=4, engine=default_engine(), events=[_send("b0", 0, group="h"), _send("b1", 6, group="h")])
    donor = _trace()
    out = graft(base, donor, random.Random(0), max_sends=8)
    assert out.schema_version == 5 and len(out.resets) == 1
    sends = {s.request_id: s.at.step for s in out.sends}
    assert sends["x.r0"] < out.resets[0].at.step <= sends["x.r1"]  # moved with its window
    lone = graft(base, Trace(events=[_send("r0", 0), _send("r1", 4)]), random.Random(0))
    assert not lone.resets


# -- the minimizer ------------------------------------------------------------------------------------

def test_the_minimizer_drops_a_reset_the_divergence_does_not_need():
    def bug(t):  # 'victim' diverges iff a reset of running requests came before it
        try:
            v = t.send("victim")
        except KeyError:
            return False
        return any(e.reset_running_requests and e.at.step <= v.at.step for e in t.resets)

    events = [_send("d0", 0), ResetPrefixCacheEvent(at=At(step=1)), _send("d1", 1),
              ResetPrefixCacheEvent(at=At(step=2), reset_running_requests=True), _send("victim", 3),
              ResetPrefixCacheEvent(at=At(step=9), reset_running_requests=True)]
    r = Minimizer(Target("corruption", "victim"), bug, Options(engine=False)).run(Trace(events=events))
    assert bug(r.trace) and [s.request_id for s in r.trace.sends] == ["victim"]
    assert len(r.trace.resets) == 1 and r.trace.resets[0].reset_running_requests
    assert any(p.startswith("lifecycle: 3 -> 1 events") for p in r.passes), r.passes


# -- coverage and the oracle -----------------------------------------------------------------------------

def _history(*, reset="done", preempted=("r0",), cached=64):
    return History(trace_id="t", engine="inprocess", events=[
        EventRecord(index=0, kind="send", request_id="r0", actual_step=0),
        EventRecord(index=1, kind="reset-prefix-cache", actual_step=3, reset=reset, effective=reset != "declined",
                    preempted=list(preempted)),
        EventRecord(index=2, kind="send", request_id="r1", actual_step=4)],
        requests={"r0": RequestRecord(request_id="r0", sent_step=0, finished_step=12, finish_reason="length",
                                      num_preemptions=1, token_ids=[5, 6, 7, 8]),
                  "r1": RequestRecord(request_id="r1", sent_step=4, finished_step=14, finish_reason="length",
                                      num_cached_tokens=cached, token_ids=[9, 9, 9])})


def test_coverage_says_how_a_reset_landed():
    t = _trace()
    sig = signature(_history(), t)
    assert {"reset:running:done", "reset:running:in-flight:1", "reset:preempted:1",
            "reset:after:cached:shares-prefix"} <= sig
    declined = signature(_history(reset="declined", preempted=(), cached=0), _trace(running=False))
    assert {"reset:plain:declined", "reset:plain:in-flight:1"} <= declined
    assert not any(b.startswith("reset:after") or b.startswith("reset:preempted") for b in declined)
    h = _history()
    h.events = [e for e in h.events if e.kind != "reset-prefix-cache"]
    assert not any(b.startswith("reset") for b in signature(h, t))


def test_the_oracle_needs_no_rule_for_a_reset_or_its_preemption():
    t = _trace()
    refs = {"r0": RequestRecord(request_id="r0", token_ids=[5, 6, 7, 8], finish_reason="length",
                                logprobs=[[(x, -0.1), (x + 1, -2.0)] for x in [5, 6, 7, 8]]),
            "r1": RequestRecord(request_id="r1", token_ids=[9, 9, 9, 9, 9, 9, 9, 9], finish_reason="length",
                                logprobs=[[(9, -0.1), (10, -2.0)]] * 8)}
    h = _history()
    h.requests["r1"].token_ids = [9] * 8
    for r, ref in zip(h.requests.values(), refs.values()):
        r.logprobs = list(ref.logprobs)
    h.requests["r0"].token_ids = [5, 6, 7, 8]
    t = t.model_copy(update={"events": [e.model_copy(update={"max_tokens": 4}) if e.kind == "send" and e.request_id == "r0"
                                        else e for e in t.events]})
    verdicts = check(t, [h], refs)
    assert {d.request_id: d.class_ for d in verdicts} == {"r0": "ok", "r1": "ok"}


# -- the report ------------------------------------------------------------------------------------------

def test_the_report_and_the_schedule_show_the_reset():
    from pathlib import Path

    from kvfuzz.present.data import schedule_data
    from kvfuzz.present.report import build, to_markdown
    from kvfuzz.traces import load_finding

    f = load_finding(Path(__file__).parent / "data" / "present" / "lora-base-minimized.json")
    data = f.trace.model_dump(mode="json")
    data["schema_version"] = 5
    data["events"].append({"kind": "reset-prefix-cache", "at": {"step": 2}, "reset_running_requests": True})
    trace = parse_trace(data)
    runs = []
    for h in f.runs:
        h = h.model_copy(deep=True)
        h.events.append(EventRecord(index=len(trace.events) - 1, kind="reset-prefix-cache", actual_step=2, reset="done",
                                    preempted=sorted(h.requests)[:1]))
        runs.append(h)
    f = f.model_copy(update={"trace": trace, "runs": runs})
    md = to_markdown(build(f))
    assert "| reset-prefix-cache | all running |" in md.replace("  ", " ")
    s = schedule_data(f)
    assert s is not None and any(ln.kind == "reset-prefix-cache" and ln.label.startswith("reset prefix cache + running")
                                 for ln in s.lines)


# -- over HTTP -------------------------------------------------------------------------------------------

class FakeResetServer:
    """vLLM's OpenAI server as far as resets go: POST /reset_prefix_cache (absent without dev mode)
    answers ``answer`` — 0.32's {"success": ...}, or an empty 200 as 0.25.0 does — or, to a reset
    with a query (the run's, not the clean slate's), ``run_answer``; its OpenAPI document declares
    ``params`` (None: no document); completions take ``delay_s``."""

    def __init__(self, *, route=True, params=("reset_running_requests", "reset_external"), answer=b'{"success": true}',
                 run_answer=None, delay_s=0.3):
        self.log: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        fake = self

        class H(JsonHandler):
            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"data": [{"id": "base", "root": "/m"}]})
                elif self.path == "/openapi.json" and params is not None:
                    route_doc = {"post": {"parameters": [{"name": p, "in": "query"} for p in params]}}
                    self._json(200, {"paths": {wire.RESET_PATH: route_doc} if route else {}})
                elif self.path == "/health":
                    self._json(200, {})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                u = urlsplit(self.path)
                if u.path == wire.RESET_PATH and route:
                    with fake.lock:
                        fake.log.append(("reset", parse_qs(u.query)))
                    data = run_answer if u.query and run_answer is not None else answer
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                elif u.path == "/v1/completions":
                    with fake.lock:
                        fake.log.append(("completion", {"prompt_len": len(body["prompt"])}))
                    self._complete(body, delay_s)
                else:
                    self._json(404, {"detail": "Not Found"})

        self.httpd, self.url = serve(H)

    def close(self):
        self.httpd.shutdown()


def _http_trace(running=True):
    return Trace(events=[_send("r0", 0, length=100), ResetPrefixCacheEvent(at=At(step=5, offset_ms=50.0),
                                                                           reset_running_requests=running),
                         _send("r1", 5, length=120)])


@pytest.mark.parametrize("answer,outcome", [(b'{"success": true}', "done"), (b'{"success": false}', "declined"),
                                            (b"", "unreported")])
def test_the_url_engine_posts_the_reset_in_plan_order_and_records_the_answer(answer, outcome):
    fake = FakeResetServer(run_answer=answer)
    try:
        eng = UrlEngine(EngineConfig(), fake.url).start()
        n0 = len(fake.log)
        h = eng.replay(_http_trace())
    finally:
        fake.close()
    run = fake.log[n0:]
    in_run = [q for k, q in run if k == "reset" and q]
    assert in_run == [{"reset_running_requests": ["true"]}]
    order = [k if k == "completion" else ("reset-run" if q else "reset-slate") for k, q in run]
    order = [k for k in order if k != "reset-slate"]
    assert order == ["completion", "reset-run", "completion"]  # r1 waits for the reset's answer
    (rec,) = [e for e in h.events if e.kind == "reset-prefix-cache"]
    assert rec.reset == outcome and rec.effective == (outcome != "declined") and rec.error is None
    assert rec.actual_offset_ms is not None and rec.actual_offset_ms >= 50.0 and rec.preempted is None
    assert not h.crashed and all(r.error is None for r in h.requests.values())


def test_a_plain_reset_sends_no_query():
    fake = FakeResetServer(params=())
    try:
        eng = UrlEngine(EngineConfig(), fake.url).start()
        n0 = len(fake.log)
        h = eng.replay(_http_trace(running=False))
    finally:
        fake.close()
    assert [k for k, _ in fake.log[n0:]].count("reset") == 2  # the clean slate's, the run's: both bare
    assert all(not q for k, q in fake.log[n0:] if k == "reset")
    assert [e.reset for e in h.events if e.kind == "reset-prefix-cache"] == ["done"]


def test_a_url_server_without_the_route_refuses_the_trace_naming_the_event():
    fake = FakeResetServer(route=False)
    try:
        eng = UrlEngine(EngineConfig(), fake.url).start()
        assert eng.reference_isolation == "cache_salt"
        with pytest.raises(BadInput) as ei:
            eng.replay(_http_trace())
    finally:
        fake.close()
    msg = str(ei.value)
    assert msg.startswith("events[1]: reset-prefix-cache needs POST /reset_prefix_cache: ") and "\n" not in msg
    assert "VLLM_SERVER_DEV_MODE=1" in msg and not [k for k, _ in fake.log if k == "completion" and _["prompt_len"] > 4]


def test_a_route_without_reset_running_requests_refuses_only_the_resets_that_ask_for_it():
    fake = FakeResetServer(params=("reset_external",))
    try:
        eng = UrlEngine(EngineConfig(), fake.url).start()
        with pytest.raises(BadInput) as ei:
            eng.replay(_http_trace(running=True))
        h = eng.replay(_http_trace(running=False))
    finally:
        fake.close()
    msg = str(ei.value)
    assert msg.startswith("events[1].reset_running_requests: ") and "takes no reset_running_requests" in msg, msg
    assert [e.reset for e in h.events if e.kind == "reset-prefix-cache"] == ["done"]
    no_doc = FakeResetServer(params=None)  # no OpenAPI document: taken at its word
    try:
        h = UrlEngine(EngineConfig(), no_doc.url).start().replay(_http_trace(running=True))
    finally:
        no_doc.close()
    assert [e.reset for e in h.events if e.kind == "reset-prefix-cache"] == ["done"]


def test_the_wire_format_of_a_reset():
    assert wire.reset_query() == {} and wire.reset_query(reset_running_requests=True) == {"reset_running_requests": "true"}
    assert wire.reset_answer(200, b'{"success": true}') == "done"
    assert wire.reset_answer(200, b'{"success": false}') == "declined"
    assert wire.reset_answer(200, b"") == "unreported" and wire.reset_answer(200, b"OK") == "unreported"
    assert wire.reset_answer(404, b'{"detail": "Not Found"}') is None


def test_every_release_the_in_process_engine_drives_can_reset_running_requests():
    """In-process a reset calls LLMEngine.reset_prefix_cache(reset_running_requests=...): the
    release check refuses (exit 2, before the engine starts) any vLLM whose signature lacks it
    (harness/compat.py; 0.25.0-0.32.0 have it, docs/releases.md)."""
    from kvfuzz.harness.compat import INPROCESS_NEEDS

    assert ("vllm.v1.engine.llm_engine", "LLMEngine.reset_prefix_cache",
            ("self", "reset_running_requests", "reset_connector")) in INPROCESS_NEEDS
