"""`kvfuzz toggles`, `kvfuzz bench` and the arm options as a user runs them (subprocesses)."""

import json
import subprocess
import sys

import pytest

from traces import load_finding


def kvfuzz(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "kvfuzz", *args], capture_output=True, text=True, timeout=timeout)


def test_toggles_command_lists_every_toggle_with_status():
    p = kvfuzz("toggles", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    rows = {r["name"]: r for r in data["toggles"]}
    assert len(rows) >= 8 and all(r["status"] == "ok" and r["problem"] is None for r in rows.values())
    assert rows["fix-lora-cpu-no-lora-tokens"]["in_clean_arm"] is True
    assert rows["fault-block-table-stale-tail"]["changes_outputs_here"] is False
    assert rows["fault-cancel-frees-shared-blocks"]["changes_outputs_here"] is True
    for key in ("kind", "models", "process", "target", "backends", "versions", "description"):
        assert all(r[key] for r in rows.values()), key
    table = kvfuzz("toggles")
    assert table.returncode == 0 and "fault-prefix-hit-before-write" in table.stdout


@pytest.mark.parametrize("args,text", [
    (["run", "--with", "fault-nope"], "unknown toggle 'fault-nope'"),
    (["run", "--arms", "vanilla", "--without", "fix-lora-cpu-no-lora-tokens"], "not on in arm 'vanilla'"),
    (["bench", "--seeds", "1,x"], "--seeds"),
    (["bench", "--lora", "maybe"], "--lora"),
    (["bench", "--toggles", "fault-nope"], "unknown toggle"),
])
def test_bad_arm_and_bench_options_exit_2(args, text):
    p = kvfuzz(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in p.stderr


@pytest.mark.engine
def test_run_attributes_divergences_on_vanilla(tmp_path):
    out = tmp_path / "out"
    p = kvfuzz("run", "--traces", "3", "--lora", "--seed", "1", "--runs", "1", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "arms: vanilla = [no toggles]" in p.stdout
    files = sorted((out / "findings").glob("*.json"))
    assert files, p.stdout
    for path in files:
        f = load_finding(path)
        assert f.arms["vanilla"] == [] and f.arms["clean"] == ["fix-lora-cpu-no-lora-tokens"]
        assert {d.explained_by for d in f.divergences} == {"fix-lora-cpu-no-lora-tokens"}
    assert "fix-lora-cpu-no-lora-tokens" in p.stdout and "UNEXPLAINED" not in p.stdout
