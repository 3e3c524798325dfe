"""`kvfuzz toggles`, `kvfuzz bench` and the arm options as a user runs them (the CLI entry
point in-process). A campaign's attribution on vanilla is checked in test_cli.py."""

import json

import pytest


@pytest.mark.engine  # the self-checks read the installed vLLM's source
def test_toggles_command_lists_every_toggle_with_status(kvfuzz_cli):
    p = kvfuzz_cli("toggles", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    rows = {r["name"]: r for r in data["toggles"]}
    assert len(rows) >= 8 and all(r["status"] == "ok" and r["problem"] is None for r in rows.values())
    assert rows["fix-lora-cpu-no-lora-tokens"]["in_clean_arm"] is True
    assert rows["fault-block-table-stale-tail"]["changes_outputs_here"] is False
    assert rows["fault-cancel-frees-shared-blocks"]["changes_outputs_here"] is True
    for key in ("kind", "models", "process", "target", "backends", "versions", "description"):
        assert all(r[key] for r in rows.values()), key
    table = kvfuzz_cli("toggles")
    assert table.returncode == 0 and "fault-prefix-hit-before-write" in table.stdout


@pytest.mark.parametrize("args,text", [
    (["run", "--with", "fault-nope"], "unknown toggle 'fault-nope'"),
    (["run", "--arms", "vanilla", "--without", "fix-lora-cpu-no-lora-tokens"], "not on in arm 'vanilla'"),
    (["bench", "--seeds", "1,x"], "--seeds"),
    (["bench", "--lora", "maybe"], "--lora"),
    (["bench", "--toggles", "fault-nope"], "unknown toggle"),
])
def test_bad_arm_and_bench_options_exit_2(args, text, kvfuzz_cli):
    p = kvfuzz_cli(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in p.stderr
