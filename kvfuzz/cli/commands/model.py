"""``kvfuzz schema`` and ``kvfuzz model build``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvfuzz.cli.app import app, console, model_app
from kvfuzz.traces.errors import BadInput


@app.command()
def schema(
    kind: Annotated[str, typer.Argument(help="trace or finding")] = "trace",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write to this file.")] = None,
) -> None:
    """Print the JSON Schema of the trace or finding format."""
    from kvfuzz import traces
    schemas = traces.json_schemas()
    if kind not in schemas:
        raise BadInput(f"unknown schema {kind!r} (choose from {', '.join(schemas)})", field="kind")
    text = json.dumps(schemas[kind], indent=2, sort_keys=True) + "\n"
    if out:
        traces.atomic_write_text(out, text)
        console.print(f"wrote {out}")
    else:
        sys.stdout.write(text)


@model_app.command("build")
def model_build(
    out: Annotated[Optional[Path], typer.Option(help="Directory (default: the kvfuzz cache).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the embedded tiny Qwen2 model, tokenizer and LoRA adapters (with a second weight
    variant of each, embedded:NAME@v2), and next to them the hybrid model embedded:tiny-hybrid
    (deterministic)."""
    from kvfuzz.harness import embedded

    m = embedded.build(out, force=force)
    console.print(f"model    {m.model_dir}")
    for name, p in m.adapters.items():
        console.print(f"adapter  {name}: {p}")
    console.print(f"content hash {m.content_hash}")
    # Weight variants for adapter reloads (embedded:NAME@v2): the lifecycle generator draws them.
    vroot = out.with_name(out.name + "-variants") if out else None
    for name in m.adapters:
        v = embedded.build_variant(name, 2, root=vroot)
        console.print(f"variant  embedded:{name}@v2: {v} (content hash {embedded.adapter_hash(v)})")
    # With --out, the hybrid model goes into a sibling directory of the default's.
    h = embedded.build_hybrid(out.with_name(out.name + "-hybrid") if out else None, force=force)
    console.print(f"hybrid   {h.model_dir}")
    console.print(f"content hash {h.content_hash}")


