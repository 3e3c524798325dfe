"""The bucket acceptance matrix: a 3-minute campaign per built-in fault, per test fault
(tests/unseen_faults/), per pair of test faults on at once, and clean partners, two at a time;
then one summary row per campaign: corruption buckets (complete / provisional), findings,
traces/min against its clean partner, and triage's share of the campaign.

    python benchmarks/fault_matrix.py run OUTDIR [--only NAME,...] [--parallel 2] [--budget 180]
    python benchmarks/fault_matrix.py table OUTDIR

A campaign that completed is not run again (delete its directory to re-run it). Every campaign
is `kvfuzz run --seed 1 --budget B` with ``KVFUZZ_REFERENCE_CACHE=off``; test faults through
``PYTHONPATH=tests KVFUZZ_PLUGIN_MODULES=unseen_faults.<module>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVFUZZ = str(Path(sys.executable).with_name("kvfuzz"))

# name -> (test fault modules, extra arguments, clean partner)
CLEAN = {"clean": ([], [], None), "clean-arms": ([], ["--arms", "clean"], None),
         "clean-lora": ([], ["--lora", "--arms", "clean"], None),
         "clean-hybrid": ([], ["--model", "embedded:tiny-hybrid"], None),
         "clean-bf16": ([], ["--dtype", "bfloat16"], None)}
BUILTIN = {"b-cancel": ([], ["--with", "fault-cancel-frees-shared-blocks"], "clean-arms"),
           "b-prefix": ([], ["--with", "fault-prefix-hit-before-write"], "clean-arms"),
           "b-preempt": ([], ["--with", "fault-preempt-resume-stale-blocks"], "clean-arms"),
           "b-lorahash": ([], ["--lora", "--with", "fault-lora-hash-namespace"], "clean-lora"),
           "b-crossgroup": ([], ["--model", "embedded:tiny-hybrid", "--with", "fault-cross-group-one-phase"],
                            "clean-hybrid"),
           "b-lorabug": ([], ["--lora"], "clean-lora")}
LORA = ["--lora", "--arms", "clean"]
SINGLE = {"P": "evict_keeps_hash", "Q": "short_hash_lookup", "R": "hit_last_block_repeated",
          "S": "register_overwrites", "T": "row_move_drops_last_block", "U": "hit_takes_no_reference",
          "V": "append_repeats_first_block", "W": "new_block_slot_in_previous",
          "Y": "decode_reads_neighbours_last_block", "Z": "chunk_start_slot_before",
          "AA": "moved_row_keeps_stale_last_token", "AB": "hash_covers_half_block",
          "AC": "hit_counts_one_block_more", "AD": "window_drops_one_block_early", "AE": "moved_row_drops_adapter",
          "AF": "moved_row_count_one_short", "AG": "abort_caches_partial_block", "AH": "mixed_decode_misses_own_key",
          "AI": "continuing_prefill_positions_early", "AJ": "write_drops_batch_last_token",
          "AK": "prefill_samples_neighbours_row", "AL": "readded_row_keeps_stale_tokens",
          "AM": "prefill_first_token_neighbours_adapter", "AO": "mixed_batch_loses_causal_mask",
          "AP": "block_opening_decode_takes_neighbours_token", "AQ": "returning_adapter_skips_its_weights",
          "AR": "preempting_step_drops_first_write", "AS": "finished_output_swaps_with_next",
          "AT": "batched_rows_lose_precision", "AU": "newest_running_left_out", "AV": "rejected_draft_stays_counted"}
# U needs a small cache to corrupt an output (8 MiB holds a 4096-token request, not 16384). AV
# lives on drafting traces, where vanilla 0.32.0 crashes first (docs/findings.md #7, #8): the
# clean arm holds their fixes.
EXTRA = {"U": ["--kv-cache-mb", "8", "--max-model-len", "4096"], "AD": ["--model", "embedded:tiny-hybrid"], "AE": LORA,
         "AM": LORA, "AQ": LORA, "AV": ["--arms", "clean"]}
PARTNER = {"AD": "clean-hybrid", "AE": "clean-lora", "AM": "clean-lora", "AQ": "clean-lora"}
PAIRS = ["Y+P", "T+S", "P+S", "T+U", "AJ+AH", "AK+AI", "AK+AJ", "AL+AK", "AL+AI", "AM+AE", "AP+AO", "P+Q"]
BF16 = ["Y", "AJ", "AS", "AO"]


def jobs() -> dict[str, tuple[list[str], list[str], str | None]]:
    out = dict(CLEAN)
    out.update(BUILTIN)
    for k, m in SINGLE.items():
        out[k] = ([m], EXTRA.get(k, []), PARTNER.get(k, "clean"))
    for pair in PAIRS:
        a, b = pair.split("+")
        extra = EXTRA.get(a, []) or EXTRA.get(b, [])
        out[pair] = ([SINGLE[a], SINGLE[b]], extra, PARTNER.get(a, "clean"))
    for k in BF16:
        out[f"{k}-bf16"] = ([SINGLE[k]], [*EXTRA.get(k, []), "--dtype", "bfloat16"], "clean-bf16")
    out["b-preempt-bf16"] = ([], ["--dtype", "bfloat16", "--with", "fault-preempt-resume-stale-blocks"], "clean-bf16")
    return out


def run_one(name: str, out: Path, budget: int) -> str:
    mods, extra, _ = jobs()[name]
    d = out / name
    state = d / "campaign.json"
    if state.is_file() and json.loads(state.read_text()).get("complete"):
        return f"{name}: done before"
    env = {**os.environ, "KVFUZZ_REFERENCE_CACHE": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
           "KVFUZZ_PLUGIN_MODULES": ",".join(f"unseen_faults.{m}" for m in mods)}
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        p = subprocess.run([KVFUZZ, "run", "--seed", "1", "--budget", str(budget), *extra, "--out", str(d)],
                           env=env, stdout=log, stderr=subprocess.STDOUT, timeout=budget * 4)
    return f"{name}: exit {p.returncode} in {time.monotonic() - t0:.0f} s"


def summary(out: Path, name: str) -> dict | None:
    state = out / name / "campaign.json"
    if not state.is_file():
        return None
    d = json.loads(state.read_text())
    if not d.get("complete"):
        return None
    bugs = [b for b in d.get("bug_buckets", {}).values() if b["key"]["class"] == "corruption"]
    other: Counter[str] = Counter()  # findings of the other classes but near ties
    for b in d.get("bug_buckets", {}).values():
        if b["key"]["class"] not in ("corruption", "numeric-near-tie"):
            other[b["key"]["class"]] += b["count"]
    t = d.get("time") or {}
    return {"traces": d["traces"], "rate": 60 * d["traces"] / max(1.0, d["seconds"]),
            "complete": sorted((b["count"] for b in bugs if not b["key"].get("provisional")), reverse=True),
            "provisional": sum(b["count"] for b in bugs if b["key"].get("provisional")),
            "names": sorted({b["key"].get("broke") or b["key"].get("explained_by") or
                             "needs " + (",".join(m for m, o in b["key"]["verdicts"].items() if o == "disappears")
                                         or "none") for b in bugs if not b["key"].get("provisional")}),
            "other": ", ".join(f"{c} {n}" for c, n in sorted(other.items())),
            "triage": t.get("triage_s", 0.0) / max(1.0, t.get("wall_s", d["seconds"])),
            "findings": d["findings"]}


def table(out: Path) -> str:
    rows = ["| campaign | corruption buckets: complete (findings) + provisional | key | traces/min (× partner) | "
            "triage share | other findings |", "| --- | --- | --- | --- | --- | --- |"]
    every = jobs()
    for name, (_, _, partner) in every.items():
        s = summary(out, name)
        if s is None:
            continue
        p = summary(out, partner) if partner else None
        ratio = f" ({s['rate'] / p['rate']:.2f}×)" if p else ""
        buckets = " + ".join(str(n) for n in s["complete"]) or "0"
        prov = f" + provisional ({s['provisional']})" if s["provisional"] else ""
        rows.append(f"| {name} | {len(s['complete'])}{' + 1' if s['provisional'] else ''}: {buckets}{prov} | "
                    f"{', '.join(s['names']) or '—'} | {s['rate']:.1f}{ratio} | {100 * s['triage']:.0f} % | "
                    f"{s['other']} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("run", "table"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default="", help="comma-separated campaign names (default: all)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--budget", type=int, default=180)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "table":
        print(table(a.out))
        return
    # In the order asked: a fault and its clean partner next to each other run side by side.
    names = [n for n in a.only.split(",") if n in jobs()] if a.only else list(jobs())
    with ThreadPoolExecutor(a.parallel) as pool:
        for line in pool.map(lambda n: run_one(n, a.out, a.budget), names):
            print(line, flush=True)


if __name__ == "__main__":
    main()
