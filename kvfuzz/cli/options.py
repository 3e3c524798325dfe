"""Typer options shared by several commands (arms: kvfuzz/arms.py and docs/toggles.md)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

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
