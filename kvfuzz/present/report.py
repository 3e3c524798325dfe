"""Issue-ready reports of findings: markdown for a bug tracker, rich for the terminal.

One document model (headings, paragraphs, tables, code) is built from the finding and then
rendered twice, so the terminal shows exactly what the markdown says. Presentation: it reads
what the oracle decided (the Finding, ``oracle.noise.finding_bounds``) and judges nothing;
imports neither torch nor vLLM (rich is imported only to render).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfuzz.traces import (BisectRecord, CancelEvent, Divergence, Finding, GenPrompt, History, RequestRecord,
                            ResetPrefixCacheEvent, SendEvent, TokenPrompt)
from kvfuzz.traces.finding import DIVERGENT_CLASSES, SEVERITY

from kvfuzz.driver.arms import replay_command, replay_engine_args
from kvfuzz.oracle.check import ENGINE
from kvfuzz.oracle.controls import primary_arm, reproducing_arms, signature_of
from kvfuzz.oracle.noise import NoiseBounds, finding_bounds
from kvfuzz.oracle.postconditions import witness
from kvfuzz.present.buckets import membership_text
from kvfuzz.present.style import CLASS_STYLE

# A release's status in a bisection (kvfuzz bisect).
STATUS_STYLE = {"bad": "bold red", "good": "green", "unavailable": "yellow", "error": "magenta", "masked": "yellow", "not": "dim"}

# Text segments: (text, style) where style is "", "b" (bold), "code", or a verdict class.
Seg = tuple[str, str]


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    segs: list[Seg]


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    # Column whose cells are verdict classes (styled in the terminal).
    class_col: int | None = None
    right: tuple[int, ...] = ()
    # Columns that may wrap in a narrow terminal (the others stay on one line).
    wrap: tuple[int, ...] = ()


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Code:
    text: str
    lang: str = "bash"


@dataclass
class Report:
    title: str
    blocks: list[Any] = field(default_factory=list)

    def h(self, text: str, level: int = 2) -> None:
        self.blocks.append(Heading(text, level))

    def p(self, *segs: Seg | str) -> None:
        self.blocks.append(Para([(s, "") if isinstance(s, str) else s for s in segs]))

    def table(self, columns: list[str], rows: list[list[str]], **kw: Any) -> None:
        if rows:
            self.blocks.append(Table(columns, rows, **kw))


# -- small formatters ---------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _rate(d: Divergence) -> str:
    return f"{d.runs_diverged}/{d.runs} ({_pct(d.rate_low)}–{_pct(d.rate_high)})"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "—" if x is None else format(x, fmt)


def _prefix(s: SendEvent) -> str:
    p = s.prompt
    if isinstance(p, GenPrompt) and p.prefix_len:
        return f"{p.prefix_group}[:{p.prefix_len}]"
    return "—"


def _adapter(a: str | None) -> str:
    return a if a else "base"


EVIDENCE_WORDS = {"margin": "the pair shift at the first differing token", "drift": "the drift before it",
                  "teacher": "teacher forcing over the whole run"}


def _evidence(d: Divergence, b: NoiseBounds) -> str:
    """What each piece of evidence said about ``d``, with its bound."""
    parts = []
    if d.margin is not None:
        shift = d.margin + (d.run_margin or 0.0)
        run = f" + the run's own margin {d.run_margin:.3g}" if d.run_margin is not None else ""
        parts.append(f"pair shift {shift:.3g} nats (reference margin {d.margin:.3g}{run}; bound {b.near_tie:.3g})")
    else:
        parts.append("reference margin unknown")
    if d.drift is not None:
        parts.append(f"drift before it {d.drift:.3g} (bound {b.drift:.3g})")
    if d.teacher_drift is not None:
        parts.append(f"teacher-forced drift up to {d.teacher_drift:.3g} at {d.teacher_over or 0} position(s) over "
                     f"the bound {b.teacher:.3g}")
    else:
        parts.append("not scored by teacher forcing")
    return "; ".join(parts)


def _diverged_run(finding: Finding, d: Divergence) -> tuple[History, RequestRecord] | None:
    """The first run of the verdict's arm where the request diverged at its first divergence."""
    ref = finding.references.get(d.request_id)
    for h in finding.runs:
        if h.arm != d.arm:
            continue
        rec = h.requests.get(d.request_id)
        if rec is None or ref is None or d.first_divergence is None:
            continue
        i = d.first_divergence
        got = rec.token_ids[i] if i < len(rec.token_ids) else None
        want = ref.token_ids[i] if i < len(ref.token_ids) else None
        if got != want:
            return h, rec
    return None


def _lp(rec: RequestRecord, i: int, k: int) -> tuple[str, str]:
    if i < len(rec.logprobs) and len(rec.logprobs[i]) > k:
        t, lp = rec.logprobs[i][k]
        return str(t), f"{lp:.4f}"
    return "—", "—"


def finding_replay_command(finding: Finding, path: str, arm: str, toggles: list[str]) -> str:
    """``kvfuzz replay`` of the finding's arm, as many runs as it had, on its engine."""
    runs = max(1, sum(1 for h in finding.runs if h.arm == arm))
    env = finding.environment
    return replay_command(path, arm, toggles, runs, replay_engine_args(env.engine, env.device))


# -- the report ----------------------------------------------------------------------------------


def build(finding: Finding, *, source: str = "FINDING.json",
          toggles_known: Mapping[str, tuple[str, str]] | None = None) -> Report:
    """The report of ``finding``. ``toggles_known`` maps a toggle name to (kind, what it
    models) for the toggles section (the CLI passes the registry's; without it the report
    names toggles without describing them)."""
    known = toggles_known or {}

    def _toggle_info(name: str) -> tuple[str, str]:
        return known.get(name, ("?", ""))

    worst, victims = signature_of(finding)
    arm, toggles = primary_arm(finding)
    trace = finding.trace
    verdicts = finding.verdicts or finding.divergences
    by_req = {v.request_id: v for v in verdicts if v.arm == arm}
    victim_divs = sorted((d for d in finding.divergences if d.class_ == worst and d.request_id in victims
                          and d.arm == arm), key=lambda d: (-(d.runs_diverged / max(1, d.runs)), d.request_id))
    bounds = finding_bounds(finding)
    explained = sorted({d.explained_by for d in finding.divergences if d.explained_by})
    who = ", ".join(f"`{v}`" for v in sorted(victims)) or "no request"
    r = Report(title=f"kvfuzz finding {finding.id}: {worst} in {who.replace('`', '')}")

    # Summary and verdict
    r.h(r.title, 1)
    r.h("Summary")
    if worst == "ok":
        r.p("No request diverged: the finding has no divergence to report.")
    for d in victim_divs[:3]:
        send = trace.send(d.request_id) if d.request_id != ENGINE else None
        what = (f" ({_adapter(send.adapter)}, {send.prompt.length}-token prompt, {send.max_tokens} new "
                f"token{'s' if send.max_tokens != 1 else ''})" if send else "")
        # A stall is judged on the schedule, not against the reference's tokens.
        how = (" waited longer than vLLM's scheduler allows while other requests were served"
               if d.class_ == "stall" else " diverged from its reference (the same request alone on a clean cache)")
        r.p((worst, worst), ": request ", (d.request_id, "code"), what,
            f"{how} in {d.runs_diverged} of "
            f"{d.runs} runs (Wilson 95% interval {_pct(d.rate_low)}–{_pct(d.rate_high)}), "
            f"{d.variants} distinct output{'s' if d.variants != 1 else ''}.")
        w = next((x for h in finding.runs if h.arm == d.arm
                  for x in [witness(h.breaks, d.request_id)] if x is not None), None)
        ref = finding.references.get(d.request_id)
        in_ref = w is None and ref is not None and (w := witness(ref.breaks, d.request_id)) is not None
        if w is not None:
            root = f" (its block's prefix-cache entry had broken first: {w.root})" if w.root else ""
            where = " of its reference run (the request alone): the reference is the corrupted side" if in_ref else ""
            r.p("vLLM's own state broke first at engine step ", (str(w.step), "code"), where, ": ", (w.name, "code"),
                f" — {w.detail}{root}. docs/oracle.md, \"Broken post-conditions\", says what each name means.")
        if d.first_divergence is not None:
            decided = [EVIDENCE_WORDS.get(e, e.replace("control:", "the control arm ")
                                          .replace("postcondition:", "vLLM's broken post-condition "))
                       for e in d.evidence]
            if worst == "corruption" and decided:
                verdict = "Not floating-point noise, by " + ", ".join(decided)
            elif worst == "corruption":
                verdict = "Not floating-point noise"
            else:
                verdict = "Every piece of evidence is within its noise bound: batch-order floating-point noise can explain it"
            r.p(f"The first differing token is #{d.first_divergence}: {_evidence(d, bounds)}. {verdict} "
                f"({trace.engine.dtype}; {bounds.describe()}).")
        elif d.detail:
            r.p(d.detail)
    if len(victim_divs) > 3:
        r.p(f"… and {len(victim_divs) - 3} more victims (see Verdicts).")
    m = finding.minimization
    if m:
        eng = "; engine: " + ", ".join(f"{k} {a} → {b}" for k, (a, b) in m.engine_changes.items()) \
            if m.engine_changes else ""
        r.p(("Minimized", "b"), f": {m.original_requests} → {m.requests} requests ({m.original_events} → "
            f"{m.events} events) in {m.replays} replays, keeping signature ", (m.signature or "?", "code"),
            f"; {'verified by a fresh replay' if m.verified else 'NOT verified by a fresh replay'}{eng}. "
            f"Original finding: ", (m.original or "?", "code"), ".")
    arms_ok = reproducing_arms(finding)
    if arms_ok:
        r.p(("Reproduces in", "b"), ": " + ", ".join(arms_ok) + ".")
    for c in finding.controls:
        if not c.available:
            r.p((f"Control {c.name}", "b"), f": not available — {c.detail}.")
        else:
            why = {("serialized", False): " — concurrency (batching) is part of the trigger",
                   ("serialized", True): " — no concurrency needed: state one request leaves for the next",
                   ("batch-invariant", True): " — not batch-order numerics",
                   ("batch-invariant", False): " — consistent with batch-order numerics"}.get((c.name, c.reproduced), "")
            r.p((f"Control {c.name}", "b"), f": {'reproduces' if c.reproduced else 'does not reproduce'}{why}.")
    if explained:
        r.p(("Attribution", "b"), ": explained by toggle " + ", ".join(explained) + ".")
    elif worst in DIVERGENT_CLASSES:
        faults = [t for t in toggles if _toggle_info(t)[0] == "fault"]
        if faults:
            r.p(("Attribution", "b"), f": arm {arm!r} runs with fault toggle(s) {', '.join(faults)}.")
        else:
            r.p(("Attribution", "b"), ": unexplained by any kvfuzz toggle — a candidate vLLM bug.")

    if finding.explanation is not None:
        r.p(("Causal ablation", "b"), f": {finding.explanation.summary()} (see below).")
    if finding.bisect is not None:
        r.p(("Releases", "b"), f": {bisect_summary(finding.bisect)} (see Release bisection).")
    for mb in finding.buckets:
        r.p(("Bucket", "b"), ": ", (mb.bucket, "code"), f" — {membership_text(mb)}.")

    # Environment
    env = finding.environment
    r.h("Environment")
    rows = [["kvfuzz", env.kvfuzz_version], ["vLLM", env.vllm_version or "?"], ["torch", env.torch_version or "?"],
            ["python", env.python or "?"], ["platform", env.platform or "?"], ["device", env.device],
            ["engine", env.engine], ["model", f"{env.model or trace.engine.model}"
                                     + (f" (content hash {env.model_hash})" if env.model_hash else "")]]
    e = trace.engine
    rows += [["dtype", e.dtype], ["block_size", str(e.block_size)], ["max_model_len", str(e.max_model_len)],
             ["prefix caching", "on" if e.enable_prefix_caching else "off"],
             ["chunked prefill", "on" if e.enable_chunked_prefill else "off"],
             ["max_num_seqs / max_num_batched_tokens", f"{e.max_num_seqs} / {e.max_num_batched_tokens}"],
             ["KV cache", f"{e.kv_cache_bytes / 2**20:g} MiB" if e.kv_cache_bytes else "default"]]
    if e.lora.enabled:
        rows.append(["LoRA", f"max_loras {e.lora.max_loras}, max_lora_rank {e.lora.max_lora_rank}, adapters "
                             + ", ".join(f"{k}={v}" for k, v in sorted(e.lora.adapters.items()))])
    if e.extra_args:
        rows.append(["extra engine args", json.dumps(e.extra_args, sort_keys=True)])
    rows.append(["toggles", ", ".join(env.toggles) or "none"])
    r.table(["", ""], rows, wrap=(1,))

    # The trace
    r.h("Trace" + (" (minimized)" if m else ""))
    rows = []
    mps = e.ms_per_step
    for i, ev in enumerate(trace.events):
        v = by_req.get(getattr(ev, "request_id", ""))
        if isinstance(ev, SendEvent):
            diverged = f"{v.class_} {v.runs_diverged}/{v.runs}" if v and v.class_ in DIVERGENT_CLASSES else (
                v.class_ if v else "—")
            plen = str(ev.prompt.length) + (" (token ids)" if isinstance(ev.prompt, TokenPrompt) else "")
            rows.append([str(i), "send", ev.request_id, _when(ev, mps), plen, _prefix(ev), _adapter(ev.adapter),
                         str(ev.max_tokens), diverged])
        elif isinstance(ev, CancelEvent):
            rows.append([str(i), "cancel", ev.request_id, _when(ev, mps), "", "", "", "", ""])
        elif isinstance(ev, ResetPrefixCacheEvent):
            what = "all running" if ev.reset_running_requests else ""  # preempted and recomputed
            rows.append([str(i), ev.kind, what, _when(ev, mps), "", "", "", "", ""])
        else:  # an adapter lifecycle event: the adapter column names it and the weights it binds
            bound = getattr(ev, "source", None)
            what = ev.name + (f" ← {bound}" if bound else "") + (" (same path)" if getattr(ev, "same_path", False)
                                                                   else "")
            rows.append([str(i), ev.kind, "", _when(ev, mps), "", "", what, "", ""])
    r.table(["#", "event", "request", "step / offset", "prompt len", "prefix", "adapter", "max_tokens", "diverged"],
            rows, class_col=8, right=(0, 4, 7))
    if any(isinstance(ev, SendEvent) and isinstance(ev.prompt, GenPrompt) for ev in trace.events):
        r.p("Prompts are generated deterministically from (length, prefix group, prefix_len, seed) by "
            "traces/prompts.py; the finding file carries the full specification.")

    # Per-request verdicts
    r.h("Verdicts")
    rows = []
    for v in sorted(verdicts, key=lambda v: (v.arm != arm, v.arm, SEVERITY[v.class_], v.request_id)):
        rows.append([v.arm, v.request_id, v.class_, _rate(v), _num(v.first_divergence, "d")
                     if v.first_divergence is not None else "—", _num(v.margin), str(v.variants),
                     v.explained_by or ("—" if v.class_ not in DIVERGENT_CLASSES else "unexplained"),
                     (v.detail or "")[:160]])
    r.table(["arm", "request", "class", "diverged (95% CI)", "first token", "margin", "variants", "explained by",
             "detail"], rows, class_col=2, right=(4, 5, 6), wrap=(8,))
    r.p("Classes: corruption = a differing token that some evidence says is not noise (the pair shift "
        f"at it >= {bounds.near_tie:.3g}, the drift before it > {bounds.drift:.3g}, or the teacher-forced drift > "
        f"{bounds.teacher:.3g} nats); stall = the request waited for a token longer than vLLM's scheduler allows "
        "while others were served; numeric-near-tie = every piece within its bound; truncation = a cancelled "
        "or shorter stream that agrees with the reference as far as it goes (not a divergence). See docs/oracle.md.")

    # Tokens around the first divergence
    shown = 0
    for d in victim_divs:
        if shown >= 3 or d.first_divergence is None:
            continue
        run = _diverged_run(finding, d)
        ref = finding.references.get(d.request_id)
        if run is None or ref is None:
            continue
        h, rec = run
        shown += 1
        i0 = d.first_divergence
        r.h(f"First divergence of {d.request_id} (token #{i0}, run {h.run_index} of arm {h.arm})", 3)
        rows = []
        for i in range(max(0, i0 - 3), min(max(len(ref.token_ids), len(rec.token_ids)), i0 + 5)):
            rt, rl = _lp(ref, i, 0)
            r2, r2l = _lp(ref, i, 1)
            gt, gl = _lp(rec, i, 0)
            ref_tok = str(ref.token_ids[i]) if i < len(ref.token_ids) else "—"
            got_tok = str(rec.token_ids[i]) if i < len(rec.token_ids) else "—"
            margin = "—" if rl == "—" or r2l == "—" else f"{float(rl) - float(r2l):.4f}"
            mark = "◀ first divergence" if i == i0 else ("differs" if ref_tok != got_tok else "")
            rows.append([str(i), ref_tok, rl, f"{r2} ({r2l})", margin, got_tok, gl, mark])
        r.table(["pos", "reference", "logprob", "runner-up (logprob)", "margin", "run", "logprob", ""], rows,
                right=(0, 2, 4, 6))

    # Controls
    if finding.controls:
        r.h("Control arms")
        rows = []
        for c in finding.controls:
            rates = "; ".join(f"{v.request_id} {v.class_} {_rate(v)}, {v.variants} variant"
                              f"{'s' if v.variants != 1 else ''}" for v in c.verdicts if v.request_id in victims) or "—"
            rows.append([c.name, "yes" if c.available else "no",
                         ("yes" if c.reproduced else "no") if c.available else "—",
                         ", ".join(c.toggles) or "none", rates, c.detail or ""])
        r.table(["control", "available", "reproduces", "toggles", "victims", "detail"], rows, wrap=(3, 4, 5))
        r.p("serialized = the same requests one at a time, no cancels; batch-invariant = VLLM_BATCH_INVARIANT=1.")

    # Toggles and attribution
    r.h("Toggles and attribution")
    rows = []
    for a, ts in finding.arms.items():
        info = "; ".join(f"{t} ({_toggle_info(t)[0]})" for t in ts) or "none (vLLM as installed)"
        hit = "yes" if a in arms_ok else "no"
        rows.append([a, info, hit])
    r.table(["arm", "toggles", "reproduces"], rows, wrap=(1,))
    for t in sorted({t for ts in finding.arms.values() for t in ts}):
        kind, what = _toggle_info(t)
        if what:
            r.p((t, "code"), f" ({kind}): {what}")
    expl = [d for d in finding.divergences if d.explained_by]
    if expl:
        r.table(["arm", "request", "class", "explained by"],
                [[d.arm, d.request_id, d.class_, d.explained_by or ""] for d in expl], class_col=2)
    attribution = finding.attribution
    if attribution is not None:
        r.p("Attribution recorded with the finding:")
        r.blocks.append(Code(json.dumps(attribution.model_dump(), indent=2, sort_keys=True, default=str), "json"))

    # Causal ablation
    ex = finding.explanation
    if ex is not None:
        r.h("Causal ablation")
        r.p(f"The finding replayed with one engine mechanism taken away at a time, judged on "
            f"{ex.victim} ({ex.cls}, arm {ex.arm}); \"disappears\" means the mechanism is needed. "
            f"{ex.replays} replays, {ex.seconds:g} s.")
        r.table(["mechanism", "taken away", "outcome", "victim"],
                [[a.mechanism, a.change, a.outcome, " — ".join(filter(None, [a.victim_class, a.detail]))] for a in ex.ablations],
                wrap=(1, 3))
        r.p(ex.summary() + ".")

    if finding.bisect is not None:
        add_bisect(r, finding.bisect)

    # Minimization details
    if m:
        r.h("Minimization")
        rows = [["original finding", m.original or "?"], ["signature kept", m.signature or "?"],
                ["arm (toggles)", f"{m.arm} ({', '.join(m.toggles) or 'none'})"],
                ["acceptance", f"reproduce in >= {m.min_hits} of {m.repeats} replays per candidate"],
                ["replays", f"{m.replays} (+ {m.reference_runs} reference runs)"], ["seconds", f"{m.seconds:g}"],
                ["verified", "yes" if m.verified else "no"]]
        if m.stopped:
            rows.append(["stopped early", m.stopped])
        orig_file = finding.provenance.minimized_from.file if finding.provenance.minimized_from else None
        if orig_file:
            rows.append(["original file", orig_file])
        r.table(["", ""], rows, wrap=(1,))
        if m.passes:
            r.blocks.append(Bullets(list(m.passes)))

    # Replay
    r.h("Replay")
    r.blocks.append(Code(finding_replay_command(finding, source, arm, toggles)))
    if not m:
        r.p("Shrink it first with ", (f"kvfuzz minimize {source} -o minimized.json", "code"), ".")
    r.p(f"Finding {finding.id}, signature ", (finding.signature(), "code"),
        f", created {finding.created or '?'}; the finding file holds every run's history and the references.")
    return r


def _when(ev: Any, mps: float) -> str:
    at = ev.at
    parts = []
    if at.step is not None:
        parts.append(f"step {at.step}")
    if at.offset_ms is not None:
        parts.append(f"{at.offset_ms:g} ms")
    if at.after_tokens is not None:
        parts.append(f"after {at.after_tokens} tokens")
    return " / ".join(parts)


# -- release bisection (kvfuzz bisect, triage/bisect.py) ------------------------------------------

BISECT_COLUMNS = ["release", "probe", "status", "reproduced", "95% interval", "seconds", "detail"]


def bisect_rows(rec: BisectRecord) -> list[list[str]]:
    """One row per release searched, oldest first; those the search did not probe say so."""
    rows = []
    for v in rec.versions:
        r = rec.result(v)
        if r is None:
            rows.append([v, "—", "not probed", "—", "—", "—", ""])
        elif r.status in ("bad", "good"):
            rows.append([v, str(r.order), r.status, f"{r.k}/{r.runs}", f"{_pct(r.rate_low)}–{_pct(r.rate_high)}",
                         f"{r.seconds:.1f}", r.detail or ""])
        else:
            rows.append([v, str(r.order), r.status, "—", "—", f"{r.seconds:.1f}" if r.seconds else "—",
                         r.detail or ""])
    return rows


def bisect_lines(rec: BisectRecord) -> list[str]:
    """The answer: the verdict line, then ``first bad:`` / ``first good:``."""
    lines = [f"verdict: {rec.verdict}" + (f" — {rec.detail}" if rec.detail else "")]
    if rec.first_bad:
        lines.append(f"first bad: {rec.first_bad}" + (f" (last good: {rec.last_good})" if rec.last_good else ""))
    if rec.first_good:
        lines.append(f"first good: {rec.first_good}" + (f" (last bad: {rec.last_bad})" if rec.last_bad else ""))
    return lines


def bisect_summary(rec: BisectRecord) -> str:
    if rec.verdict == "regression":
        return f"regression, first bad release {rec.first_bad} (last good {rec.last_good})"
    if rec.verdict == "fixed":
        return f"fixed in {rec.first_good} (last bad {rec.last_bad})"
    if rec.verdict == "regression, then fixed":
        return f"bad from {rec.first_bad} (last good {rec.last_good}), fixed in {rec.first_good} (last bad {rec.last_bad})"
    return rec.verdict


def bisect_how(rec: BisectRecord) -> str:
    """How the releases were probed, in one sentence."""
    mods = [f"--with {t}" for t in rec.with_] + [f"--without {t}" for t in rec.without]
    arms = rec.arms + (" " + " ".join(mods) if mods else "")
    if rec.arms == "vanilla" and not mods:
        arms += " (vLLM as shipped, no toggles)"
    where = {"inprocess": "in-process engine", "server": "managed vLLM server"}.get(rec.engine, rec.engine)
    how = f"{rec.device}" + (f", {rec.dtype}" if rec.dtype else "")
    probed = len(rec.results)
    return (f"{rec.runs} run{'s' if rec.runs != 1 else ''} per release on the {where} ({how}), arms {arms}; a "
            f"release is bad when a victim request diverged in at least {rec.min_hits} of {rec.runs} runs. "
            f"Probed {probed} of {len(rec.versions)} releases ({rec.versions[0]} to {rec.versions[-1]})"
            + (", every one (--exhaustive)." if rec.exhaustive else
               "; the search probes both ends, then binary-searches the transition."))


def add_bisect(r: Report, rec: BisectRecord) -> None:
    """The report's section on a bisection."""
    r.h("Release bisection")
    r.p(("Verdict", "b"), f": {rec.verdict}" + (f" — {rec.detail}." if rec.detail else "."))
    if rec.first_bad:
        last_good: list[Seg | str] = [" (last good: ", (rec.last_good, "code"), ")"] if rec.last_good else []
        r.p(("first bad", "b"), ": ", (rec.first_bad, "code"), *last_good)
    if rec.first_good:
        last_bad: list[Seg | str] = [" (last bad: ", (rec.last_bad, "code"), ")"] if rec.last_bad else []
        r.p(("first good", "b"), ": ", (rec.first_good, "code"), *last_bad)
    r.table(BISECT_COLUMNS, bisect_rows(rec), class_col=2, right=(1, 3, 5), wrap=(6,))
    r.p(bisect_how(rec) + f" Bisected {rec.created or '?'} with kvfuzz {rec.kvfuzz_version or '?'}.")


# -- renderers -----------------------------------------------------------------------------------


def md_cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, pipes escaped)."""
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: Report) -> str:
    out: list[str] = []
    for b in report.blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            s = ""
            for text, style in b.segs:
                if style == "code":
                    s += f"`{text}`"
                elif style == "b" or style in CLASS_STYLE:
                    s += f"**{text}**"
                else:
                    s += text
            out.append(s)
        elif isinstance(b, Table):
            out.append("| " + " | ".join(b.columns) + " |")
            out.append("| " + " | ".join("---:" if i in b.right else "---" for i in range(len(b.columns))) + " |")
            for row in b.rows:
                out.append("| " + " | ".join(md_cell(c) for c in row) + " |")
        elif isinstance(b, Bullets):
            out.extend(f"- {item}" for item in b.items)
        elif isinstance(b, Code):
            out.append(f"```{b.lang}\n{b.text}\n```")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def to_rich(report: Report) -> list[Any]:
    from rich import box
    from rich.rule import Rule
    from rich.syntax import Syntax
    from rich.table import Table as RTable
    from rich.text import Text

    out: list[Any] = []
    for b in report.blocks:
        if isinstance(b, Heading):
            out.append(Text(""))
            out.append(Rule(Text(b.text, style="bold cyan"), align="left") if b.level <= 2
                       else Text(b.text, style="bold"))
        elif isinstance(b, Para):
            t = Text()
            for text, style in b.segs:
                t.append(text, style={"b": "bold", "code": "cyan", "": ""}.get(style, CLASS_STYLE.get(style, "")))
            out.append(t)
        elif isinstance(b, Table):
            kv = all(not c for c in b.columns)
            tb = RTable(box=box.SIMPLE_HEAD, show_header=not kv, header_style="bold", pad_edge=False)
            for i, c in enumerate(b.columns):
                tb.add_column(c, justify="right" if i in b.right else "left", style="bold" if kv and i == 0 else None,
                              no_wrap=i not in b.wrap, overflow="fold")
            for row in b.rows:
                cells: list[Any] = list(row)
                if b.class_col is not None and b.class_col < len(row):
                    cls = row[b.class_col].split(" ")[0]
                    cells[b.class_col] = Text(row[b.class_col], style=CLASS_STYLE.get(cls) or STATUS_STYLE.get(cls, ""))
                tb.add_row(*cells)
            out.append(tb)
        elif isinstance(b, Bullets):
            out.append(Text("\n".join(f"  • {item}" for item in b.items)))
        elif isinstance(b, Code):
            out.append(Syntax(b.text, b.lang, word_wrap=True, theme="ansi_dark", background_color="default"))
    return out


def markdown(finding: Finding, *, source: str = "FINDING.json",
             toggles_known: Mapping[str, tuple[str, str]] | None = None) -> str:
    return to_markdown(build(finding, source=source, toggles_known=toggles_known))
