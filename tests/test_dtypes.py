"""--dtype and calibration profiles, without an engine: which dtype each device runs (and
the one-line refusal of one it cannot), the GPU command line in 16-bit, and the calibration
profile's round trip through the cache."""

from __future__ import annotations

import json

import pytest

from kvfuzz.harness.dtypes import check_dtype, resolve_dtype
from kvfuzz.harness.vllm_args import server_command
from kvfuzz.oracle.noise import bounds_from
from kvfuzz.traces import EngineConfig
from kvfuzz.traces.calibration import (
    CALIBRATION_VERSION,
    CalibrationProfile,
    ContextNoise,
    NoiseKey,
    find_profile,
    load_profile,
    profile_path,
    save_profile,
)
from kvfuzz.traces.errors import BadInput


def test_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert resolve_dtype("auto", "cuda") == resolve_dtype(None, "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("bf16", "cpu") == resolve_dtype("torch.bfloat16", "cpu") == "bfloat16"
    assert check_dtype("bfloat16", "cpu") == "bfloat16" and check_dtype("float16", "cuda") == "float16"


@pytest.mark.parametrize("dtype,device,needle", [
    ("float16", "cpu", "dtype float16 does not run on device cpu"),
    ("float64", "cuda", "unknown dtype 'float64'"),
])
def test_a_dtype_the_device_cannot_run_is_one_line_bad_input(dtype, device, needle):
    with pytest.raises(BadInput) as e:
        check_dtype(dtype, device)
    assert needle in str(e.value) and e.value.field == "--dtype" and "\n" not in str(e.value)


def test_bad_dtype_on_the_command_line_is_exit_2(kvfuzz_cli, tmp_path):
    for args in (["run", "--dtype", "float16"], ["calibrate", "--dtype", "float16"],
                 ["bench", "--dtype", "float32,float16"], ["gate", "--dtype", "float16"]):
        p = kvfuzz_cli(*args, "--out", tmp_path / "o")
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (args, p.stderr)
        assert "float16" in lines[0] and "cpu" in lines[0], (args, lines)


def test_the_gpu_command_serves_bfloat16_with_the_same_code():
    cfg = EngineConfig(dtype=resolve_dtype("auto", "cuda"), extra_args={"attention_backend": "FLASHINFER"})
    cmd = server_command(cfg, model_path="/m", adapter_paths={}, port=8000, device="cuda",
                         launcher=["vllm", "serve"])
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--attention-backend") + 1] == "FLASHINFER"


def _profile(**key):
    k = NoiseKey(**{"device": "cpu", "device_name": "test", "dtype": "bfloat16", "model": "m", **key})
    return CalibrationProfile(key=k, created="2026-11-23T00:00:00+00:00", requests=8, max_tokens=16,
                              contexts=[ContextNoise(name="batched", requests=8, positions=100, max_dlogprob=0.03,
                                                     max_dmargin=0.06, max_teacher=0.05)],
                              prefill_vs_decode=0.04, headroom=4.0)


def test_calibration_profile_round_trip(tmp_path):
    p = _profile()
    path = save_profile(p, profile_path(p.key, tmp_path))
    assert path.name == f"bfloat16-{p.key.id()}.json"
    again = load_profile(path)
    assert again == p and bounds_from(again) == bounds_from(p)
    assert find_profile(p.key, tmp_path) == p
    # Another device, dtype or model is another key: no profile.
    assert find_profile(_profile(device_name="other").key, tmp_path) is None
    assert find_profile(_profile(dtype="float32").key, tmp_path) is None
    # A damaged cache file is no profile (measured again), not an error.
    path.write_text("{broken")
    assert find_profile(p.key, tmp_path) is None


def test_a_bad_profile_file_is_one_line_bad_input(tmp_path, kvfuzz_cli):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"schema_version": CALIBRATION_VERSION, "kind": "calibration", "key": {"device": "cpu"}}))
    with pytest.raises(BadInput) as e:
        load_profile(bad)
    assert str(bad) in str(e.value) and "key" in str(e.value)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 1, "kind": "calibration", "key": {"device": "cpu"}}))
    with pytest.raises(BadInput, match="version-1 profile.*kvfuzz calibrate"):
        load_profile(old)
    p = kvfuzz_cli("gate", "--calibration", bad, "--out", tmp_path / "o")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "p.json" in p.stderr
    p = kvfuzz_cli("run", "--calibration", tmp_path / "missing.json", "--out", tmp_path / "o")
    assert p.returncode == 2 and "--calibration" in p.stderr and "no such file" in p.stderr


def test_another_dtype_keeps_the_kv_capacity_in_tokens():
    cfg = EngineConfig(dtype="float32", kv_cache_bytes=24 * 2**20)
    bf = cfg.with_dtype("bfloat16")
    assert bf.dtype == "bfloat16" and bf.kv_cache_bytes == 12 * 2**20
    assert bf.with_dtype("float32") == cfg
    assert EngineConfig(kv_cache_bytes=None).with_dtype("bfloat16").kv_cache_bytes is None


def test_a_16bit_campaign_meets_the_kv_pressure_of_a_float32_one():
    """`kvfuzz run --dtype bfloat16` builds its engine with default_engine: the KV size given is
    float32's, and 16-bit gets the same tokens in half the bytes. Taken literally, 24 MiB held
    twice the bfloat16 tokens: the pressure shape could not fill it, and bfloat16 campaigns
    preempted in 1 trace of 57 (float32: about 1 in 10). The same seed now draws the same
    events in every dtype, the pressure shape's holders and late long request included."""
    from kvfuzz.bench.bench import bench_engine
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.fuzzer.generate import generate
    from kvfuzz.fuzzer.shapes import kv_capacity_tokens

    f32, bf16 = default_engine(), default_engine(dtype="bfloat16")
    assert f32.kv_cache_bytes == 24 * 2**20 and bf16.kv_cache_bytes == 12 * 2**20 and bf16.dtype == "bfloat16"
    assert kv_capacity_tokens(f32) == kv_capacity_tokens(bf16) == 24 * 1024
    assert default_engine(dtype="float16", kv_cache_bytes=8 * 2**20).kv_cache_bytes == 4 * 2**20
    assert bench_engine("default", None, None, "bfloat16").kv_cache_bytes == 4 * 2**20  # bench: 8 MiB at float32
    pressured = 0
    for seed in range(40):
        a, b = generate(seed, f32), generate(seed, bf16)
        assert a.events == b.events, seed
        pressured += any(s.request_id.startswith("hold") for s in a.sends)
    assert pressured, "no trace drew the pressure shape: the test is blind"
