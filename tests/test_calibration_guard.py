"""A calibration never measures a patched engine as noise: a profile measured with a fault
loaded through KVFUZZ_PLUGIN_MODULES (8.4 nats in float32) and saved to the shared cache would
make every later campaign in that dtype call corruption a near tie. No engine: the session below
would fail the test if calibration reached it."""

from __future__ import annotations

import pytest

from kvfuzz.driver.calibrate import PLAUSIBLE, implausible, prepare_bounds, unclean_engine
from kvfuzz.fuzzer import default_engine
from kvfuzz.traces.calibration import CalibrationProfile, NoiseKey


def profile(dtype: str, value: float) -> CalibrationProfile:
    key = NoiseKey(device="cpu", device_name="test", dtype=dtype, model="m")  # type: ignore[arg-type]
    return CalibrationProfile(key=key, bounds={"near_tie": value, "drift": value / 2, "teacher": value})


@pytest.mark.parametrize("dtype", sorted(PLAUSIBLE))
def test_bounds_beyond_batch_order_noise_are_refused(dtype):
    assert implausible(profile(dtype, PLAUSIBLE[dtype] / 2)) is None
    why = implausible(profile(dtype, PLAUSIBLE[dtype] * 4))
    assert why and "not clean" in why and "near_tie" in why
    # A float32 profile measured with a fault loaded: 8.42 nats.
    assert implausible(profile("float32", 8.42))


class NoEngine:
    """Only ``engine_for(...).noise_key()`` and ``bounds_for`` are asked of it."""

    profiles_dir = None

    def __init__(self, tmp_path):
        self.profiles_dir = tmp_path

    def engine_for(self, config):
        outer = self

        class E:
            def noise_key(self):
                return NoiseKey(device="cpu", device_name="none", dtype="float32", model=str(outer.profiles_dir))

        return E()

    def bounds_for(self, config):
        from kvfuzz.oracle.noise import default_bounds

        return default_bounds("float32")


def test_no_calibration_under_plugin_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUZZ_PLUGIN_MODULES", "unseen_faults.short_hash_lookup")
    assert "unseen_faults.short_hash_lookup" in (unclean_engine() or "")
    warned: list[str] = []
    bounds = prepare_bounds(NoEngine(tmp_path), default_engine(), calibrate_if_missing=True,  # type: ignore[arg-type]
                            warn=warned.append)
    assert bounds.dtype == "float32" and not list(tmp_path.glob("*.json"))  # nothing measured, nothing saved
    assert warned[0].startswith("not calibrating: KVFUZZ_PLUGIN_MODULES patches this engine")
    monkeypatch.delenv("KVFUZZ_PLUGIN_MODULES")
    assert unclean_engine() is None
