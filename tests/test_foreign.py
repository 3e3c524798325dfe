"""The foreign finding format (the fuzzer behind vLLM #39146/#38606/#39589): conversion
semantics of its third-party replayer, and one-line errors for bad files. No engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuzz.traces import CancelEvent, GenPrompt, SendEvent, expand, load_any
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.foreign import PROMPT_NOTE, ForeignFinding, normalize_flags, parse_foreign

FIXTURE = Path(__file__).parent / "data" / "foreign_finding_00030.json"


def send(rid, offset, prompt_len=64, prefix_len=0, **kw):
    return {"action": "send", "request_id": rid, "offset_ms": offset, "prompt_len": prompt_len,
            "prefix_len": prefix_len, **kw}


def cancel(rid, offset):
    return {"action": "cancel", "request_id": rid, "offset_ms": offset}


def doc(*events, **top):
    return {"trace": {"events": list(events)}, **top}


def test_fixture_loads_as_foreign_finding():
    f = load_any(FIXTURE)
    assert isinstance(f, ForeignFinding)
    assert f.expected_diverged == [f"r{k:02d}_retry" for k in range(1, 6)] and f.evidence_key == "kv_corruption"
    t = f.trace
    assert len(t.sends) == 10 and len(t.cancels) == 5
    assert all(s.max_tokens == 128 and s.stream for s in t.sends)
    # Cancels land mid-generation of r01..r05; retries come 60 ms after each cancel.
    for k in range(1, 6):
        c = next(e for e in t.cancels if e.request_id == f"r{k:02d}")
        retry = t.send(f"r{k:02d}_retry")
        assert retry.at.offset_ms - c.at.offset_ms == 60
    assert t.engine.enable_prefix_caching is False  # --no-enable-prefix-caching applied
    assert f.applied_flags["enable_prefix_caching"] is False
    assert any("gpu_memory_utilization" in x for x in f.ignored_flags)
    assert PROMPT_NOTE in f.notes and "prompt content differs from the original" in PROMPT_NOTE
    assert t.notes["foreign"]["expected_diverged"] == f.expected_diverged


def test_later_send_of_a_duplicate_id_wins():
    f = parse_foreign(doc(send("r1", 50, prompt_len=100), send("r2", 10), send("r1", 20, prompt_len=300)))
    s = f.trace.send("r1")
    # Sorted by offset the send at 50 ms comes last: it wins even though it is first in the file.
    assert s.at.offset_ms == 50 and s.prompt.length == 100
    assert [e.request_id for e in f.trace.sends] == ["r2", "r1"]
    assert any("sent twice" in n for n in f.notes)


def test_cancels_only_after_their_send_and_last_one_wins():
    f = parse_foreign(doc(send("a", 100), send("b", 0), send("c", 0), cancel("a", 50), cancel("b", 30),
                          cancel("b", 80), cancel("ghost", 5), cancel("c", 0)))
    cancels = {c.request_id: c.at.offset_ms for c in f.trace.cancels}
    assert cancels == {"b": 80.0}  # a: before its send; c: same instant; ghost: never sent
    assert sum("dropped" in n for n in f.notes) == 3


def test_defaults_max_tokens_64_and_stream():
    f = parse_foreign(doc(send("a", 0), send("b", 1, max_tokens=None), send("c", 2, max_tokens=0),
                          send("d", 3, max_tokens=8, stream=False)))
    assert [s.max_tokens for s in f.trace.sends] == [64, 64, 64, 8]
    assert [s.stream for s in f.trace.sends] == [True, True, True, False]


def test_prompts_share_prefix_by_prefix_len_and_are_deterministic():
    d = doc(send("a", 0, prompt_len=300, prefix_len=128), send("b", 1, prompt_len=200, prefix_len=128),
            send("c", 2, prompt_len=300, prefix_len=64), send("d", 3, prompt_len=50))
    f1, f2 = parse_foreign(d), parse_foreign(json.loads(json.dumps(d)))
    toks = {s.request_id: expand(s.prompt) for s in f1.trace.sends}
    assert toks["a"][:128] == toks["b"][:128] and toks["a"][128:200] != toks["b"][128:]
    assert toks["c"][:64] != toks["a"][:64]  # another prefix_len, another prefix
    assert [len(toks[k]) for k in "abcd"] == [300, 200, 300, 50]
    assert toks == {s.request_id: expand(s.prompt) for s in f2.trace.sends}
    assert isinstance(f1.trace.send("d").prompt, GenPrompt) and f1.trace.send("d").prompt.prefix_len == 0


def test_adapters_map_to_embedded_ones():
    f = parse_foreign(doc(send("r1", 0), send("t1", 8, adapter="lora_a"), send("t2", 16, adapter="lora_b"),
                          send("t3", 24, adapter="lora_a")))
    assert f.adapter_map == {"lora_a": "a", "lora_b": "b"}
    lora = f.trace.engine.lora
    assert lora.enabled and lora.adapters == {"lora_a": "embedded:a", "lora_b": "embedded:b"}
    assert f.trace.send("t2").adapter == "lora_b" and f.trace.send("r1").adapter is None


def test_server_flags_forms():
    assert normalize_flags(["--no-enable-prefix-caching", "--max-num-seqs", "8", "--block-size=32", "--enable-lora"],
                           source="x") == {"enable_prefix_caching": False, "max_num_seqs": "8", "block_size": "32",
                                           "enable_lora": True}
    assert normalize_flags({"max-num-seqs": 4, "--enable-chunked-prefill": False}, source="x") == \
        {"max_num_seqs": 4, "enable_chunked_prefill": False}
    assert normalize_flags("--max-model-len 4096 --speculative-config '{\"n\": 2}'", source="x") == \
        {"max_model_len": "4096", "speculative_config": '{"n": 2}'}
    f = parse_foreign(doc(send("a", 0, prompt_len=5000), server_flags={"max_model_len": 1024, "max_num_seqs": 4,
                                                                       "block_size": 16}))
    assert f.trace.engine.max_num_seqs == 4
    assert f.trace.engine.max_model_len >= 5064  # raised so the request fits, and said so
    assert any("max_model_len raised" in n for n in f.notes)
    assert any(x.startswith("block_size=16") for x in f.ignored_flags) and f.trace.engine.block_size == 32


def test_inconsistency_evidence_key():
    f = parse_foreign(doc(send("a", 0), send("b", 1),
                          reproduction={"evidence": {"inconsistency": {"diverged_requests": ["b"]}}}))
    assert f.expected_diverged == ["b"] and f.evidence_key == "inconsistency"
    f = parse_foreign(doc(send("a", 0)))
    assert f.expected_diverged == [] and f.evidence_key is None


@pytest.mark.parametrize("data,field", [
    ([], None),
    ({"trace": {"events": "no"}}, "trace.events"),
    (doc(), "trace.events"),
    (doc({"action": "stop", "request_id": "a", "offset_ms": 0}), "trace.events[0].action"),
    (doc(send("", 0)), "trace.events[0].request_id"),
    (doc(send("a", -1)), "trace.events[0].offset_ms"),
    (doc(send("a", "soon")), "trace.events[0].offset_ms"),
    (doc({"action": "send", "request_id": "a", "offset_ms": 0}), "trace.events[0].prompt_len"),
    (doc(send("a", 0, prompt_len=10, prefix_len=20)), "trace.events[0].prefix_len"),
    (doc(send("a", 0, prompt_len=1.5)), "trace.events[0].prompt_len"),
    (doc(send("a", 0, stream="yes")), "trace.events[0].stream"),
    (doc(send("a", 0), reproduction={"evidence": {"kv_corruption": {"diverged_requests": "a"}}}),
     "reproduction.evidence.kv_corruption.diverged_requests"),
    (doc(send("a", 0), server_flags=42), "server_flags"),
    (doc(send("a", 0), server_flags={"max_num_seqs": "many"}), "server_flags.max_num_seqs"),
    (doc(cancel("a", 0)), "trace.events"),
])
def test_bad_foreign_files_name_the_field(data, field):
    with pytest.raises(BadInput) as e:
        parse_foreign(data, "f.json")
    assert e.value.source == "f.json" and e.value.field == field
    assert "\n" not in str(e.value)


def test_bad_foreign_file_via_cli_is_exit_2(tmp_path, kvfuzz_cli):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc({"action": "send", "request_id": "r1", "offset_ms": 0, "prompt_len": "long"})))
    r = kvfuzz_cli("replay", p)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.json: trace.events[0].prompt_len" in lines[0] and "Traceback" not in r.stderr


def test_converted_events_are_kvfuzz_events():
    f = parse_foreign(doc(send("a", 0), cancel("a", 40)))
    kinds = [type(e) for e in f.trace.events]
    assert kinds == [SendEvent, CancelEvent]
