"""``kvfuzz bisect FILE``: in which vLLM releases does a finding reproduce? Each release probed
is one ``kvfuzz replay FILE --vllm V`` in that release's environment (kvfuzz/versions/releases.py);
the search is triage/bisect.py. docs/bisect.md.

Exit codes: 0 the search completed (whatever it found), 2 bad input, 3 no release could be
probed.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.cli import options
from kvfuzz.cli.app import app, console, err_console
from kvfuzz.traces.buckets import live
from kvfuzz.traces import Finding, VersionResult, atomic_write_text, load_finding, save
from kvfuzz.traces.buckets import Bucket, buckets_from_state
from kvfuzz.traces.errors import BadInput
from kvfuzz.triage import bisect as search


def _check_arms(arms: str | None, with_: list[str], without: list[str]) -> None:
    """The toggles the flags name exist (what an arm means depends on the release, so the arms
    themselves are built by each release's replay)."""
    from kvfuzz.harness import toggles

    known = toggles.names()

    def check(name: str, flag: str) -> None:
        if name not in known:
            raise BadInput(f"unknown toggle {name!r} (known: {', '.join(known)}; see `kvfuzz toggles`)", field=flag)

    for t in with_:
        check(t, "--with")
    for t in without:
        check(t, "--without")
    if arms is None:
        return
    items = [x.strip() for x in arms.split(",") if x.strip()]
    if not items:
        raise BadInput("no arms given", field="--arms")
    for item in items:
        if item in ("vanilla", "clean", "all"):
            continue
        if item.startswith(("with:", "without:")):
            check(item.partition(":")[2], "--arms")
        elif "=" in item:
            name, _, spec = item.partition("=")
            if not name:
                raise BadInput(f"{item!r}: arm name is empty", field="--arms")
            for t in filter(None, spec.split("+")):
                check(t, "--arms")
        else:
            raise BadInput(f"unknown arm {item!r} (vanilla, clean, with:T, without:T, NAME=T1+T2, all)", field="--arms")


def _table(title: str, rows: list[list[str]]) -> Table:
    from kvfuzz.present.report import BISECT_COLUMNS, STATUS_STYLE

    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    for i, col in enumerate(BISECT_COLUMNS):
        t.add_column(col, justify="right" if i in (1, 3, 5) else "left", overflow="fold", no_wrap=i != 6)
    for row in rows:
        cells: list[Any] = list(row)
        cells[2] = Text(row[2], style=STATUS_STYLE.get(row[2].split(" ")[0], ""))
        if row[2] == "not probed":
            cells = [Text(c, style="dim") for c in row]
        t.add_row(*cells)
    return t


@app.command("bisect")
def bisect_cmd(
    file: Annotated[Path, typer.Argument(help="A kvfuzz finding, kvfuzz trace or foreign finding file, or a "
                                              "campaign's output directory (every bug bucket).")],
    versions: Annotated[Optional[str], typer.Option(
        "--versions", metavar="A..B", help=f"Releases to search: A..B (inclusive), or a comma list (default: "
                                           f"{search.DEFAULT_OLDEST} to the newest published).")] = None,
    runs: Annotated[int, typer.Option(min=1, help="Runs of the file per release (K).")] = 3,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Probe every release (what a claim about "
                                                                 "every release needs) instead of bisecting.")] = False,
    min_rate: Annotated[float, typer.Option("--min-rate", help="A release is bad when a victim diverged in at "
                                                               "least this fraction of its runs (and in one at "
                                                               "least; default: one run).")] = 0.0,
    members: Annotated[int, typer.Option("--members", min=1, help="A campaign: findings bisected per bucket (its "
                                                                  "regression case, then members spread over "
                                                                  "the bucket).")] = 3,
    out: Annotated[Optional[Path], typer.Option(help="Output directory: OUT/<release>/ per probe (replay summary "
                                                     "and log), OUT/bisect.json for a trace (default: "
                                                     "kvfuzz-out/bisect; a campaign's: its bisect/).")] = None,
    engine: options.EngineOpt = "inprocess",
    device: options.DeviceOpt = "cpu",
    dtype: options.DtypeOpt = None,
    with_: options.WithOpt = None,
    without: options.WithoutOpt = None,
    arms: options.ArmsOpt = None,
) -> None:
    """Find the vLLM releases a finding reproduces in: both ends of the range first, then a
    binary search for the first bad (a regression) or first good (a fix) release.

    Releases run vLLM as shipped (the vanilla arm) unless --arms / --with / --without say
    otherwise. A finding gets the result written into it; a trace or foreign file gets
    OUT/bisect.json. A campaign directory: each bug bucket's findings are bisected and the
    bucket records its release range; a bucket whose findings disagree is split, one bucket
    per range (docs/bisect.md)."""
    from kvfuzz.driver.settings import engine_kind

    engine_kind(engine, None, device)  # bad --engine / --device: exit 2 before any release runs
    if not 0.0 <= min_rate <= 1.0:
        raise BadInput(f"must be between 0 and 1, got {min_rate:g}", field="--min-rate")
    with_, without = list(with_ or []), list(without or [])
    _check_arms(arms, with_, without)
    from kvfuzz.versions import releases

    chosen = search.parse_versions(versions, releases.known_releases(device), parse=releases.parse_version)
    flags = ["--engine", engine, "--device", device]
    flags += ["--arms", arms] if arms else ([] if (with_ or without) else ["--arms", "vanilla"])
    flags += [x for t in with_ for x in ("--with", t)] + [x for t in without for x in ("--without", t)]
    flags += ["--dtype", dtype] if dtype else []
    how = dict(runs=runs, min_rate=min_rate, arms=arms or ("clean" if with_ or without else "vanilla"),
               with_=with_, without=without, engine=engine, device=device, dtype=dtype)
    one = _Bisector(chosen, flags, how, exhaustive=exhaustive)
    if file.is_dir():
        raise typer.Exit(_bisect_campaign(file, one, members=members, out=out or file / "bisect"))
    from kvfuzz.cli.commands.replay import load_item

    item = load_item(file)
    rec = one(file, item, out or Path("kvfuzz-out/bisect"))
    if rec is None:
        raise typer.Exit(3)
    _write(rec, item, file, out or Path("kvfuzz-out/bisect"))
    raise typer.Exit(0)


class _Bisector:
    """One file's bisection over the chosen releases, printed as it goes; None when no release
    could be probed."""

    def __init__(self, chosen: list[str], flags: list[str], how: dict[str, Any], *, exhaustive: bool):
        self.chosen, self.flags, self.how, self.exhaustive = chosen, flags, how, exhaustive

    def __call__(self, file: Path, item: Any, out: Path) -> Any:
        from kvfuzz.harness.environment import kvfuzz_version
        from kvfuzz.present.report import bisect_lines, bisect_rows

        chosen, runs, min_rate = self.chosen, int(self.how["runs"]), float(self.how["min_rate"])
        # Whose divergence counts: the file's victims; a trace expecting nothing: any request.
        victims = {rid for _, rid in item.expected} if item.expected else None
        # Which divergences are its bug: another crash, or a crash instead of a wrong output, is not.
        bug = search.same_bug(item.crash) if item.kind != "trace" else None
        bound = search.probe_bound(len(chosen), self.exhaustive)
        count = 0

        def say(*args: Any, **_: Any) -> None:
            if args:
                console.print(f"    {args[0]}", markup=False, highlight=False)

        def probe(version: str) -> VersionResult:
            nonlocal count
            count += 1
            console.print(f"probe {count}" + (f" of at most {bound}" if count <= bound else "")
                          + f": vLLM {version} ({runs} run{'s' if runs != 1 else ''})", markup=False, highlight=False)
            r = search.replay_probe(version, file=file, out=out, runs=runs, flags=self.flags, victims=victims,
                                    bug=bug, min_rate=min_rate, device=str(self.how["device"]), progress=say)
            got = (f" ({r.k}/{r.runs} runs diverged, {r.seconds:.1f} s)" if r.status in search.USABLE
                   else f" — {r.detail or 'no detail'}")
            console.print(f"  {version}: {r.status}{got}", markup=False, highlight=False)
            return r

        what = f"vLLM {chosen[0]}" + (f" to {chosen[-1]}" if len(chosen) > 1 else "")
        console.print(f"bisecting {file} over {len(chosen)} release{'s' if len(chosen) != 1 else ''} ({what}); "
                      + ("probing every one" if self.exhaustive else f"at most {bound} probes if every release can be probed"),
                      markup=False, highlight=False)
        t0 = time.monotonic()
        rec = search.bisect(chosen, probe, exhaustive=self.exhaustive)
        rec = rec.model_copy(update=dict(
            **self.how, min_hits=search.threshold(runs, min_rate), source=str(file),
            seconds=round(time.monotonic() - t0, 1), kvfuzz_version=kvfuzz_version(),
            created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()))
        rec = type(rec).model_validate(rec.model_dump(by_alias=True))  # the copy's fields checked like a loaded file's

        console.print(_table(f"{file.name}: {what}", bisect_rows(rec)))
        for line in bisect_lines(rec):
            console.print(line, markup=False, highlight=False)
        if not [r for r in rec.results if r.status in search.USABLE]:
            err_console.print(f"kvfuzz: error: no release could be probed (logs under {out})", markup=False,
                              highlight=False)
            return None
        return rec


def _bisect_campaign(campaign: Path, one: _Bisector, *, members: int, out: Path) -> int:
    """Every bug bucket of a campaign: its regression case and up to ``members`` - 1 other
    findings bisected, each finding file given its record; the bucket records its range, or is
    split where the ranges disagree (``oracle.buckets.split_by_release``). The campaign state
    is written after each bucket, so an interrupted run keeps what it finished. Exit 0, or 3
    when no release could be probed for any file."""
    from kvfuzz.cli.commands.replay import load_item
    from kvfuzz.oracle.buckets import split_by_release
    from kvfuzz.triage.bisect import release_range

    state_file = campaign / "campaign.json"
    state = _load_state(state_file)
    buckets = buckets_from_state(state["bug_buckets"], str(state_file))
    # A bucket with a range was bisected by an earlier run (an interrupted one resumes here).
    todo = [b for b in live(buckets) if not b.near_tie and b.releases is None
            and b.split_from is None]
    if not todo:
        console.print(f"{campaign}: no bug bucket left to bisect", markup=False, highlight=False)
        return 0
    probed_any = False
    for b in todo:
        files = bisect_subjects(b, members)
        console.print(f"bucket {b.id} ({b.count} finding{'s' if b.count != 1 else ''}): bisecting "
                      f"{len(files)} of them", markup=False, highlight=False)
        ranges = {}
        for rel in files:
            path = campaign / rel
            item = load_item(path)
            rec = one(path, item, out / b.id / Path(rel).stem)
            if rec is None:
                continue
            probed_any = True
            _write(rec, item, path, out / b.id / Path(rel).stem)
            ranges[rel] = release_range(rec)
        parts = split_by_release(b, ranges)
        for part in parts:
            state["bug_buckets"][part.id] = part.model_dump(mode="json", by_alias=True)
        atomic_write_text(state_file, json.dumps(state, indent=2, sort_keys=True) + "\n")
        if len(parts) > 1:
            console.print(f"bucket {b.id} holds {len(parts)} bugs by release range: "
                          + "; ".join(f"{p.id}: {p.releases.label if p.releases else '?'} ({p.count} finding(s))"
                                      for p in parts), markup=False, highlight=False)
        elif parts[0].releases is not None:
            console.print(f"bucket {b.id}: {parts[0].releases.label}", markup=False, highlight=False)
        else:
            console.print(f"bucket {b.id}: no bisection concluded", markup=False, highlight=False)
    return 0 if probed_any else 3


def bisect_subjects(bucket: Bucket, members: int) -> list[str]:
    """The files bisected for a bucket: its regression case (its minimized witness), else its
    representative, then findings spread evenly over the rest (the first and the last joined
    differ most in time, the likeliest place for a second bug under one key)."""
    first = bucket.case or bucket.representative
    rest = [f for f in bucket.findings if f not in (bucket.representative, first)]
    picks: list[str] = [first] if first else []
    n = min(max(0, members - len(picks)), len(rest))
    if n == 1:
        picks.append(rest[-1])
    elif n > 1:
        step = (len(rest) - 1) / (n - 1)  # >= 1: n distinct positions, the first and the last among them
        picks += [rest[round(i * step)] for i in range(n)]
    return picks


def _load_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInput(f"not a campaign's output directory: unreadable campaign state "
                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__})", source=str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("bug_buckets"), dict):
        raise BadInput("not a campaign state: no bug_buckets", source=str(path))
    return data


def _write(rec: Any, item: Any, file: Path, out: Path) -> None:
    """A finding gets the record written into it (atomically); anything else gets OUT/bisect.json."""
    if item.kind == "finding":
        finding: Finding = load_finding(file)  # re-read: nothing the search did may change it but the record
        finding.bisect = rec
        save(finding, file)
        console.print(f"wrote the bisection into {file}", markup=False, highlight=False)
        return
    path = out / "bisect.json"
    atomic_write_text(path, rec.model_dump_json(indent=2, by_alias=True) + "\n")
    console.print(f"wrote {path} ({item.kind} files carry no record; a finding would have it written into it)",
                  markup=False, highlight=False)

