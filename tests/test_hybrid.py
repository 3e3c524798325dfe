"""Fast tests of the hybrid-model pieces (no vLLM): the embedded hybrid build, the
``kv_connector`` engine setting and how it reaches vLLM, and the #44409 regression trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvfuzz.harness import embedded
from kvfuzz.harness.vllm_args import engine_args, server_command
from kvfuzz.traces import EMBEDDED_HYBRID, EngineConfig, LoraSettings, Trace, load_trace
from kvfuzz.traces.errors import BadInput

CORPUS = Path(__file__).resolve().parent.parent / "traces" / "regressions"
REGRESSION = CORPUS / "vllm-44409-cross-group-external.json"


def test_hybrid_build_is_deterministic_and_pinned(tmp_path):
    a = embedded.build_hybrid(tmp_path / "a")
    b = embedded.build_hybrid(tmp_path / "b")
    assert a.content_hash == b.content_hash == embedded.HYBRID_EXPECTED_HASH
    assert a.adapters == {}
    assert embedded.content_hash(a.root) == a.content_hash
    # The default is unchanged by the hybrid's existence.
    assert embedded.build(tmp_path / "d").content_hash == embedded.EXPECTED_HASH != a.content_hash


def test_hybrid_config_full_attention_first_with_a_window():
    cfg = embedded._hybrid_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    # Group order follows the first layer; the fault of vllm#44409 needs full attention first.
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"]
    assert cfg["sliding_window"] == 128 and cfg["sliding_window"] % 32 == 0
    assert cfg["initializer_range"] == 0.2 and cfg["hidden_size"] // cfg["num_attention_heads"] == 64


def test_hybrid_model_resolves_and_refuses_lora(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFUZZ_CACHE", str(tmp_path))
    r = embedded.resolve_model(EngineConfig(model=EMBEDDED_HYBRID))
    assert r.model_hash == embedded.HYBRID_EXPECTED_HASH and r.adapter_paths == {}
    with pytest.raises(BadInput) as e:
        embedded.resolve_model(EngineConfig(model=EMBEDDED_HYBRID, lora=LoraSettings(enabled=True)))
    assert e.value.field == "engine.lora.enabled"
    with pytest.raises(BadInput, match="tiny-hybrid"):
        embedded.resolve_model(EngineConfig(model="embedded:nope"))


def test_kv_connector_setting_is_optional_and_invisible_when_unset():
    plain = EngineConfig()
    assert "kv_connector" not in plain.model_dump(mode="json")
    # An old trace (no such field) loads unchanged and keeps its ids and reference key.
    old = Trace.model_validate({"engine": {"max_model_len": 4096}})
    assert old.engine.kv_connector is None
    assert old.model_dump(mode="json") == Trace.model_validate(old.model_dump(mode="json")).model_dump(mode="json")
    on = plain.model_copy(update={"kv_connector": "kvfuzz-store"})
    assert on.key() != plain.key()
    assert EngineConfig.model_validate(on.model_dump(mode="json")).kv_connector == "kvfuzz-store"


def test_kv_connector_bad_values_name_the_field():
    with pytest.raises(ValidationError) as e:
        EngineConfig(kv_connector="OffloadingConnector")
    assert e.value.errors()[0]["loc"] == ("kv_connector",)
    with pytest.raises(ValidationError, match="kv_connector"):
        EngineConfig(kv_connector="kvfuzz-store", lora=LoraSettings(enabled=True))


def test_kv_connector_reaches_inprocess_and_server_alike():
    cfg = EngineConfig(model=EMBEDDED_HYBRID, kv_connector="kvfuzz-store")
    ktc = engine_args(cfg, "/m")["kv_transfer_config"]
    assert ktc == {"kv_connector": "HMAStoreConnector", "kv_connector_module_path": "kvfuzz.harness.kv_connector",
                   "kv_role": "kv_both"}
    cmd = server_command(cfg, model_path="/m", adapter_paths={}, port=8000)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == ktc
    assert "kv_transfer_config" not in engine_args(EngineConfig(), "/m")


def test_44409_regression_pins_its_engine():
    t = load_trace(REGRESSION)
    e = t.engine
    assert e.model == EMBEDDED_HYBRID and e.kv_connector == "kvfuzz-store"
    # The block count, not the bytes, fixes the free-queue positions (same in bfloat16).
    assert e.extra_args["num_gpu_blocks_override"] == 127
    assert e.extra_args["prefix_cache_retention_interval"] == 32
    assert t.expect is not None and t.expect.fails_in == ["with:fault-cross-group-one-phase"]
    # R shares S+T with B (external tokens) and S with A2 (local hit), with a tail of its own.
    by = {s.request_id: s.prompt for s in t.sends}
    assert by["R"].prefix_group == by["B"].prefix_group == by["A2"].prefix_group
    assert by["R"].prefix_len == by["B"].prefix_len == 192 and by["A2"].prefix_len == 128
    assert by["R"].seed != by["B"].seed


# -- coverage of the hybrid and external-KV paths ---------------------------------------------------


def test_hybrid_coverage_buckets_from_steps():
    from kvfuzz.fuzzer.feedback import signature
    from kvfuzz.traces import History, StepRecord

    steps = [StepRecord(step=0, group_hits=[4, 2], kv_usage=0.3),
             StepRecord(step=1, group_hits=[4, 2], external_tokens=64, waiting=1, kv_usage=0.92),
             StepRecord(step=2, external_tokens=96, group_hits=[0, 0], kv_usage=0.5, cross_group_shared=1)]
    sig = signature(History(trace_id="t", engine="inprocess", steps=steps))
    assert {"group-hits:g0:8-15", "group-hits:g1:4-7", "ext-tokens:4-7", "ext-admissions:2", "ext:with-local-hits",
            "ext:pressure:kv90/wait", "groups:block-in-two-groups"} <= sig
    # The same run on a one-group model without a connector adds none of them.
    plain = [s.model_copy(update={"group_hits": [s.group_hits[0]], "external_tokens": 0, "cross_group_shared": 0})
             for s in steps]
    sig = signature(History(trace_id="t", engine="inprocess", steps=plain))
    assert not {b for b in sig if b.startswith(("group-hits", "ext", "groups:"))}


def test_server_external_tokens_from_metrics():
    from kvfuzz.fuzzer.feedback import signature
    from kvfuzz.harness.metrics import summarize
    from kvfuzz.traces import History

    after = summarize('vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 160.0\n')
    h = History(trace_id="t", engine="server", metrics_before={"vllm:external_prefix_cache_hits_total": 32.0},
                metrics_after=after)
    assert "ext-tokens:4-7" in signature(h)


# -- generator shapes for the hybrid model -----------------------------------------------------------


def test_cross_group_return_sizes_its_fillers_from_the_block_count():
    import random

    from kvfuzz.fuzzer.hybrid import cross_group_return, hybrid_engine

    eng = hybrid_engine()
    seen = set()
    for seed in range(60):
        events, end = cross_group_return(eng, random.Random(seed), 0)
        by = {e.request_id: e for e in events}
        L = by["xA"].prompt.prefix_len // 32
        e = by["xB"].prompt.prefix_len // 32 - L
        seen.add((L, e))
        assert L * 32 > 128 - 32 and 1 <= e <= 3  # S covers the window; the window still holds a hit at L+e
        assert by["xR"].prompt.prefix_group == by["xB"].prompt.prefix_group == by["xQ"].prompt.prefix_group
        assert by["xR"].prompt.prefix_len == by["xB"].prompt.prefix_len and by["xR"].prompt.seed != by["xB"].prompt.seed
        fillers = [x for x in events if x.request_id.startswith("xH")]
        assert all((f.prompt.length + 1) % 32 == 0 and f.at.step == 14 for f in fillers)
        k = 126 - (L + 7) - 5 - 4  # S[L-1]'s place in the free queue when A2 is done
        assert sum((f.prompt.length + 1) // 32 for f in fillers) * 2 == k - k % 2
        assert k % 2 == 0 or e >= 2
        assert sum(f.prompt.length for f in fillers) <= eng.max_num_batched_tokens  # one prefill step
        assert by["xR"].at.step == 15 and end == 16
        assert all(x.prompt.length + x.max_tokens <= eng.max_model_len for x in events)
    assert len(seen) >= 6
    assert cross_group_return(EngineConfig(), random.Random(0), 0) is None  # the default model: no shape


def test_generated_hybrid_traces_carry_the_shapes_and_default_traces_do_not():
    from kvfuzz.fuzzer import default_engine, generate
    from kvfuzz.fuzzer.hybrid import hybrid_engine

    eng = hybrid_engine()
    cross = returns = 0
    for seed in range(40):
        t = generate(seed, eng)
        ids = {s.request_id for s in t.sends}
        if "xR" in ids:
            cross += 1
            r = t.send("xR").at.step
            # The recipe runs on an idle engine: nothing else is sent before R is admitted.
            assert all(s.at.step > r or s.request_id.startswith("x") for s in t.sends)
        if any(i.startswith("hfirst") for i in ids):
            returns += 1
            first = next(s for s in t.sends if s.request_id.startswith("hfirst"))
            assert first.prompt.prefix_len > 128
            back = [s for s in t.sends if s.request_id.startswith(f"{first.request_id}_back")]
            assert back and all(s.prompt.prefix_group == first.prompt.prefix_group for s in back)
    assert 4 <= cross <= 20 and 4 <= returns <= 25
    for seed in range(20):
        ids = {s.request_id for s in generate(seed, default_engine()).sends}
        assert not any(i.startswith(("xR", "hfirst")) for i in ids)
