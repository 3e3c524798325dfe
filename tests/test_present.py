"""Pictures of findings, campaigns and gate runs (kvfuzz/present/): the data behind each picture
checked on findings recorded on the real vLLM CPU engine (tests/data/present/, see its
README.md), the drawing and the pages when matplotlib is installed, and one page opened in a
headless Chromium (Debian's ``chromium``; .ci/run installs it).

Fast tier: no engine here (tests/test_present_engine.py records a lifecycle finding live)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfuzz.oracle.noise import finding_bounds
from kvfuzz.present.report import build, to_markdown
from kvfuzz.present import PLOTS_HINT
from kvfuzz.present.data import (
    campaign_view,
    divergence_data,
    drawn_history,
    grid_data,
    schedule_data,
    time_breakdown,
    token_steps,
    victim_divergence,
)
from kvfuzz.present.pages import original_of
from kvfuzz.traces import load_finding
from kvfuzz.traces.finding import MECHANISM_WORDS

DATA = Path(__file__).parent / "data" / "present"
CAMPAIGN_R4 = DATA / "cpu-lora-campaign-r4.json"  # the CPU LoRA bug, 3 requests, token #16 differs
MINIMIZED = DATA / "lora-base-minimized.json"  # minimized, controls, causal ablation
ORIGINAL = DATA / "lora-base-original.json"  # what it was minimized from
RELOAD = DATA / "lora-reload-same-path.json"  # an adapter reload event, a stale prefix hit
NEAR_TIE = DATA / "bf16-near-tie.json"  # a clean bfloat16 one-step flip
FINDINGS = [CAMPAIGN_R4, MINIMIZED, ORIGINAL, RELOAD, NEAR_TIE]

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason=f"matplotlib is not installed ({PLOTS_HINT})")


# -- schedule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_bars_follow_the_recorded_steps(path):
    """Every bar of every recorded run: it starts at the send, ends with the finish (or the
    cancel), and its prefill/decode/waiting spans are exactly the steps that scheduled it."""
    f = load_finding(path)
    h = drawn_history(f)
    s = schedule_data(f)
    assert s.unit == "step" and s.arm == h.arm and s.run_index == h.run_index
    assert [b.request_id for b in s.bars] == [e.request_id for e in f.trace.sends if e.request_id in h.requests]
    for b in s.bars:
        rec = h.requests[b.request_id]
        tokens = {st.step: st.scheduled.get(b.request_id, 0) for st in h.steps}
        assert b.start == rec.sent_step
        if rec.finished_step is not None:
            assert b.end == rec.finished_step + 1
        else:
            assert rec.cancel_step is not None and b.end == max(rec.cancel_step, max(
                (k for k, v in tokens.items() if v), default=b.start - 1) + 1)
        assert b.spans[0].start == b.start and b.spans[-1].end == b.end
        assert all(x.end == y.start for x, y in zip(b.spans, b.spans[1:]))
        for sp in b.spans:
            for step in range(int(sp.start), int(sp.end)):
                want = {True: "prefill" if tokens.get(step, 0) > 1 else "decode", False: "waiting"}[
                    bool(tokens.get(step))]
                assert sp.kind == want, (b.request_id, step)
        assert [m.at for m in b.marker("send")] == [rec.sent_step]
        assert [m.at for m in b.marker("first-token")] == [rec.first_token_step]
        assert [m.at for m in b.marker("cancel")] == ([rec.cancel_step] if rec.cancel_step is not None else [])
        assert [m.at for m in b.marker("finish")] == ([rec.finished_step] if rec.finished_step is not None else [])
        assert [m.at for m in b.marker("preempted")] == [st.step for st in h.steps if b.request_id in st.preempted]
        assert len(b.marker("prefix-hit")) == (1 if rec.num_cached_tokens else 0)


def test_the_cpu_lora_bug_shows_where_the_adapter_request_joined():
    """The campaign's CPU LoRA finding: base request r4 differs first at token #16; the step that
    produced it is the step adapter request r6 was prefilled in the same batch."""
    f = load_finding(CAMPAIGN_R4)
    s = schedule_data(f)
    h = drawn_history(f)
    r4 = s.bar("r4")
    assert r4.victim and r4.verdict == "corruption" and r4.label == "r4 · base"
    assert {b.request_id: b.verdict for b in s.bars} == {"r4": "corruption", "r5": "ok", "r6": "truncation"}
    assert s.bar("r5").label.startswith("r5 · c · ") and s.bar("r6").label.startswith("r6 · a · ")
    (mark,) = r4.marker("first-divergence")
    d = victim_divergence(f)
    assert d.request_id == "r4" and mark.at == token_steps("r4", h)[d.first_divergence] and mark.x == mark.at + 0.5
    step = next(st for st in h.steps if st.step == mark.at)
    assert "r6" in step.scheduled and step.scheduled["r6"] > 1  # r6's prompt, on adapter a
    r6 = s.bar("r6")
    assert r6.marker("cancel")[0].at == h.requests["r6"].cancel_step and not r6.victim


def test_adapter_lifecycle_events_are_lines_and_the_stale_hit_a_marker():
    """vLLM #42125 on the real engine: adapter lora_a reloaded from the same path at step 30,
    request `new` (on the new weights) hits 160 cached tokens of the old ones and differs."""
    f = load_finding(RELOAD)
    h = drawn_history(f)
    s = schedule_data(f)
    (ev,) = [e for e in h.events if e.kind == "reload-adapter"]
    (line,) = s.lines
    assert (line.kind, line.adapter, line.at, line.x) == ("reload-adapter", "lora_a", ev.actual_step, ev.actual_step)
    assert "lora_a" in line.label and "same path" in line.label and "a@v2" in line.label
    new = s.bar("new")
    assert new.victim and new.label.startswith("new · lora_a=a@v2")  # the weights it ran with
    (hit,) = new.marker("prefix-hit")
    assert hit.note == f"{h.requests['new'].num_cached_tokens} cached" == "160 cached"
    assert hit.at == min(st.step for st in h.steps if st.scheduled.get("new")) > line.at
    assert s.bar("old").marker("finish")[0].at < line.at


def test_the_minimizer_keeps_are_highlighted_on_the_original():
    small = load_finding(MINIMIZED)
    original = original_of(small, MINIMIZED)
    assert original is not None and original.id == small.minimization.original
    kept = {e.request_id for e in small.trace.sends}
    s = schedule_data(original, kept=kept)
    assert {b.request_id: b.kept for b in s.bars} == {e.request_id: e.request_id in kept for e in original.trace.sends}
    assert 0 < len(kept) < len(s.bars)
    assert f"kept {len(kept)} of these {len(s.bars)}" in s.note
    own = schedule_data(small)
    assert all(b.kept for b in own.bars) and f"of {small.minimization.original_requests}" in own.note


# -- divergence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CAMPAIGN_R4, MINIMIZED, RELOAD, NEAR_TIE], ids=lambda p: p.stem)
def test_divergence_data_matches_the_oracles_evidence(path):
    """The picture shows what the oracle judged: the first differing position, the pair shift,
    the largest drift and teacher-forced drift it recorded, and the bounds of notes.oracle."""
    f = load_finding(path)
    d = divergence_data(f)
    v = victim_divergence(f)
    b = finding_bounds(f)
    assert (d.request_id, d.cls, d.first, d.bounds) == (v.request_id, v.class_, v.first_divergence, b)
    assert d.ref_tokens[d.first] != d.run_tokens[d.first]
    assert d.ref_tokens[: d.first] == d.run_tokens[: d.first]
    assert d.pair_shift == pytest.approx(v.margin + (v.run_margin or 0.0))
    for lp, lo, hi in zip(d.ref_logprob, d.band_low, d.band_high):
        assert lp is None or (lo == pytest.approx(lp - b.drift) and hi == pytest.approx(lp + b.drift))
    assert [i for i, _ in d.drift] == [i for i in range(d.first) if d.ref_logprob[i] is not None]
    if v.drift is not None:
        assert max(x for _, x in d.drift) == pytest.approx(v.drift)
    if v.teacher_drift is not None:
        assert max(x for _, x in d.teacher) == pytest.approx(v.teacher_drift)
    assert d.ref_margin[d.first] == pytest.approx(v.margin)


def test_the_cpu_lora_bug_is_far_outside_every_float32_bound():
    d = divergence_data(load_finding(CAMPAIGN_R4))
    assert (d.dtype, d.first) == ("float32", 16) and d.bounds.source == "profile"
    assert d.within_bounds() == {"pair shift": False, "drift": True, "teacher": False}
    assert d.pair_shift > 1000 * d.bounds.near_tie
    assert max(x for i, x in d.teacher if i > d.first) > 1000 * d.bounds.teacher


def test_a_clean_bfloat16_near_tie_is_inside_every_bound():
    """Why it is noise: a one-bf16-step reference margin, the run's own margin 0, and every
    logprob (before the flip, and teacher-forced over the whole run) inside the bounds."""
    f = load_finding(NEAR_TIE)
    d = divergence_data(f)
    assert (d.cls, d.dtype) == ("numeric-near-tie", "bfloat16")
    assert d.within_bounds() == {"pair shift": True, "drift": True, "teacher": True}
    assert d.ref_margin[d.first] == pytest.approx(0.03125)  # one bfloat16 step at these logits
    assert d.pair_shift < d.bounds.near_tie and len(d.teacher) >= d.first  # scored at every position before it


# -- controls and ablation -----------------------------------------------------------------------


def test_grid_rows_are_arms_controls_and_ablations():
    f = load_finding(MINIMIZED)
    g = grid_data(f)
    victim = f.explanation.victim
    assert g.columns == (victim,)
    states = {r.label: r.cells[0].state for r in g.rows}
    assert states["arm vanilla"] == "diverged" and g.row("arm vanilla").cells[0].text.startswith("corruption")
    assert states["control serialized"] == "clean"  # a base request alone never shares a batch with LoRA
    assert states["control batch-invariant"] == "na"  # no batch-invariant kernels on CPU
    for m in f.explanation.needs:
        assert states[f"without {MECHANISM_WORDS[m]}"] == "clean", m  # taking it away made it disappear
    for m in f.explanation.not_needed:
        assert states[f"without {MECHANISM_WORDS[m]}"] == "diverged", m
    assert set(f.explanation.needs) >= {"concurrency", "lora"} and states["without cancels"] == "na"
    assert [r.group for r in g.rows] == sorted((r.group for r in g.rows), key=["arm", "control", "ablation"].index)


def test_the_near_tie_grid_shows_the_float32_control_clean():
    g = grid_data(load_finding(NEAR_TIE))
    assert g.row("arm vanilla").cells[0].state == "near-tie"
    assert g.row("control float32").cells[0].state == "clean"


# -- campaign and gate data ----------------------------------------------------------------------


def test_campaign_view_from_a_real_campaign_json():
    state = json.loads((DATA / "campaign.json").read_text())
    v = campaign_view(state)
    assert v.progress[0] == (0.0, 0.0, 0.0, 0.0)
    assert v.progress[-1] == (state["traces"], state["seconds"], len(state["coverage"]), state["findings"])
    assert [p[0] for p in v.progress] == sorted(p[0] for p in v.progress)
    assert len(v.buckets) == len(state["bug_buckets"]) >= 1
    b = v.buckets[0]
    assert b.representative in state["finding_files"] and b.case == state["bug_buckets"][b.id]["case"]
    assert v.complete and v.findings == sum(v.by_class.values())


def test_time_breakdown_is_read_where_campaign_json_keeps_one():
    assert time_breakdown({"traces": 3}) == []
    assert time_breakdown({"time_breakdown": {"fuzz": 40.5, "triage": {"minimize": 10, "controls": 2.5},
                                              "complete": True}}) == [
        ("fuzz", 40.5), ("triage.minimize", 10.0), ("triage.controls", 2.5)]


# -- the oracle's report of a lifecycle finding (with adapter events) -----------------------------


def test_report_of_a_finding_with_adapter_events():
    md = to_markdown(build(load_finding(RELOAD)))
    assert "| reload-adapter |  | step 30" in md and "lora_a ← embedded:a@v2 (same path)" in md


# -- without matplotlib --------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--html", "--plots"])
def test_without_matplotlib_pictures_fail_with_the_install_line(tmp_path, kvfuzz_cli, monkeypatch, flag):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = kvfuzz_cli("report", CAMPAIGN_R4, flag, tmp_path / "x")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "pip install 'kvfuzz[plots]'" in r.stderr
    assert not (tmp_path / "x").exists()


def test_without_matplotlib_pages_still_have_their_tables(tmp_path, monkeypatch):
    from kvfuzz.present import pages

    monkeypatch.setattr(pages, "have_matplotlib", lambda: False)
    state = json.loads((DATA / "campaign.json").read_text())
    pages.write_campaign_page(tmp_path, state, final=True)
    html = (tmp_path / "campaign.html").read_text()
    assert "<svg" not in html and PLOTS_HINT.replace("'", "&#x27;") in html and "Bug buckets" in html


# -- drawing and pages (matplotlib) --------------------------------------------------------------


@needs_matplotlib
def test_report_writes_pictures_html_and_linked_markdown(tmp_path, kvfuzz_cli):
    shutil.copy(MINIMIZED, tmp_path / MINIMIZED.name)
    shutil.copy(ORIGINAL, tmp_path / ORIGINAL.name)
    r = kvfuzz_cli("report", MINIMIZED.name, "--html", "r.html", "--plots", "pics", "-o", "r.md", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    names = {"schedule", "schedule-original", "divergence", "controls"}
    assert {p.name for p in (tmp_path / "pics").iterdir()} == {f"{n}.{e}" for n in names for e in ("png", "svg")}
    for p in (tmp_path / "pics").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 150_000
    md = (tmp_path / "r.md").read_text()
    assert "## Pictures" in md and "![schedule](pics/schedule.png)" in md and "![divergence](pics/divergence.png)" in md
    html = (tmp_path / "r.html").read_text()
    assert html.count("<svg") == 4 and "<script" not in html
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched: self-contained
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids))  # four inline SVGs, no clashing ids


@needs_matplotlib
def test_gate_writes_a_page_linking_each_saved_findings_report(tmp_path):
    from kvfuzz.cli.commands.gate import _write_reports
    from kvfuzz.oracle.gate import Case

    f = load_finding(RELOAD)
    src = f.provenance.gate.source
    case = Case(source=src, name=f.trace.name, arm="vanilla", toggles=[], verdicts=list(f.verdicts), seconds=4.1,
                replay_command=f"kvfuzz replay {src}")
    ok = Case(source="other.json", name="other", arm="vanilla", toggles=[], seconds=1.0)
    (tmp_path / "findings").mkdir()
    shutil.copy(RELOAD, tmp_path / "findings" / RELOAD.name)
    _write_reports([case, ok], out=tmp_path, junit=None, summary=None, what="gate", complete=True)
    html = (tmp_path / "gate.html").read_text()
    assert f'href="findings/{RELOAD.stem}.html"' in html and html.count("<svg") == 1
    assert "FAIL" in html and "pass" in html
    assert (tmp_path / "findings" / f"{RELOAD.stem}.html").read_text().count("<svg") >= 2


@needs_matplotlib
def test_campaign_page_with_charts_and_the_buckets_report(tmp_path):
    from kvfuzz.present import campaign_page

    state = json.loads((DATA / "campaign.json").read_text())
    (bid, bucket), = state["bug_buckets"].items()
    (tmp_path / "buckets").mkdir()
    shutil.copy(CAMPAIGN_R4, tmp_path / bucket["case"])
    campaign_page(tmp_path, state, final=True)
    html = (tmp_path / "campaign.html").read_text()
    assert html.count("<svg") == 2 and f'href="buckets/{bid}.html"' in html and "refresh" not in html
    assert (tmp_path / "buckets" / f"{bid}.html").read_text().count("<svg") == 2  # schedule, divergence


# -- a page in a real browser --------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)


def open_in_browser(page: Path, profile: Path) -> tuple[str, str, float]:
    """``chromium --dump-dom`` of a page: (the DOM it built, its log, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, p.stderr, time.monotonic() - t0


def console_errors(log: str) -> list[str]:
    """Console messages and uncaught errors of the page (Chromium logs each as ``CONSOLE``)."""
    return [ln for ln in log.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


@needs_matplotlib
def test_a_finding_page_opens_in_headless_chromium(tmp_path):
    """The HTML report of the real CPU LoRA finding in Debian's Chromium: the browser builds the
    four inline pictures from the file alone (no network) and logs no console error. CI
    (.ci/run) installs chromium; elsewhere the test is skipped without it."""
    if chromium() is None:
        if os.environ.get("KVFUZZ_CI_OUT"):
            pytest.fail("chromium is missing in CI: .ci/run installs it (see .ci/out/chromium-install.log)")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from kvfuzz.harness.toggles import catalog
    from kvfuzz.present.pages import finding_page
    from kvfuzz.traces import atomic_write_text

    shutil.copy(ORIGINAL, tmp_path / ORIGINAL.name)
    page = tmp_path / "report.html"
    atomic_write_text(page, finding_page(load_finding(MINIMIZED), source=tmp_path / MINIMIZED.name,
                                         toggles_known=catalog()))
    dom, log, seconds = open_in_browser(page, tmp_path / "profile")
    assert dom.count("<svg") == 4, dom[:500]
    assert dom.count("<figure") == 4 and "Controls and ablation" in dom
    assert console_errors(log) == []
    print(f"chromium opened {page.name} in {seconds:.1f} s")


def test_campaign_page_shows_near_tie_buckets_apart_from_the_bugs(tmp_path, monkeypatch):
    """16-bit noise never reads as a bug — on the page as in the closing table."""
    from kvfuzz.present import pages
    from kvfuzz.traces.buckets import Bucket, BucketKey

    monkeypatch.setattr(pages, "have_matplotlib", lambda: False)
    state = json.loads((DATA / "campaign.json").read_text())
    bug = Bucket(id="b" * 10, key=BucketKey(cls="corruption"), count=7, assigned=5, first_index=1)
    tie = Bucket(id="t" * 10, key=BucketKey(cls="numeric-near-tie"), count=3, first_index=0)
    state["bug_buckets"] = {b.id: b.model_dump(mode="json", by_alias=True) for b in (bug, tie)}
    state["merges"] = {}
    pages.write_campaign_page(tmp_path, state, final=True)
    html = (tmp_path / "campaign.html").read_text()
    bugs, ties = html.split("<h2>Near-tie buckets</h2>")
    assert "b" * 10 in bugs and "t" * 10 not in bugs and "t" * 10 in ties and "b" * 10 not in ties
    assert "7 (5 assigned: triage budget spent)" in bugs
