"""Per-request state in the trace format, the oracle's contract for it and its generation (pure;
the real engine's side is tests/test_request_state_engine.py)."""

import json

import pytest
from hypothesis import given, settings

from kvfuzz.fuzzer.feedback import signature
from kvfuzz.fuzzer.generate import GENERATOR, GenOptions, default_engine, generate
from kvfuzz.fuzzer.requests import dress
from kvfuzz.harness.refstore import complete, sampling_key
from kvfuzz.harness.vllm_args import engine_args, request_fields
from kvfuzz.oracle import NoiseBounds, check
from kvfuzz.strategies import samplings, traces
from kvfuzz.traces import (At, BadInput, GenPrompt, History, RequestRecord, Sampling, SendEvent, StepRecord, Trace,
                           parse_trace)
from kvfuzz.traces.io import load_trace
from kvfuzz.gate.gate import bundled_corpus

FP32 = NoiseBounds(dtype="float32", near_tie=1e-3, drift=1e-3, teacher=1e-3)


def send(rid="r0", **kw):
    return SendEvent(request_id=rid, at=At(step=0), prompt=GenPrompt(length=8, seed=1), max_tokens=4, **kw)


def rec(rid, tokens, finish="length", **kw):
    lps = [[(t, -0.1), (t + 1, -2.0)] for t in tokens]
    return RequestRecord(request_id=rid, token_ids=list(tokens), logprobs=lps, finish_reason=finish, **kw)


def hist(*records):
    return History(trace_id="t", engine="inprocess", requests={r.request_id: r for r in records})


# -- format ------------------------------------------------------------------------------------

def test_a_plain_send_writes_no_new_field_and_keeps_its_trace_id():
    for f in sorted(bundled_corpus().glob("*.json")):
        data = json.loads(f.read_text())
        t = load_trace(f)
        if any(s.per_request_fields for s in t.sends):
            continue  # a trace of the new fields (schema 3 only)
        assert t.trace_id() == Trace.model_validate({**data, "schema_version": 2}).trace_id(), f.name
        dumped = t.model_dump(mode="json")
        assert all("sampling" not in e and "priority" not in e for e in dumped["events"])
        assert "scheduling_policy" not in dumped["engine"]


def test_set_fields_round_trip_and_defaults_are_not_written():
    s = Sampling(allowed_token_ids=[5, 9], logit_bias={1: 4.5}, stop=["<t9>"], ignore_eos=False, n=3)
    t = Trace(engine=default_engine(scheduling_policy="priority"), events=[send(sampling=s, priority=2)])
    data = t.model_dump(mode="json")
    assert data["events"][0]["sampling"] == {"allowed_token_ids": [5, 9], "logit_bias": {"1": 4.5},
                                             "stop": ["<t9>"], "ignore_eos": False, "n": 3}
    assert parse_trace(json.loads(t.model_dump_json())) == t
    assert s.fields_set() == ["allowed_token_ids", "logit_bias", "stop", "ignore_eos", "n"]
    assert send(sampling=s).completion_ids == ["r0", "r0#1", "r0#2"]


@pytest.mark.parametrize("event,engine,needle", [
    ({"sampling": {"min_tokens": 9}}, {}, "min_tokens 9 exceeds max_tokens 4"),
    ({"priority": 1}, {}, "events[0].priority: needs engine.scheduling_policy"),
    ({"sampling": {"n": 99}}, {}, "events.0.send.sampling.n"),
    ({"sampling": {"logit_bias": {"7": 500}}}, {}, "logit_bias"),
    ({"sampling": {"repetition_penalty": 0}}, {}, "repetition_penalty"),
    ({}, {"scheduling_policy": "lottery"}, "engine.scheduling_policy"),
])
def test_bad_values_name_the_event_and_field(event, engine, needle):
    data = Trace(events=[send()]).model_dump(mode="json")
    data["events"][0].update(event)
    data["engine"].update(engine)
    with pytest.raises(BadInput) as ei:
        parse_trace(data)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_older_schemas_cannot_carry_the_new_fields():
    data = Trace(events=[send(sampling=Sampling(n=2))]).model_dump(mode="json")
    data["schema_version"] = 2
    with pytest.raises(BadInput, match=r"events\[0\]\.n: needs schema_version 3"):
        parse_trace(data)


# -- what reaches vLLM -------------------------------------------------------------------------

def test_request_fields_use_vllms_names_and_keep_children_greedy():
    assert request_fields(Sampling()) == {"temperature": 0.0, "ignore_eos": True}
    got = request_fields(Sampling(min_tokens=2, ignore_eos=False, stop_token_ids=[7], presence_penalty=0.5))
    assert got == {"temperature": 0.0, "ignore_eos": False, "min_tokens": 2, "stop_token_ids": [7],
                   "presence_penalty": 0.5}
    # vLLM refuses n > 1 at temperature 0: top_k 1 is the same choice through the random sampler.
    assert request_fields(Sampling(n=3)) == {"temperature": 1.0, "top_k": 1, "ignore_eos": True, "n": 3}
    assert engine_args(default_engine(scheduling_policy="priority"), "m")["scheduling_policy"] == "priority"
    assert "scheduling_policy" not in engine_args(default_engine(), "m")


def test_the_reference_key_holds_what_changes_a_solo_output_and_nothing_else():
    assert sampling_key(send()) == "greedy"  # every reference stored before the fields existed
    assert sampling_key(send(sampling=Sampling(n=4))) == "greedy"
    s = Sampling(allowed_token_ids=[3, 4])
    assert sampling_key(send(sampling=s)) == {"allowed_token_ids": [3, 4]}
    assert sampling_key(send(sampling=s.model_copy(update={"n": 2}))) == sampling_key(send(sampling=s))
    alone = send(sampling=Sampling(n=3, min_tokens=2)).alone()
    assert alone.sampling.n == 1 and alone.sampling.min_tokens == 2 and alone.priority == 0
    # A reference that stopped serves any longer request; one cut at its budget does not.
    assert complete(rec("r0", [5, 1], finish="stop"), 16) and not complete(rec("r0", [5, 1]), 16)


# -- the oracle's contract -------------------------------------------------------------------------

def test_every_child_of_n_is_judged_by_the_one_reference():
    t = Trace(events=[send(sampling=Sampling(n=3))])
    ref = rec("r0", [4, 5, 6, 7])
    runs = [hist(rec("r0", [4, 5, 6, 7]), rec("r0#1", [4, 5, 6, 7]), rec("r0#2", [4, 5, 9, 7]))]
    v = {d.request_id: d for d in check(t, runs, {"r0": ref}, FP32)}
    assert sorted(v) == ["r0", "r0#1", "r0#2"]
    assert v["r0"].class_ == "ok" and v["r0#1"].class_ == "ok"
    assert v["r0#2"].class_ == "corruption" and v["r0#2"].first_divergence == 2


def test_a_run_that_goes_on_where_its_reference_stopped_broke_a_stop_rule():
    t = Trace(events=[send(sampling=Sampling(stop_token_ids=[6]))])
    ref = rec("r0", [4, 6], finish="stop")
    (v,) = check(t, [hist(rec("r0", [4, 6, 8, 9]))], {"r0": ref}, FP32)
    assert v.class_ == "corruption" and v.first_divergence == 2 and v.evidence == ["stop"]
    (ok,) = check(t, [hist(rec("r0", [4, 6], finish="stop"))], {"r0": ref}, FP32)
    assert ok.class_ == "ok"
    # A reference cut short for another reason vouches for its common part only, as before.
    (same,) = check(t, [hist(rec("r0", [4, 6, 8, 9]))], {"r0": rec("r0", [4, 6])}, FP32)
    assert same.class_ == "ok"


def test_prompt_logprobs_are_judged_against_the_reference_s():
    t = Trace(events=[send(sampling=Sampling(prompt_logprobs=1))])
    prompt = [[(9, -1.0), (3, -2.0)], [(4, -0.5), (7, -3.0)]]
    moved = [[(9, -1.0), (3, -2.0)], [(4, -0.5 - 0.8), (7, -1.0)]]
    ref = rec("r0", [4, 5, 6, 7], prompt_logprobs=prompt)
    (ok,) = check(t, [hist(rec("r0", [4, 5, 6, 7], prompt_logprobs=[[(9, -1.0 + 1e-4), (3, -2.0)], prompt[1]]))],
                  {"r0": ref}, FP32)
    assert ok.class_ == "ok"
    # The same tokens after a prompt whose logprobs are not the reference's: corruption.
    (v,) = check(t, [hist(rec("r0", [4, 5, 6, 7], prompt_logprobs=moved))], {"r0": ref}, FP32)
    assert v.class_ == "corruption" and v.evidence == ["prompt"] and "prompt position 2" in (v.detail or "")
    # A cancelled run is truncation, unless its prompt logprobs already were wrong.
    cut = rec("r0", [4, 5], finish="abort", cancelled=True, prompt_logprobs=moved)
    (c,) = check(t, [hist(cut)], {"r0": ref}, FP32)
    assert c.class_ == "corruption" and c.evidence == ["prompt"]
    # A differing token with a wrong prompt names both.
    (d,) = check(t, [hist(rec("r0", [4, 9, 6, 7], prompt_logprobs=moved))], {"r0": ref}, FP32)
    assert d.class_ == "corruption" and "prompt" in d.evidence
    # A stored reference without them does not answer a request that asks.
    assert not complete(rec("r0", [4, 5, 6, 7]), 4, prompt_logprobs=True)
    assert complete(ref, 4, prompt_logprobs=True)


# -- generation ------------------------------------------------------------------------------------

def test_a_default_campaign_covers_the_fields_in_a_share_of_its_requests():
    sends = [s for seed in range(100) for s in generate(seed).sends]
    used = [s for s in sends if s.per_request_fields]
    assert len(used) >= 0.3 * len(sends)
    fields = {f for s in used for f in s.per_request_fields}
    assert fields >= {"allowed_token_ids", "logit_bias", "ignore_eos", "min_tokens", "stop", "stop_token_ids",
                      "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "prompt_logprobs", "bad_words",
                      "priority", "embeds"}
    finishes = {("eos" if not s.sampling.ignore_eos else "length") for s in used}
    assert finishes == {"eos", "length"}
    # A retry keeps the state of the request it retries, as a client's would.
    for seed in range(100):
        t = generate(seed)
        for s in t.sends:
            if "_retry" in s.request_id:
                assert s.sampling == t.send(s.request_id.split("_retry")[0]).sampling


def test_the_state_is_drawn_apart_from_the_schedule():
    plain = generate(7, opts=GenOptions(request_state=0.0, p_priority=0.0, p_embeds=0.0, p_spec=0.0, p_reset=0.0))
    dressed = generate(7)
    assert plain.lineage.generator == "random-v2" and dressed.lineage.generator == GENERATOR
    strip = [s.model_copy(update={"sampling": Sampling(), "priority": 0, "embeds": None}) for s in dressed.sends]
    assert [s.model_dump() for s in strip] == [s.model_dump() for s in plain.sends]
    events, engine = dress(plain.events, 7, plain.engine, share=1.0, p_priority=1.0, p_embeds=1.0)
    assert engine.scheduling_policy == "priority" and engine.enable_prompt_embeds
    assert any(e.embeds is not None for e in events if isinstance(e, SendEvent))
    # Speculative decoding has its own stream: a trace that draws it keeps every other draw's
    # schedule, and its sends carry no logit bias (vLLM refuses the pair), most a few allowed tokens.
    assert all(e.per_request_fields for e in events if isinstance(e, SendEvent))
    spec_events, spec = dress(plain.events, 7, plain.engine, share=0.4, p_priority=0.0, p_spec=1.0)
    sends = [e for e in spec_events if isinstance(e, SendEvent)]
    assert spec.speculative is not None and not any(s.sampling.logit_bias for s in sends)
    assert sum(bool(s.sampling.allowed_token_ids) for s in sends) >= len(sends) // 3
    Trace(engine=spec, events=spec_events)  # valid


@settings(max_examples=60, deadline=None)
@given(traces(max_tokens=(2, 8)))
def test_the_strategies_draw_valid_traces_with_state(t):
    for s in t.sends:
        assert s.sampling.min_tokens <= s.max_tokens
        assert s.priority == 0 or t.engine.scheduling_policy == "priority"
    assert parse_trace(json.loads(t.model_dump_json())) == t


@settings(max_examples=30, deadline=None)
@given(samplings(max_tokens=4))
def test_samplings_keep_to_vllms_bounds(s):
    assert 1 <= s.n <= 4 and s.min_tokens <= 4
    assert Sampling.model_validate(s.model_dump(mode="json")) == s


def test_coverage_counts_fields_finishes_and_row_moves():
    t = Trace(engine=default_engine(scheduling_policy="priority"),
              events=[send("a", sampling=Sampling(n=2, ignore_eos=False)), send("b", priority=1)])
    h = hist(rec("a", [4, 1], finish="stop"), rec("a#1", [4], cancelled=True, finish="abort"), rec("b", [5, 6, 7, 8]))
    h.steps = [StepRecord(step=0, preempted=["b"]), StepRecord(step=1, rows_moved=["b"], rows_reused=1)]
    sig = signature(h, t)
    assert {"field:n", "field:ignore_eos", "field:priority", "finish:stop/state", "finish:abort/state",
            "finish:length/state", "finishes-stop:1", "rows-moved:1", "rows-reused:1", "row-move:state",
            "preempt:priority", "n-cancelled"} <= sig
    plain = Trace(events=[send("a")])
    assert "finish:length/plain" in signature(hist(rec("a", [4, 5, 6, 7])), plain)


def test_embeddings_are_referenced_as_ids_only_when_they_mean_the_ids():
    from kvfuzz.traces import PromptEmbeds

    own, perturbed = PromptEmbeds(), PromptEmbeds(perturbed=[2])
    assert send(embeds=own).alone().embeds is None
    assert send(embeds=perturbed).alone().embeds == perturbed
    # The repetition penalty counts the prompt's ids, which embeddings do not carry.
    assert send(embeds=own, sampling=Sampling(repetition_penalty=1.2)).alone().embeds == own
    assert send(embeds=own, sampling=Sampling(presence_penalty=1.0)).alone().embeds is None
    assert sampling_key(send(embeds=perturbed)) == {"sampling": "greedy", "embeds": perturbed.model_dump(mode="json")}
    # An edited prompt keeps its embeddings within it.
    edited = send(embeds=PromptEmbeds(perturbed=[1, 7], as_ids=[(0, 6)])).model_copy(
        update={"prompt": GenPrompt(length=5, seed=1)}).fitted()
    assert edited.embeds is not None and edited.embeds.perturbed == [1] and edited.embeds.as_ids == [(0, 5)]


# -- prompt embeddings over HTTP ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvfuzz.harness import embedded

    return str(embedded.build(tmp_path_factory.mktemp("model")).model_dir)


def _decoded(body):
    import base64
    import io

    import torch

    return torch.load(io.BytesIO(base64.b64decode(body["prompt_embeds"], validate=True)), weights_only=True)


def test_embeddings_go_over_http_as_the_in_process_tensor(tiny_model):
    import torch

    from kvfuzz.harness.embedded import embedding_table, prompt_embeddings
    from kvfuzz.harness.http import wire
    from kvfuzz.traces import PromptEmbeds, expand

    for spec in (PromptEmbeds(), PromptEmbeds(perturbed=[0, 5], scale=2.0, seed=3)):
        s = send(embeds=spec)
        body = wire.completion_payload(s, "m", stream=True, embeds_model=tiny_model)
        # The embeddings alone: vLLM would take a `prompt` beside them as a second prompt.
        assert "prompt" not in body and body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
        got = _decoded(body)
        assert got.dtype == torch.float32 and got.shape == (8, 128)
        assert torch.equal(got, prompt_embeddings(tiny_model, expand(s.prompt), spec))
        rows = embedding_table(tiny_model)[torch.tensor(expand(s.prompt))]
        assert torch.equal(got, rows) == spec.own_rows
    # The record of a send does not depend on its prompt's form.
    assert wire.completion_payload(send(), "m", stream=True)["prompt"] == expand(send().prompt)


def test_embeddings_http_cannot_carry_are_refused_in_one_line_naming_the_field(tiny_model):
    from kvfuzz.harness.http import wire
    from kvfuzz.traces import PromptEmbeds

    cases = [(send(embeds=PromptEmbeds(as_ids=[(0, 4)])), tiny_model, "events[r0].embeds.as_ids"),
             (send(embeds=PromptEmbeds(), sampling=Sampling(prompt_logprobs=1)), tiny_model,
              "events[r0].sampling.prompt_logprobs"),
             (send(embeds=PromptEmbeds()), None, "events[r0].embeds")]
    for s, model, field in cases:
        with pytest.raises(BadInput) as ei:
            wire.completion_payload(s, "m", stream=False, embeds_model=model)
        assert ei.value.field == field and str(ei.value).startswith(field + ": ")
        assert "\n" not in str(ei.value) and "in-process" in str(ei.value)


def test_the_replay_builds_embeddings_from_the_engines_model(tiny_model, monkeypatch, tmp_path):
    """The managed server embeds with the table of the directory it loaded; a URL only with the
    embedded default's (built here, deterministically); any other model is refused."""
    from kvfuzz.harness import embedded
    from kvfuzz.harness.http.replay import Replayer
    from kvfuzz.harness.http.wire import HttpTarget
    from kvfuzz.harness.server import ServerEngine
    from kvfuzz.harness.url import UrlEngine
    from kvfuzz.traces import PromptEmbeds

    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path))
    engine = default_engine(enable_prompt_embeds=True)
    t = Trace(engine=engine, events=[send("ids"), send("e", embeds=PromptEmbeds(perturbed=[2]))])
    local = str(embedded.build().model_dir)
    assert ServerEngine(engine)._embeds_model(t, t.send("e")) == local
    assert UrlEngine(engine, "http://127.0.0.1:9")._embeds_model(t, t.send("e")) == local
    other = t.model_copy(update={"engine": engine.model_copy(update={"model": "Qwen/Qwen2.5-0.5B"})})
    with pytest.raises(BadInput) as ei:
        UrlEngine(engine, "http://127.0.0.1:9")._embeds_model(other, other.send("e"))
    assert ei.value.field == "events[e].embeds" and "Qwen/Qwen2.5-0.5B" in str(ei.value)
    assert "\n" not in str(ei.value)
    # The replay's request bytes carry them, built before the clock starts.
    rep = Replayer(HttpTarget("http://127.0.0.1:9", "m"), t, engine="server", arm="a", run_index=0, toggles=[],
                   cache_salt=None, timeout_s=1.0, lead_ms=0.0, embeds_model=tiny_model)
    rep.plan()
    bodies = {rid: json.loads(r.wire.partition(b"\r\n\r\n")[2]) for rid, r in rep.reqs.items()}
    assert "prompt" in bodies["ids"] and "prompt_embeds" not in bodies["ids"]
    assert "prompt_embeds" in bodies["e"] and "prompt" not in bodies["e"]


def test_an_engine_with_prompt_embeds_starts_its_server_with_the_flag():
    from kvfuzz.harness.vllm_args import server_command

    def cmd(**kw):
        return server_command(default_engine(**kw), model_path="/m", adapter_paths={}, port=9000,
                              launcher=("python", "-m", "vllm.entrypoints.openai.api_server"))

    assert "--enable-prompt-embeds" in cmd(enable_prompt_embeds=True)
    assert not any("prompt-embeds" in f for f in cmd())


def test_a_streamed_send_asks_only_for_what_vllm_streams_of_prompt_logprobs():
    from kvfuzz.harness.http.wire import completion_payload

    s = send(sampling=Sampling(prompt_logprobs=2))
    assert completion_payload(s, "m", stream=False)["prompt_logprobs"] == 2
    assert completion_payload(s, "m", stream=True)["prompt_logprobs"] == 0
    assert "prompt_logprobs" not in completion_payload(send(), "m", stream=True)


def test_a_replay_may_stop_where_a_flip_is_corruption_whatever_the_run_records():
    from kvfuzz.oracle.check import stop_at_flip

    ref = RequestRecord(request_id="r0", token_ids=[4, 5, 6, 7], finish_reason="length",
                        logprobs=[[(4, -0.1), (9, -3.0)], [(5, -0.1), (8, -0.1005)], [(6, -0.1)], [(7, -0.2), (3, -2.0)]])
    stop = stop_at_flip(send(), "r0", ref, FP32)
    # Margins 2.9 and 1.8 decide; a near tie (5e-4 < 1e-3) does not; an unknown margin does.
    assert stop.decided == [True, False, True, True] and not stop.stopped
    assert not stop.reached([4, 5, 6]) and not stop.reached([4, 8, 9, 9]) and stop.reached([4, 5, 3])
    assert stop.reached([9]) and not stop.reached([])
    ended = stop_at_flip(send(), "r0", ref.model_copy(update={"token_ids": [4, 5], "finish_reason": "stop"}), FP32)
    assert ended.stopped and not ended.reached([4, 5]) and ended.reached([4, 5, 6])
    # Every token masked (vLLM's NaN logprobs): no margin calls a flip there noise.
    nan = float("nan")
    masked = ref.model_copy(update={"logprobs": [ref.logprobs[0], [(5, nan), (8, nan)], *ref.logprobs[2:]]})
    assert stop_at_flip(send(), "r0", masked, FP32).decided == [True, True, True, True]
