"""One construction path: the CLI's options parsed once into kvfuzz.driver.settings, and every session
(a command's, a Ray worker's, the isolated child of the batch-invariant control) built from them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvfuzz.cli import options
from kvfuzz.driver.settings import SessionSettings
from kvfuzz.driver.session import build_session, server_options
from kvfuzz.traces import EngineConfig, GenPrompt, SendEvent, Trace
from kvfuzz.traces.calibration import CalibrationProfile, ContextNoise, NoiseKey, save_profile
from kvfuzz.traces.errors import BadInput


def _profile() -> CalibrationProfile:
    key = NoiseKey(device="cpu", device_name="test", dtype="bfloat16", model="m")
    return CalibrationProfile(key=key, created="2026-11-24T00:00:00+00:00", requests=8, max_tokens=16,
                              contexts=[ContextNoise(name="batched", requests=8, positions=100, max_dlogprob=0.03,
                                                     max_dmargin=0.06, max_teacher=0.05)],
                              prefill_vs_decode=0.04, headroom=4.0)


def _parsed(tmp_path: Path, **kw) -> SessionSettings:
    profile_file = save_profile(_profile(), tmp_path / "profile.json")
    return options.session_settings("inprocess", "cpu", near_tie=0.5, bound=["drift=0.3"],
                                    calibration=profile_file, **kw)


def test_bound_and_calibration_reach_the_batch_invariant_controls_child(tmp_path, monkeypatch):
    """The isolated child must be built with the bound overrides and calibration profiles, as
    the parent is. The child here is the real one (``kvfuzz.driver.isolated``'s
    entry point), run in this process instead of a subprocess, with its check recorded."""
    from kvfuzz.driver import isolated
    from kvfuzz.driver.session import Session
    from kvfuzz.triage.finish import isolated_runner

    parent = build_session(_parsed(tmp_path), tmp_path)
    seen: list[Session] = []

    def check(self, trace, *, runs=None, arms=None):  # the child's check, recorded instead of run
        seen.append(self)
        return type("Checked", (), {"verdicts": []})()

    def run_child(argv, **_kw):
        isolated._child(Path(argv[-2]), Path(argv[-1]))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(Session, "check", check)
    monkeypatch.setattr(isolated.subprocess, "run", run_child)
    trace = Trace(engine=EngineConfig(), events=[SendEvent(request_id="r", at={"step": 0}, max_tokens=2,
                                                           prompt=GenPrompt(length=40, seed=1))])
    assert isolated_runner(parent)(trace, 1, {"batch-invariant": []}, {"VLLM_BATCH_INVARIANT": "1"}) == []
    (child,) = seen
    assert child.bound_overrides == {"near_tie": 0.5, "drift": 0.3}
    assert child.profiles == [_profile()]
    assert (child.engine_kind, child.device, child.runs) == ("inprocess", "cpu", 1)


def test_a_profile_the_session_adopts_reaches_the_sessions_built_from_its_settings(tmp_path):
    """A profile measured or found after start (``use_profile``) joins the settings the isolated
    child and nothing else is built from."""
    s = build_session(SessionSettings(), tmp_path)
    s.use_profile(EngineConfig(), _profile())
    s.use_profile(EngineConfig(), _profile())  # once only
    assert s.settings.profiles == [_profile()]


def test_the_api_key_is_never_written_into_the_settings_a_child_receives(tmp_path):
    s = options.session_settings("inprocess", "cpu", base_url="http://h:1", api_key="sk-secret")
    assert "sk-secret" not in s.model_dump_json() and "sk-secret" not in json.dumps(s.model_dump(mode="json"))
    assert build_session(s, tmp_path).secrets() == ["sk-secret"]


def test_server_options_are_built_from_the_settings_only_for_a_managed_server(tmp_path):
    s = options.session_settings("server", "cpu", server_arg=["--max-logprobs", "5"], port=8123, trace_timeout=42.0)
    o = server_options(s, tmp_path)
    assert o is not None and (o.extra_flags, o.port, o.request_timeout_s, o.log_dir) == (
        ["--max-logprobs", "5"], 8123, 42.0, tmp_path)
    assert build_session(s, tmp_path).server_options == o
    assert server_options(SessionSettings(), tmp_path) is None


@pytest.mark.parametrize(("kw", "flag"), [
    (dict(engine="gpu"), "--engine"), (dict(device="tpu"), "--device"), (dict(port=0, engine="server"), "--port"),
    (dict(port=8000), "--port"), (dict(trace_timeout=0.0), "--trace-timeout"), (dict(bound=["x=1"]), "--bound"),
    (dict(calibration=Path("nope.json")), "--calibration"),
])
def test_bad_shared_options_are_one_line_bad_input_naming_the_flag(kw, flag):
    args = {"engine": "inprocess", "device": "cpu", **kw}
    with pytest.raises(BadInput) as e:
        options.session_settings(args.pop("engine"), args.pop("device"), **args)
    assert e.value.field == flag


def test_the_engine_pool_log_names_what_a_configuration_changes():
    """A campaign's engine.log says which configurations its triage starts (each start costs
    seconds, and triage may start many); toggles are not an engine's."""
    from kvfuzz.fuzzer.generate import default_engine
    from kvfuzz.harness.inprocess import _changes

    a = default_engine()
    b = a.model_copy(update={"enable_prefix_caching": False, "toggles": ["x"],
                             "lora": a.lora.model_copy(update={"enabled": True})})
    assert _changes(a, a) == ""
    assert _changes(a, b) == "enable_prefix_caching=False, lora.enabled=True"
