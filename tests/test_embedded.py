import json

from kvfuzz.harness import embedded


def test_build_is_deterministic_and_pinned(tmp_path):
    a = embedded.build(tmp_path / "a")
    b = embedded.build(tmp_path / "b")
    assert a.content_hash == b.content_hash == embedded.EXPECTED_HASH
    assert embedded.content_hash(a.root) == a.content_hash
    assert set(a.adapters) == {"a", "b", "c"}


def test_model_shape_supports_long_contexts_and_a_context_dependent_init(tmp_path):
    m = embedded.build(tmp_path / "m")
    cfg = json.loads((m.model_dir / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 16384
    assert cfg["initializer_range"] == 0.2  # 0.02 makes a model that only repeats its last token
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # CPU attention rejects head_dim 16


def test_existing_build_is_reused_and_tampering_detected(tmp_path):
    m = embedded.build(tmp_path / "m")
    (m.model_dir / "config.json").write_text("{}")
    import pytest

    from kvfuzz.traces.errors import BadInput

    with pytest.raises(BadInput, match="changed since they were built"):
        embedded.build(tmp_path / "m", verify=True)
    assert embedded.build(tmp_path / "m", force=True).content_hash == embedded.EXPECTED_HASH


def test_the_tokenizer_vllm_loads_encodes_every_word():
    """Bad words reach vLLM as text: whichever class transformers picks for the checkpoint, each
    word is its token, with or without a leading space, and ids decode back to the words."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded.build().model_dir))
    assert tok.encode("<t5>", add_special_tokens=False) == [5]
    assert tok.encode(" <t9><t511> <t17>", add_special_tokens=False) == [9, 511, 17]
    assert tok.decode([5, 9], skip_special_tokens=True).replace(" ", "") == "<t5><t9>"
