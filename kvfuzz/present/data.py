"""The data behind each picture: small pure functions from a Finding (or a campaign's or a gate
run's JSON) to plain dataclasses. No matplotlib here: ``draw`` turns these into figures, and the
tests check these on recorded histories (bar spans, marker steps, band values) without drawing.

Coordinates: on the in-process engine a schedule is in engine steps, step ``s`` occupying
``[s, s + 1)``; a send or cancel lands at the left edge of the step it precedes, what happens
during a step (first token, finish, preemption, prefix hit) at its middle. On a server or URL
(``History.engine != "inprocess"``) the schedule is in milliseconds from the trace start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfuzz.oracle.controls import primary_arm, signature_of
from kvfuzz.oracle.diff import margin_at
from kvfuzz.oracle.noise import NoiseBounds
from kvfuzz.oracle.noise import finding_bounds
from kvfuzz.traces import Divergence, EventRecord, Finding, GenPrompt, History, RequestRecord, Scoring, SendEvent
from kvfuzz.traces.buckets import buckets_from_state
from kvfuzz.traces.finding import DIVERGENT_CLASSES, MECHANISM_WORDS, SEVERITY

LIFECYCLE = ("load-adapter", "unload-adapter", "reload-adapter")
RESET = "reset-prefix-cache"


def reset_label(e: EventRecord, running: bool) -> str:
    """A prefix-cache reset where it landed: with the requests it preempted, or why it did nothing."""
    label = "reset prefix cache" + (" + running" if running else "")
    if e.preempted:
        label += f" (preempted {', '.join(e.preempted[:4])}{' …' if len(e.preempted) > 4 else ''})"
    if e.error:
        label += " (refused)"
    elif e.reset == "declined":
        label += " (declined: blocks held)"
    return label

# -- schedule --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """A stretch of a request's bar: ``prefill`` (steps that scheduled more than one of its
    tokens: its prompt, or a recompute after preemption), ``decode`` (one token a step),
    ``waiting`` (sent or preempted, not scheduled); on a server, ``to-first-token`` and
    ``decode``."""

    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class Marker:
    """send, first-token, cancel, finish, preempted, prefix-hit, error, first-divergence (the
    step that produced the first token differing from the reference). ``at`` is the step (or
    ms) the record names; ``x`` where it is drawn (see the module's coordinates)."""

    kind: str
    at: float
    x: float
    note: str = ""


@dataclass(frozen=True)
class Bar:
    request_id: str
    label: str
    adapter: str | None  # None: the base model
    prefix_group: str | None
    start: float
    end: float
    spans: tuple[Span, ...]
    markers: tuple[Marker, ...]
    verdict: str  # the request's class in the drawn arm ("—" when it has none)
    victim: bool  # a request of the finding's signature (its worst class)
    kept: bool | None = None  # kept by the minimizer (None: not a minimization question)

    def marker(self, kind: str) -> list[Marker]:
        return [m for m in self.markers if m.kind == kind]


@dataclass(frozen=True)
class Line:
    """An adapter lifecycle event or a prefix-cache reset where it landed: a vertical line
    labelled with the adapter (none for a reset)."""

    kind: str
    adapter: str
    at: float
    x: float
    label: str
    refused: bool = False


@dataclass(frozen=True)
class Schedule:
    unit: Literal["step", "ms"]
    title: str
    arm: str
    run_index: int
    bars: tuple[Bar, ...]
    lines: tuple[Line, ...]
    worst: str
    note: str = ""  # e.g. what the minimizer kept

    def bar(self, request_id: str) -> Bar:
        return next(b for b in self.bars if b.request_id == request_id)


def drawn_history(finding: Finding) -> History | None:
    """The run a picture shows: the first run of the finding's primary arm in which a victim
    diverged from its reference (else that arm's first run, else the first run)."""
    if not finding.runs:
        return None
    arm, _ = primary_arm(finding)
    _, victims = signature_of(finding)
    in_arm = [h for h in finding.runs if h.arm == arm] or list(finding.runs)
    for h in in_arm:
        if h.crashed:
            return h
        for rid in victims:
            rec, ref = h.requests.get(rid), finding.references.get(rid)
            if rec is not None and ref is not None and (rec.error or _differs(ref, rec, _max_tokens(finding, rid))):
                return h
    return in_arm[0]


def _max_tokens(finding: Finding, rid: str) -> int | None:
    try:
        return finding.trace.send(rid).max_tokens
    except (KeyError, StopIteration, ValueError):
        return None


def _differs(ref: RequestRecord, rec: RequestRecord, n: int | None) -> bool:
    a, b = ref.token_ids[:n], rec.token_ids[:n]
    return any(x != y for x, y in zip(a, b))


def _short_source(source: str) -> str:
    return source.removeprefix("embedded:")


def request_label(send: SendEvent | None, rid: str, rec: RequestRecord | None, initial: Mapping[str, str]) -> str:
    """``r5 · c · g1-0[:56]``: the request, its adapter (with the weights it ran with when a
    lifecycle event rebound the name), and its prefix group with the shared length."""
    adapter = (send.adapter if send else None) or (rec.adapter if rec else None)
    parts = [rid]
    if adapter:
        source = rec.adapter_source if rec else None
        parts.append(adapter if not source or source == initial.get(adapter) else
                     f"{adapter}={_short_source(source)}")
    else:
        parts.append("base")
    if send is not None and isinstance(send.prompt, GenPrompt) and send.prompt.prefix_group and send.prompt.prefix_len:
        parts.append(f"{send.prompt.prefix_group}[:{send.prompt.prefix_len}]")
    return " · ".join(parts)


def _merge(cells: Iterable[tuple[int, str]]) -> tuple[Span, ...]:
    spans: list[Span] = []
    for step, kind in cells:
        if spans and spans[-1].kind == kind and spans[-1].end == step:
            spans[-1] = Span(spans[-1].start, step + 1, kind)
        else:
            spans.append(Span(step, step + 1, kind))
    return tuple(spans)


def token_steps(rid: str, h: History) -> list[int]:
    """The step that produced each of ``rid``'s generated tokens, in order (in-process): every
    step that scheduled it, except the chunks of a split prefill that produce none."""
    return [s.step for s in h.steps if s.scheduled.get(rid) and rid not in s.partial_prefills]


def _step_bar(rid: str, rec: RequestRecord, h: History) -> tuple[float, float, tuple[Span, ...], list[Marker]]:
    tokens = {s.step: s.scheduled[rid] for s in h.steps if s.scheduled.get(rid)}
    preempted = [s.step for s in h.steps if rid in s.preempted]
    start = rec.sent_step if rec.sent_step is not None else min(tokens, default=0)
    last = max(tokens, default=start)
    if rec.finished_step is not None:
        end = max(rec.finished_step, last) + 1
    elif rec.cancel_step is not None:
        end = max(rec.cancel_step, last + 1 if tokens else start)
    else:
        end = last + 1 if tokens else start
    cells = [(s, "prefill" if tokens.get(s, 0) > 1 else "decode" if tokens.get(s) else "waiting")
             for s in range(start, end)]
    markers = [Marker("send", start, start)]
    if rec.first_token_step is not None:
        markers.append(Marker("first-token", rec.first_token_step, rec.first_token_step + 0.5))
    if tokens and rec.num_cached_tokens:
        admitted = min(tokens)
        markers.append(Marker("prefix-hit", admitted, admitted + 0.5, f"{rec.num_cached_tokens} cached"))
    markers += [Marker("preempted", s, s + 0.5) for s in preempted]
    if rec.cancel_step is not None:
        markers.append(Marker("cancel", rec.cancel_step, rec.cancel_step))
    if rec.finished_step is not None:
        markers.append(Marker("finish", rec.finished_step, rec.finished_step + 0.5))
    if rec.error:
        markers.append(Marker("error", end, end, rec.error[:80]))
    return start, end, _merge(cells), markers


def _ms_bar(rec: RequestRecord) -> tuple[float, float, tuple[Span, ...], list[Marker]]:
    start = rec.sent_ms if rec.sent_ms is not None else (rec.planned_offset_ms or 0.0)
    first = rec.first_token_ms
    end = next((x for x in (rec.finished_ms, rec.cancel_ms, first) if x is not None), start)
    end = max(end, start)
    spans: list[Span] = []
    if first is not None:
        if first > start:
            spans.append(Span(start, first, "to-first-token"))
        if end > first:
            spans.append(Span(first, end, "decode"))
    elif end > start:
        spans.append(Span(start, end, "to-first-token"))
    markers = [Marker("send", start, start)]
    if first is not None:
        markers.append(Marker("first-token", first, first))
    if rec.num_cached_tokens:
        at = first if first is not None else start
        markers.append(Marker("prefix-hit", at, at, f"{rec.num_cached_tokens} cached"))
    if rec.num_preemptions:
        markers.append(Marker("preempted", end, end, f"preempted {rec.num_preemptions}x (time not recorded)"))
    if rec.cancel_ms is not None:
        markers.append(Marker("cancel", rec.cancel_ms, rec.cancel_ms))
    if rec.finished_ms is not None:
        markers.append(Marker("finish", rec.finished_ms, rec.finished_ms))
    if rec.error:
        markers.append(Marker("error", end, end, rec.error[:80]))
    return start, end, tuple(spans), markers


def verdicts_in(finding: Finding, arm: str) -> dict[str, Divergence]:
    """Each request's verdict in ``arm`` (the most severe, when a file lists several)."""
    out: dict[str, Divergence] = {}
    for v in list(finding.verdicts) + list(finding.divergences):
        if v.arm == arm and (v.request_id not in out or SEVERITY[v.class_] < SEVERITY[out[v.request_id].class_]):
            out[v.request_id] = v
    return out


def schedule_data(finding: Finding, history: History | None = None, *, kept: set[str] | None = None) -> Schedule | None:
    """Each request of ``history`` (default: ``drawn_history``) as a bar over engine steps (or
    ms), its markers, and the adapter lifecycle events as lines. ``kept``: the requests a
    minimizer kept (when this is the original a minimized finding came from)."""
    h = history if history is not None else drawn_history(finding)
    if h is None:
        return None
    unit: Literal["step", "ms"] = "step" if h.engine == "inprocess" else "ms"
    worst, victims = signature_of(finding)
    verdicts = verdicts_in(finding, h.arm)
    trace = finding.trace
    sends = {e.request_id: e for e in trace.events if isinstance(e, SendEvent)}
    initial = dict(trace.engine.lora.adapters)
    order = [rid for rid in sends if rid in h.requests] + [rid for rid in h.requests if rid not in sends]
    m = finding.minimization
    if kept is None and m is not None:
        note = (f"minimized: the {len(order)} request{'s' if len(order) != 1 else ''} the minimizer kept of "
                f"{m.original_requests}" + ("" if m.verified else " (not verified by a fresh replay)")
                + (f"; it stopped early ({m.stopped})" if m.stopped else ""))
    elif kept is not None:
        note = f"the minimizer kept {len([r for r in order if r in kept])} of these {len(order)} requests"
    else:
        note = ""
    # Where each victim's first differing token came out (this run's own, when it differs there).
    firsts: dict[str, int] = {}
    for v in verdicts.values():
        ref, rec = finding.references.get(v.request_id), h.requests.get(v.request_id)
        i = v.first_divergence
        if (v.class_ in DIVERGENT_CLASSES and i is not None and ref is not None and rec is not None
                and i < len(rec.token_ids) and (i >= len(ref.token_ids) or ref.token_ids[i] != rec.token_ids[i])):
            firsts[v.request_id] = i
    bars = []
    for rid in order:
        rec = h.requests[rid]
        start, end, spans, markers = _step_bar(rid, rec, h) if unit == "step" else _ms_bar(rec)
        d = firsts.get(rid)
        made = token_steps(rid, h) if unit == "step" and d is not None else []
        if d is not None and d < len(made) and d < len(rec.token_ids):
            markers.append(Marker("first-divergence", made[d], made[d] + 0.5, f"token #{d} differs"))
        send = sends.get(rid)
        group = send.prompt.prefix_group if send is not None and isinstance(send.prompt, GenPrompt) else None
        verdict = verdicts.get(rid)
        bars.append(Bar(rid, request_label(send, rid, rec, initial), (send.adapter if send else rec.adapter), group,
                        start, end, spans, tuple(markers), verdict.class_ if verdict else "—",
                        rid in victims and worst in DIVERGENT_CLASSES,
                        (rid in kept) if kept is not None else (True if m is not None else None)))
    lines = []
    for e in h.events:
        if e.kind not in LIFECYCLE and e.kind != RESET:
            continue
        at = e.actual_step if unit == "step" else e.actual_offset_ms
        if at is None:
            continue
        ev = trace.events[e.index] if 0 <= e.index < len(trace.events) else None
        if e.kind == RESET:
            lines.append(Line(e.kind, "", float(at), float(at), reset_label(e, getattr(ev, "reset_running_requests", False)),
                              refused=not e.effective))
            continue
        verb = e.kind.removesuffix("-adapter")
        name = e.adapter or getattr(ev, "name", "") or "?"
        label = f"{verb} {name}"
        source = getattr(ev, "source", None)
        if source:
            label += f" ← {_short_source(source)}"
        if getattr(ev, "same_path", False):
            label += " (same path)"
        if e.error:
            label += " (refused)"
        lines.append(Line(e.kind, name, float(at), float(at), label, refused=bool(e.error)))
    where = {"inprocess": "in-process engine", "server": "managed server", "url": "URL server"}.get(h.engine, h.engine)
    title = f"Schedule — finding {finding.id or '?'}, arm {h.arm}, run {h.run_index} ({where})"
    return Schedule(unit, title, h.arm, h.run_index, tuple(bars), tuple(lines), worst, note)


# -- divergence ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DivergenceData:
    request_id: str
    arm: str
    run_index: int
    cls: str
    dtype: str
    first: int  # the first differing position
    positions: tuple[int, ...]
    ref_tokens: tuple[int | None, ...]
    run_tokens: tuple[int | None, ...]
    ref_logprob: tuple[float | None, ...]  # the chosen token's logprob, per position
    run_logprob: tuple[float | None, ...]
    ref_margin: tuple[float | None, ...]  # top-1 minus top-2
    run_margin: tuple[float | None, ...]
    # ref_logprob -/+ the drift bound: where noise may move the run's logprob of the same token.
    band_low: tuple[float | None, ...]
    band_high: tuple[float | None, ...]
    # |run - reference| of the chosen token before the first differing one (decode vs decode).
    drift: tuple[tuple[int, float], ...]
    # |the run's decode logprob - its own tokens teacher-forced alone on a clean cache|.
    teacher: tuple[tuple[int, float], ...]
    pair_shift: float | None  # reference margin + the run's own margin at the first differing token
    bounds: NoiseBounds
    evidence: tuple[str, ...] = ()
    detail: str = ""

    @property
    def scored(self) -> bool:
        return bool(self.teacher)

    def within_bounds(self) -> dict[str, bool | None]:
        """Each piece of evidence against its bound (None: not measured)."""
        b = self.bounds
        return {"pair shift": None if self.pair_shift is None else self.pair_shift < b.near_tie,
                "drift": None if not self.drift else max(v for _, v in self.drift) <= b.drift,
                "teacher": None if not self.teacher else max(v for _, v in self.teacher) <= b.teacher}


def chosen_logprob(rec: RequestRecord, i: int) -> float | None:
    """The logprob of the token ``rec`` chose at position ``i`` (from its recorded top-k)."""
    if i >= len(rec.token_ids) or i >= len(rec.logprobs):
        return None
    tok = rec.token_ids[i]
    return next((float(lp) for t, lp in rec.logprobs[i] if int(t) == tok), None)


def teacher_by_position(rec: RequestRecord, scoring: Scoring) -> list[tuple[int, float]]:
    """``oracle.diff.teacher_drifts`` with each value's position (the same rule: the scoring
    must be of this run's tokens; positions without both logprobs of the same token skipped)."""
    if list(scoring.token_ids) != list(rec.token_ids[: len(scoring.token_ids)]):
        return []
    out = []
    for i, tok in enumerate(scoring.token_ids):
        if i >= len(rec.logprobs) or i >= len(scoring.logprobs) or not rec.logprobs[i] or not scoring.logprobs[i]:
            continue
        (run_tok, run_lp), (scored_tok, scored_lp) = rec.logprobs[i][0], scoring.logprobs[i][0]
        if int(run_tok) == tok and int(scored_tok) == tok:
            out.append((i, abs(float(run_lp) - float(scored_lp))))
    return out


def victim_divergence(finding: Finding, request_id: str | None = None) -> Divergence | None:
    """The divergence a picture explains: ``request_id``'s in the primary arm, else the most
    reproducible victim of the worst class there (ties: the earliest first divergence)."""
    arm, _ = primary_arm(finding)
    worst, victims = signature_of(finding)
    pool = [d for d in finding.divergences if d.first_divergence is not None]
    if request_id is not None:
        pool = [d for d in pool if d.request_id == request_id]
    else:
        pool = [d for d in pool if d.class_ == worst and d.request_id in victims]
    pool.sort(key=lambda d: (d.arm != arm, SEVERITY[d.class_], -(d.runs_diverged / max(1, d.runs)),
                             d.first_divergence, d.request_id))
    return pool[0] if pool else None


def divergence_data(finding: Finding, request_id: str | None = None) -> DivergenceData | None:
    """Per generated position of the victim's diverged run and its reference: the chosen
    token's logprob, the top-2 margin, the noise band, the drift before the first differing
    token and the teacher-forced drift over the run, with the bounds the finding was judged
    with. None when no divergence has a differing token (a crash or an error)."""
    d = victim_divergence(finding, request_id)
    if d is None or d.first_divergence is None:
        return None
    ref = finding.references.get(d.request_id)
    if ref is None:
        return None
    first = d.first_divergence
    n = _max_tokens(finding, d.request_id)
    found = None
    for h in finding.runs:
        rec = h.requests.get(d.request_id)
        if h.arm != d.arm or rec is None:
            continue
        got = rec.token_ids[first] if first < len(rec.token_ids) else None
        want = ref.token_ids[first] if first < len(ref.token_ids) else None
        if got != want:
            found = h, rec
            break
    if found is None:
        return None
    h, rec = found
    length = max(len(ref.token_ids), len(rec.token_ids))
    length = min(length, n) if n else length
    pos = tuple(range(length))
    b = finding_bounds(finding)

    def tok(r: RequestRecord, i: int) -> int | None:
        return r.token_ids[i] if i < len(r.token_ids) else None

    ref_lp = tuple(chosen_logprob(ref, i) for i in pos)
    drift = tuple((i, abs(a - c)) for i in range(min(first, length))
                  if tok(ref, i) == tok(rec, i) and (a := chosen_logprob(ref, i)) is not None
                  and (c := chosen_logprob(rec, i)) is not None)
    scorings = [s for s in finding.scores if s.request_id == d.request_id]
    scoring = next((s for s in scorings if s.arm == h.arm and s.run_index == h.run_index), None)
    teacher: list[tuple[int, float]] = teacher_by_position(rec, scoring) if scoring is not None else []
    if not teacher:
        for s in scorings:
            teacher = teacher_by_position(rec, s)
            if teacher:
                break
    shift = None if d.margin is None else d.margin + (d.run_margin or 0.0)
    return DivergenceData(
        d.request_id, h.arm, h.run_index, d.class_, b.dtype, first, pos,
        tuple(tok(ref, i) for i in pos), tuple(tok(rec, i) for i in pos), ref_lp,
        tuple(chosen_logprob(rec, i) for i in pos),
        tuple(margin_at(ref, i) if i < len(ref.token_ids) else None for i in pos),
        tuple(margin_at(rec, i) if i < len(rec.token_ids) else None for i in pos),
        tuple(None if x is None else x - b.drift for x in ref_lp),
        tuple(None if x is None else x + b.drift for x in ref_lp),
        drift, tuple(teacher), shift, b, tuple(d.evidence), d.detail or "")


# -- controls and ablation -------------------------------------------------------------------------

CellState = Literal["diverged", "near-tie", "clean", "na", "skipped", "failed", "none"]


@dataclass(frozen=True)
class Cell:
    text: str
    state: CellState


@dataclass(frozen=True)
class GridRow:
    group: Literal["arm", "control", "ablation"]
    label: str
    cells: tuple[Cell, ...]
    note: str = ""


@dataclass(frozen=True)
class Grid:
    columns: tuple[str, ...]  # the victims
    rows: tuple[GridRow, ...]

    def row(self, label: str) -> GridRow:
        return next(r for r in self.rows if r.label == label)


def class_state(cls: str | None) -> CellState:
    if cls is None:
        return "none"
    if cls == "numeric-near-tie":
        return "near-tie"
    return "diverged" if cls in DIVERGENT_CLASSES else "clean"


def _verdict_cell(v: Divergence | None) -> Cell:
    if v is None:
        return Cell("—", "none")
    text = v.class_ + (f" {v.runs_diverged}/{v.runs}" if v.class_ in DIVERGENT_CLASSES else "")
    return Cell(text, class_state(v.class_))


ABLATION_STATE: dict[str, CellState] = {"disappears": "clean", "persists": "diverged", "n/a": "na",
                                        "failed": "failed", "skipped": "skipped", "moved": "skipped",
                                        "flaky": "skipped"}


def grid_data(finding: Finding) -> Grid:
    """Rows: the finding's arms, its control arms, then each mechanism the causal ablation took
    away; columns: the victims; a cell says whether that victim diverged there."""
    worst, victims = signature_of(finding)
    cols = sorted(victims)
    ex = finding.explanation
    if ex is not None and ex.victim not in cols:
        cols.append(ex.victim)
    if not cols:
        cols = ["(no victim)"]
    rows: list[GridRow] = []
    arms = list(finding.arms) + sorted({v.arm for v in finding.verdicts} - set(finding.arms))
    for a in arms:
        by = verdicts_in(finding, a)
        toggles = finding.arms.get(a, [])
        rows.append(GridRow("arm", f"arm {a}", tuple(_verdict_cell(by.get(c)) for c in cols),
                            ", ".join(toggles) or "no toggles"))
    for c in finding.controls:
        if not c.available:
            rows.append(GridRow("control", f"control {c.name}", tuple(Cell("not available", "na") for _ in cols),
                                c.detail or ""))
            continue
        by = {}
        for v in list(c.verdicts) + list(c.divergences):
            if v.request_id not in by or SEVERITY[v.class_] < SEVERITY[by[v.request_id].class_]:
                by[v.request_id] = v
        rows.append(GridRow("control", f"control {c.name}", tuple(_verdict_cell(by.get(col)) for col in cols),
                            c.detail or ("reproduces" if c.reproduced else "does not reproduce")))
    if ex is not None:
        for ab in ex.ablations:
            cells = []
            for col in cols:
                if col != ex.victim:
                    cells.append(Cell("", "none"))
                    continue
                text: str = ab.outcome
                if ab.outcome in ("disappears", "persists") and ab.victim_class:
                    text += f" ({ab.victim_class})"
                cells.append(Cell(text, ABLATION_STATE[ab.outcome]))
            rows.append(GridRow("ablation", f"without {MECHANISM_WORDS.get(ab.mechanism, ab.mechanism)}",
                                tuple(cells), ab.change + (f" — {ab.detail}" if ab.detail else "")))
    return Grid(tuple(cols), tuple(rows))


# -- campaign and gate pages -----------------------------------------------------------------------


@dataclass(frozen=True)
class BucketView:
    id: str
    count: int
    first_index: int | None
    text: str
    representative: str | None  # finding file, relative to OUT
    case: str | None  # OUT/buckets/<id>.json, relative to OUT
    near_tie: bool = False  # a flipped near tie (16-bit noise), shown apart from the bugs
    assigned: int = 0  # of count: keyed from the recorded run alone


@dataclass
class CampaignView:
    traces: int
    seconds: float
    findings: int
    complete: bool
    mode: str
    coverage: int
    by_class: dict[str, int]
    sources: dict[str, int]
    untriaged: int
    # (traces, seconds, coverage features, findings), in order; the last is the state now.
    progress: list[tuple[float, float, float, float]]
    buckets: list[BucketView]
    time_breakdown: list[tuple[str, float]] = field(default_factory=list)
    finding_files: list[str] = field(default_factory=list)


# Where campaign.json keeps its time breakdown (name -> seconds), when it keeps one.
TIME_KEYS = ("time_breakdown", "timing", "time", "seconds_by")


def time_breakdown(state: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``[(name, seconds)]`` from the first of ``TIME_KEYS`` that holds a mapping (nested
    mappings flattened as ``outer.inner``); empty when the state records none."""
    def flat(prefix: str, d: Mapping[str, Any]) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out.append((name, float(v)))
            elif isinstance(v, Mapping):
                out += flat(name + ".", v)
        return out

    for key in TIME_KEYS:
        if isinstance(state.get(key), Mapping):
            return flat("", state[key])
    return []


def campaign_view(state: Mapping[str, Any] | Any) -> CampaignView:
    """What the campaign page shows, from campaign.json's content (or a CampaignState)."""
    s: Mapping[str, Any] = state if isinstance(state, Mapping) else vars(state)
    coverage = len(s.get("coverage") or {})
    progress = [(float(p[0]), float(p[1]), float(p[2]), float(p[3])) for p in (s.get("coverage_log") or [])
                if len(p) >= 4]
    if not progress or progress[0] != (0.0, 0.0, 0.0, 0.0):
        progress.insert(0, (0.0, 0.0, 0.0, 0.0))  # the campaign's start
    now = (float(s.get("traces", 0)), float(s.get("seconds", 0.0)), float(coverage), float(s.get("findings", 0)))
    if not progress or progress[-1] != now:
        progress.append(now)
    buckets = []
    # A live CampaignState's typed buckets, or campaign.json's.
    for bucket in buckets_from_state(s.get("bug_buckets") or {}).values():
        buckets.append(BucketView(bucket.id, bucket.count, bucket.first_index, bucket.text, bucket.representative,
                                  bucket.case, bucket.near_tie, bucket.assigned))
    buckets.sort(key=lambda b: (b.first_index if b.first_index is not None else 1 << 30, b.id))
    return CampaignView(int(s.get("traces", 0)), float(s.get("seconds", 0.0)), int(s.get("findings", 0)),
                        bool(s.get("complete", False)), str(s.get("mode", "")), coverage, dict(s.get("by_class") or {}),
                        dict(s.get("sources") or {}), len(s.get("untriaged") or []), progress, buckets,
                        time_breakdown(s), list(s.get("finding_files") or []))


@dataclass(frozen=True)
class GateCaseView:
    name: str
    arm: str
    status: str
    seconds: float
    verdict: str
    source: str
    replay: str


def gate_view(data: Mapping[str, Any]) -> tuple[str, bool, list[GateCaseView]]:
    """(what, complete, cases) from gate.json's content."""
    cases = [GateCaseView(str(c.get("name", "?")), str(c.get("arm", "?")), str(c.get("status", "?")),
                          float(c.get("seconds") or 0.0), str(c.get("verdict", "")), str(c.get("source", "")),
                          str(c.get("replay", ""))) for c in data.get("cases") or []]
    return str(data.get("what", "gate")), bool(data.get("complete", True)), cases


__all__ = ["Bar", "BucketView", "CampaignView", "Cell", "DivergenceData", "GateCaseView", "Grid", "GridRow", "Line",
           "Marker", "Schedule", "Span", "campaign_view", "chosen_logprob", "divergence_data", "drawn_history",
           "gate_view", "grid_data", "schedule_data", "teacher_by_position", "time_breakdown", "verdicts_in",
           "victim_divergence"]
