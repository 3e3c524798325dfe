"""The campaign driver loop: choose -> record (harness) -> check (oracle) -> learn -> write.

Each iteration either replays a seed from the corpus directory, mutates a corpus entry chosen
by the scheduler (feedback mode), or generates a fresh random trace. The coverage buckets a
trace reaches (fuzzer/feedback.py) decide whether it joins the corpus.

State lives on disk (``campaign.json``, ``findings/``, the corpus directory), written
atomically after every trace; ``campaign.json`` is the commit point. Every random decision of
iteration ``i`` comes from an RNG seeded by (campaign seed, i), and the scheduler's state
(corpus order, pick counts, coverage counts) is in ``campaign.json``, so ``--resume``
continues exactly the trace sequence the interrupted campaign would have run.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvfuzz.traces import CampaignOrigin, EngineConfig, Finding, LineageLink, Trace, atomic_write_text, save, sweep_partial_writes
from kvfuzz.traces.buckets import Bucket, BucketMembership, Triaged, buckets_from_state, live
from kvfuzz.traces.errors import BadInput, ConfigRefused
from kvfuzz.traces.io import finding_path
from kvfuzz.traces.result import Checked
from kvfuzz.traces.timing import GENERATION, TRIAGE, Ledger, TimeBreakdown

from .corpus import Corpus, CorpusEntry, Item, Scheduler, Seed, measured_key, now
from . import configs
from .bucketdb import BucketDB, untriaged
from .feedback import SPEC_ACCEPTED, Coverage, trace_signature
from .generate import GenOptions, generate
from .mutate import mutate, mutate_into
from .sources import SourceBandit

CAMPAIGN_FILE = "campaign.json"
# The coverage log keeps at most this many points: beyond it, every other point of the older
# half is dropped, so a long campaign's state (rewritten after every trace) stays small while
# the curve keeps its shape and its latest points.
MAX_COVERAGE_LOG = 2048
Mode = Literal["feedback", "random"]


def trace_seed(seed: int, index: int) -> int:
    """The i-th trace's seed: a pure function of (campaign seed, index), so a resumed
    campaign continues the same sequence."""
    return int.from_bytes(hashlib.sha256(f"kvfuzz/{seed}/{index}".encode()).digest()[:4], "little")


def iteration_rng(seed: int, index: int) -> random.Random:
    """The RNG for every decision of iteration ``index`` (parent choice, operators)."""
    return random.Random(f"kvfuzz/schedule/{seed}/{index}")


@dataclass
class CampaignOptions:
    seed: int = 0
    budget_s: float | None = 60.0
    max_traces: int | None = None
    runs: int = 3
    out: Path = Path("kvfuzz-out")
    engine: EngineConfig = field(default_factory=EngineConfig)
    gen: GenOptions | None = None
    resume: bool = False
    # feedback: mutate novel corpus entries; random: plain generation (the baseline).
    mode: Mode = "feedback"
    # Seeds from and grows this directory; default: <out>/corpus.
    corpus: Path | None = None
    # In feedback mode, how each iteration picks fresh generation or a mutant: "bandit" (a
    # Thompson-sampling bandit on each source's novelty yield, fuzzer/sources.py) or "fixed"
    # (a fresh trace with probability p_fresh; while the corpus has fewer than
    # ``explore_until`` entries, ``p_fresh_early``). The bandit is the default because fresh
    # traces are often the more productive source, which a fixed 0.2 starves.
    sources: Literal["bandit", "fixed"] = "bandit"
    p_fresh: float = 0.2
    p_fresh_early: float = 0.5
    explore_until: int = 0
    # What a feedback mutant is: "graft" (a mutant of a corpus entry grafted into the fresh
    # trace of this iteration, fuzzer/mutate.py ``mutate_into``) or "plain" (the mutant alone;
    # docs/benchmarks.md).
    mutants: Literal["graft", "plain"] = "graft"
    # Allow operators that change the engine configuration (each change restarts the engine).
    allow_engine_changes: bool = False
    # Restrict mutation to these operators (default: all that keep the engine).
    operators: list[str] | None = None
    # Arms passed to the checker (recorded in the state so findings say what ran).
    arms: dict[str, list[str]] | None = None

    @property
    def corpus_dir(self) -> Path:
        return self.corpus if self.corpus is not None else self.out / "corpus"

    @property
    def prompt_reuse(self) -> float:
        return self.gen.prompt_reuse if self.gen is not None and not self.gen.lifecycle else 0.0

    @property
    def lifecycle(self) -> bool:
        """Adapter-lifecycle churn (``gen.lifecycle``): fresh traces from the lifecycle
        generator, and the lifecycle mutation operators drawn too."""
        return self.gen is not None and self.gen.lifecycle


@dataclass
class CampaignState:
    seed: int
    traces: int = 0
    seconds: float = 0.0
    findings: int = 0
    next_index: int = 0
    by_class: dict[str, int] = field(default_factory=dict)
    finding_files: list[str] = field(default_factory=list)
    engine: dict = field(default_factory=dict)
    runs: int = 3
    complete: bool = False
    mode: str = "feedback"
    arms: dict[str, list[str]] | None = None
    corpus_dir: str | None = None
    # Set once the corpus directory was read: a resumed campaign rebuilds from the state only.
    corpus_ready: bool = False
    # Seed trace ids from the corpus directory, replayed first (iterations 0..len-1).
    seeds: list[str] = field(default_factory=list)
    # The scheduler: corpus entry ids in order of addition, and how often each was picked.
    corpus: list[str] = field(default_factory=list)
    chosen: dict[str, int] = field(default_factory=dict)
    coverage: dict[str, int] = field(default_factory=dict)
    # [traces, seconds, buckets, findings] each time buckets or findings changed.
    coverage_log: list[list[float]] = field(default_factory=list)
    operators: list[str] | None = None
    # How each iteration's trace was made: seed / fresh / mutant.
    sources: dict[str, int] = field(default_factory=dict)
    # The source bandit's discounted [reward, pulls] per source (fuzzer/sources.py).
    bandit: dict[str, list[float]] = field(default_factory=dict)
    mutants: str = "graft"
    # One root cause, one bug bucket (oracle/buckets.py; not the coverage buckets): bucket id ->
    # its key, description, count, first trace, representative, findings (traces/buckets.py).
    bug_buckets: dict[str, Bucket] = field(default_factory=dict)
    # Campaigns written by an older kvfuzz listed findings recorded without a bucket here; no
    # finding is left without one now (triage/campaign.py assigns it), so it only ever shrinks.
    untriaged: list[str] = field(default_factory=list)
    # Campaigns on many workers (fuzzer/distributed.py): the window of the determinism rule,
    # traces committed per worker, traces re-queued after their worker died, and those deaths;
    # worker-seconds a worker sat idle because the window was full (a slow trace held the
    # commit point): the cost of the window rule.
    window: int | None = None
    by_worker: dict[str, int] = field(default_factory=dict)
    requeued: int = 0
    window_wait_s: float = 0.0
    worker_deaths: list[dict] = field(default_factory=list)
    # Adapter-lifecycle generation (``kvfuzz run --lifecycle``; GenOptions.lifecycle).
    lifecycle: bool = False
    # Requests run, and how many of them set each per-request field (SendEvent.per_request_fields).
    requests: int = 0
    request_fields: dict[str, int] = field(default_factory=dict)
    # Traces run with speculative decoding, and those whose run accepted draft tokens.
    speculative: dict[str, int] = field(default_factory=dict)
    # Traces per engine configuration region (fuzzer/configs.py), and engine configurations the
    # release or backend refused (reason -> traces skipped).
    configs: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    # Where the time went, seconds per phase, and the reference store's counts and hit rate
    # (traces/timing.py TimeBreakdown.state_parts; summed over resumed sessions).
    time: dict[str, float] = field(default_factory=dict)
    reference_store: dict[str, float] = field(default_factory=dict)

    def count_requests(self, trace: Trace, features: Iterable[str] = ()) -> None:
        """Requests per per-request field; traces with speculative decoding, and of them those
        whose run accepted drafts (read from the run's coverage features)."""
        for send in trace.sends:
            self.requests += 1
            fields = send.per_request_fields
            for f in [*fields, "any"] if fields else []:
                self.request_fields[f] = self.request_fields.get(f, 0) + 1
        region = configs.region(trace.engine)
        self.configs[region] = self.configs.get(region, 0) + 1
        if trace.engine.speculative is not None:
            self.speculative["traces"] = self.speculative.get("traces", 0) + 1
            if any(f.startswith(SPEC_ACCEPTED) and f != f"{SPEC_ACCEPTED}0" for f in features):
                self.speculative["accepted"] = self.speculative.get("accepted", 0) + 1

    @property
    def time_breakdown(self) -> TimeBreakdown:
        return TimeBreakdown.from_state(self.time, self.reference_store) if self.time else TimeBreakdown()

    def set_time(self, t: TimeBreakdown) -> None:
        self.time, self.reference_store = t.state_parts()
    # Prompt reuse probability (GenOptions.prompt_reuse): part of what iteration i's trace is.
    prompt_reuse: float = 0.0

    def __post_init__(self) -> None:
        # campaign.json keeps buckets as JSON.
        self.bug_buckets = buckets_from_state(self.bug_buckets)

    @property
    def buckets(self) -> int:
        return len(self.coverage)

    def live_buckets(self) -> list[Bucket]:
        """The buckets, earliest first."""
        return live(self.bug_buckets)

    def to_json(self) -> str:
        data = dict(self.__dict__)
        data["bug_buckets"] = {bid: b.model_dump(mode="json", by_alias=True) for bid, b in self.bug_buckets.items()}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


@dataclass
class TraceOutcome:
    index: int
    trace: Trace
    finding: Finding | None
    seconds: float
    source: str = "fresh"
    novel: list[str] = field(default_factory=list)
    buckets: frozenset[str] = frozenset()


def thin_log(log: list[list[float]], limit: int = MAX_COVERAGE_LOG) -> None:
    """Bound ``log`` in place: drop every other point of its older half (the first point stays)."""
    if len(log) <= limit:
        return
    half = len(log) // 2
    log[:half] = log[:half:2]


def load_state(out: Path, opts: CampaignOptions) -> CampaignState:
    path = out / CAMPAIGN_FILE
    if opts.resume and path.exists():
        try:
            data = json.loads(path.read_text())
            data["bug_buckets"] = buckets_from_state(data.get("bug_buckets") or {}, str(path))
            state = CampaignState(**data)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BadInput(f"cannot resume: unreadable campaign state ({first})", source=str(path)) from None
        if state.seed != opts.seed:
            raise BadInput(f"cannot resume: campaign seed is {state.seed}, --seed says {opts.seed}",
                           source=str(path), field="seed")
        if state.mode != opts.mode:
            raise BadInput(f"cannot resume: campaign mode is {state.mode}, not {opts.mode}", source=str(path),
                           field="mode")
        if state.operators != opts.operators:
            raise BadInput(f"cannot resume: the campaign used operators {state.operators or 'all'}, "
                           f"not {opts.operators or 'all'}", source=str(path), field="operators")
        if state.mutants != opts.mutants:
            raise BadInput(f"cannot resume: the campaign's mutants are {state.mutants}, not {opts.mutants}",
                           source=str(path), field="mutants")
        if state.lifecycle != opts.lifecycle:
            was = "with" if state.lifecycle else "without"
            raise BadInput(f"cannot resume: the campaign was run {was} --lifecycle", source=str(path), field="lifecycle")
        if state.prompt_reuse != opts.prompt_reuse:
            raise BadInput(f"cannot resume: the campaign's prompt reuse is {state.prompt_reuse}, not "
                           f"{opts.prompt_reuse}", source=str(path), field="prompt_reuse")
        if state.engine and state.engine != opts.engine.model_dump(mode="json"):
            raise BadInput("cannot resume: the engine options differ from the interrupted campaign's",
                           source=str(path), field="engine")
        state.complete = False
        # A kill between an atomic write's temporary file and its rename leaves the file
        # behind (the target is intact); the resumed campaign owns the directory now.
        sweep_partial_writes(out)
        return state
    return CampaignState(seed=opts.seed, engine=opts.engine.model_dump(mode="json"), runs=opts.runs,
                         mode=opts.mode, arms=opts.arms, corpus_dir=str(opts.corpus_dir), operators=opts.operators,
                         mutants=opts.mutants, lifecycle=opts.lifecycle, prompt_reuse=opts.prompt_reuse)


class Campaign:
    """One campaign's in-memory view of its state (corpus, scheduler, coverage)."""

    def __init__(self, opts: CampaignOptions):
        self.opts = opts
        self.out = opts.out
        self.corpus = Corpus(opts.corpus_dir)
        self.state = load_state(self.out, opts)
        self.buckets = BucketDB(self.out, self.state.bug_buckets)
        self.coverage = Coverage.from_json(self.state.coverage)
        self.scheduler = Scheduler()
        self.bandit = SourceBandit.from_json(self.state.bandit)
        self.measured = measured_key(opts.engine, opts.arms)
        self._setup_corpus()

    # -- corpus ------------------------------------------------------------------------------
    def _setup_corpus(self) -> None:
        seeds, self.skipped = self.corpus.seeds(self.opts.engine)
        by_id = {s.trace.trace_id(): s for s in seeds}
        self.seed_traces: dict[str, Trace] = {k: s.trace for k, s in by_id.items()}
        st = self.state
        if not st.corpus_ready:
            # Fresh campaign: entries measured on this very engine are trusted (their buckets
            # count at once); everything else is replayed first, like AFL's dry run.
            for tid, s in by_id.items():
                if s.entry is not None and s.entry.measured_on == self.measured and self.opts.mode == "feedback":
                    self.coverage.add(s.entry.buckets)
                    self._add_item(tid, s.trace, frozenset(s.entry.buckets), len(s.entry.novel))
                else:
                    st.seeds.append(tid)
            st.coverage = self.coverage.to_json()
            st.corpus_ready = True  # from now on the state, not the directory, says what is in
            return
        for tid in st.corpus:  # resume: rebuild the scheduler exactly as it was
            trace, entry = self._lookup(tid)
            buckets = frozenset(entry.buckets) if entry else frozenset()
            self.scheduler.add(Item(tid, trace, buckets, len(entry.novel) if entry else 0, st.chosen.get(tid, 0)))

    def _lookup(self, tid: str) -> tuple[Trace, CorpusEntry | None]:
        entry = None
        if self.corpus.entry_path(tid).exists():
            entry = self.corpus.load_entry(tid)
            return entry.trace, entry
        if tid in self.seed_traces:
            return self.seed_traces[tid], None
        raise BadInput(f"cannot resume: corpus entry {tid} is missing", source=str(self.corpus.path))

    def _add_item(self, tid: str, trace: Trace, buckets: frozenset[str], novel: int) -> None:
        if tid in self.state.chosen:
            return
        self.scheduler.add(Item(tid, trace, buckets, novel))
        self.state.corpus.append(tid)
        self.state.chosen[tid] = 0

    # -- one iteration -----------------------------------------------------------------------
    def next_trace(self, i: int) -> tuple[Trace, str]:
        st = self.state
        if i < len(st.seeds):
            tid = st.seeds[i]
            if tid not in self.seed_traces:
                raise BadInput(f"cannot resume: seed trace {tid} is no longer in the corpus",
                               source=str(self.corpus.path))
            return self.seed_traces[tid], "seed"
        rng = iteration_rng(self.opts.seed, i)
        if self.opts.mode == "feedback" and len(self.scheduler) and self._source(rng) == "mutant":
            parent = self.scheduler.choose(rng, self.coverage)
            st.chosen[parent.id] = parent.chosen
            how: dict[str, Any] = dict(allow_engine_changes=self.opts.allow_engine_changes, allowed=self.opts.operators)
            if self.opts.lifecycle:
                how["lifecycle"] = True
            if self.opts.mutants == "plain":
                return mutate(parent.trace, rng, **how), "mutant"
            # The fresh trace is this iteration's, the one random mode runs at index i.
            return mutate_into(self._fresh(i), parent.trace, rng, **how), "mutant"
        return self._fresh(i), "fresh"

    def upcoming(self, i: int) -> Trace | None:
        """What iteration ``i`` will most likely run, without changing the campaign: its seed
        trace, else its fresh trace (what random mode runs; feedback mode runs it, or grafts a
        mutant into it). For work done ahead of need (a reference engine's), never for a verdict."""
        st = self.state
        if i < len(st.seeds):
            return self.seed_traces.get(st.seeds[i])
        return self._fresh(i)

    def _fresh(self, i: int) -> Trace:
        return generate(trace_seed(self.opts.seed, i), self.opts.engine, self.opts.gen)

    def _source(self, rng: random.Random) -> str:
        if self.opts.sources == "bandit":
            return self.bandit.choose(rng)
        p_fresh = self.opts.p_fresh_early if len(self.scheduler) < self.opts.explore_until else self.opts.p_fresh
        return "fresh" if rng.random() < p_fresh else "mutant"

    def lineage(self, trace: Trace) -> list[dict[str, Any]]:
        """The chain of ancestors in the corpus, nearest first: [{id, operators}, ...]."""
        known = {it.id: it.trace for it in self.scheduler.items}
        chain = []
        cur = trace
        for _ in range(1000):
            pid = cur.lineage.parent
            if pid is None:
                break
            link: dict[str, Any] = {"parent": pid, "operators": list(cur.lineage.operators)}
            if "graft" in cur.lineage.operators:  # grafted into a fresh trace: name it too
                link["into"] = {"generator": cur.lineage.generator, "seed": cur.lineage.seed}
            chain.append(link)
            if pid not in known:
                break
            cur = known[pid]
        root = cur.lineage
        # Only a trace without a parent is a root (a mutant's generator/seed name its root's, or,
        # for a graft, the fresh trace it went into: both are in the chain already).
        if root.parent is None and (root.generator or root.seed is not None):
            chain.append({"root": cur.trace_id(), "generator": root.generator, "seed": root.seed})
        return chain

    def learn(self, i: int, trace: Trace, source: str, buckets: frozenset[str]) -> list[str]:
        novel = self.coverage.add(buckets)
        self.state.coverage = self.coverage.to_json()
        if self.opts.mode != "feedback":
            return novel
        if len(self.scheduler):  # the first trace had no choice: it says nothing about either source
            self.bandit.update(source, len(novel))
            self.state.bandit = self.bandit.to_json()
        tid = trace.trace_id()
        if novel or source == "seed":
            entry = CorpusEntry(id=tid, trace=trace, buckets=sorted(buckets), novel=novel, measured_on=self.measured,
                                origin={"campaign_seed": self.opts.seed, "index": i, "source": source},
                                created=now())
            self.corpus.save(entry)
            self._add_item(tid, trace, buckets, len(novel))
        return novel

    def record_finding(self, i: int, trace: Trace, source: str, finding: Finding,
                       memberships: list[BucketMembership] | None = None,
                       cases: Mapping[str, Finding] | None = None) -> None:
        """Write the finding and file it in its buckets (``memberships``, from triage; a
        finding without any, e.g. triage off, by class and explanation). A bucket it opens gets
        its case: ``cases``' witness for it (minimized to its key's victim), else the finding."""
        st = self.state
        prov = finding.provenance
        if prov.campaign is None:
            prov.campaign = CampaignOrigin(seed=self.opts.seed, index=i, mode=self.opts.mode, source=source)
        if not prov.lineage:
            prov.lineage = [LineageLink.model_validate(link) for link in self.lineage(trace)]
        members = list(memberships if memberships is not None else finding.buckets)
        if not members and finding.worst_class() != "ok":
            members = untriaged(finding)
        finding.buckets = members
        finding.bucket = members[0].bucket if members else None
        path = finding_path(self.out / "findings", finding)
        save(finding, path)
        st.findings += 1
        rel = str(path.relative_to(self.out))
        st.finding_files.append(rel)
        counts = Counter(st.by_class)
        counts[finding.worst_class()] += 1
        st.by_class = dict(counts)
        self.buckets.file(i, finding, rel, members, cases)


def run_campaign(opts: CampaignOptions, check_trace: Callable[[Trace], Checked | Triaged],
                 on_outcome: Callable[[TraceOutcome, CampaignState], None] | None = None,
                 on_start: Callable[["Campaign"], None] | None = None, ledger: Ledger | None = None,
                 lookahead: Callable[[Trace], None] | None = None) -> CampaignState:
    """Run traces until the budget or trace count is used up. ``check_trace`` records and
    checks one trace (harness + oracle); its histories feed coverage, its finding is kept.
    ``ledger``: the session's (traces/timing.py): where the time went lands in ``state.time``.
    ``lookahead``: told, before each trace is checked, the trace the next iteration will most
    likely run (``Campaign.upcoming``; a reference engine computes its references meanwhile)."""
    out = opts.out
    (out / "findings").mkdir(parents=True, exist_ok=True)
    ledger = ledger if ledger is not None else Ledger()
    camp = Campaign(opts)
    state = camp.state
    if on_start:
        on_start(camp)
    start = time.monotonic()
    base_seconds = state.seconds
    base_time = state.time_breakdown
    atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
    while True:
        elapsed = time.monotonic() - start
        if opts.max_traces is not None and state.traces >= opts.max_traces:
            break
        if opts.budget_s is not None and elapsed >= opts.budget_s:
            break
        i = state.next_index
        t0 = time.monotonic()
        with ledger.span(GENERATION):
            trace, source = camp.next_trace(i)
            nxt = camp.upcoming(i + 1) if lookahead is not None else None
        if lookahead is not None and nxt is not None:
            lookahead(nxt)
        # Everything check_trace spends outside runs, references and scorings is triage's.
        ledger.fresh = True
        try:
            with ledger.span(TRIAGE):
                result = check_trace(trace)
        except ConfigRefused as e:
            # The engine refused this trace's configuration: skipped, the reason counted.
            ledger.fresh = False
            state.refused[e.reason] = state.refused.get(e.reason, 0) + 1
            state.next_index = i + 1
            continue
        ledger.fresh = False
        checked, members, cases = ((result.checked, result.buckets, result.cases) if isinstance(result, Triaged)
                                   else (result, None, None))
        with ledger.span(GENERATION):
            finding = checked.finding
            buckets = trace_signature(checked.histories, trace)
            before = (state.buckets, state.findings)
            novel = camp.learn(i, trace, source, buckets)
            if finding is not None:
                camp.record_finding(i, trace, source, finding, members, cases)
            state.traces += 1
            state.count_requests(trace, buckets)
            state.next_index = i + 1
            state.sources[source] = state.sources.get(source, 0) + 1
            state.seconds = round(base_seconds + time.monotonic() - start, 3)
            if (state.buckets, state.findings) != before or i == 0:
                state.coverage_log.append([state.traces, state.seconds, state.buckets, state.findings])
                thin_log(state.coverage_log)
            state.set_time(base_time.plus(ledger.breakdown()))
            atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
        if on_outcome:
            with ledger.span(GENERATION):
                on_outcome(TraceOutcome(i, trace, finding, time.monotonic() - t0, source, novel, buckets), state)
    state.complete = True
    state.seconds = round(base_seconds + time.monotonic() - start, 3)
    state.set_time(base_time.plus(ledger.breakdown()))
    atomic_write_text(out / CAMPAIGN_FILE, state.to_json())
    return state


__all__ = ["CAMPAIGN_FILE", "Campaign", "CampaignOptions", "CampaignState", "Seed", "TraceOutcome",
           "iteration_rng", "run_campaign", "trace_seed"]
