"""How much triage each finding of a campaign gets: one bug, one bucket (docs/oracle.md
"Buckets"; the rule is oracle/buckets.py).

Every trace runs once. A finding is attributed to toggles (the clean arm re-run), which gives
its keys. An unexplained finding (no toggle explains it: a candidate vLLM bug) is then checked
against the buckets of the same class by a few replays (``oracle.buckets.next_check``: a
mechanism the candidates differ on, then the mechanisms the candidate needs) and joins the
first that agrees: its trace and verdicts, linked, no minimization. One that agrees with no
bucket is triaged fully, time-boxed: confirmation runs (the trace up to K times, to measure the
rate), control arms, minimization, the full causal ablation. Its full key is then checked
against the buckets once more (the merge check) before it opens a bucket; the minimal finding
is copied as the bucket's regression case (``OUT/buckets/<id>.json``, for ``kvfuzz gate``).

Repeats of a duplicate are skipped on a step-exact engine, where they are identical (the
in-process replay is deterministic: tests/test_engine.py); wall-clock engines confirm every
divergent trace. Time spent on findings of known buckets is capped at ``share`` of the
campaign so far: beyond it, a finding is **assigned, not triaged**: to the one bucket its
cheap pre-key allows (class, and the toggles on in its arm), or, when several do, by one replay
(attribution, or the candidates' distinguishing check). It is never left without a bucket.
Assigned findings add little time, so the share falls back under the cap as the campaign goes
on and later findings are triaged again.

A new bucket's triage is time-boxed: ``minimize_seconds`` (--minimize-seconds), and at most
``NEW_BUCKET_SHARE`` of the campaign's budget when it has one (never below
``MIN_NEW_BUCKET_BOX_S``), so a 10-minute campaign that finds a bug keeps fuzzing most of its
time (issue 18: >= 0.7x the clean traces/min). What the box cuts short is marked (a partial
minimization, ablations "skipped", which never count in a key); `kvfuzz minimize` and `kvfuzz
explain` finish it from the finding file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfuzz.driver.recovery import Recovering
from kvfuzz.harness.toggles import clean_set, unreachable
from kvfuzz.driver.session import Session
from kvfuzz.driver.settings import CampaignSettings, TriageSettings
from kvfuzz.oracle import buckets as rule
from kvfuzz.oracle.attribution import plan
from kvfuzz.oracle.controls import escalate, primary_arm
from kvfuzz.oracle.postconditions import REPAIRABLE
from kvfuzz.traces import Finding, Trace, save
from kvfuzz.traces.finding import DIVERGENT_CLASSES, Explanation
from kvfuzz.traces.buckets import (KEY_MECHANISMS, Bucket, BucketKey, BucketMembership, MechanismCheck, Outcome,
                                   Rewitness, SecondCauses, Triaged, removal_conflicts, same_break, unsettled,
                                   with_evidence)
from kvfuzz.traces.io import load_finding
from kvfuzz.traces.result import Checked

from .attribution import explain_guarded
from .controls import float32_control, replay_seconds
from .explain import enforce_check, explain, repair_check
from .finish import add_controls, finish_finding
from .minimize import size

# A campaign spends at most this share of its time on findings of buckets it already has...
KNOWN_BUCKET_SHARE = 0.1
# ...and at most this share of its budget on triaging any one new bucket. Together they keep a
# campaign with one bug fuzzing >= 80% of its time, before the oracle's own per-finding costs
# (issue 30 asks >= 0.7x the clean rate in a 3-minute campaign: at 15% and a 30 s floor, a
# frequent fault's 3-minute campaign fuzzed at 0.5x).
NEW_BUCKET_SHARE = 0.10
# ...but never less than this: a one-minute campaign (the README's) still minimizes its bug.
MIN_NEW_BUCKET_BOX_S = 20.0
# Inside a new bucket's box: the confirmation runs end by this share of it, minimization by this
# one; the causal ablation (the key's mechanisms first) keeps the rest. Issue 30: an 18-request
# witness's confirmation spent the whole box, and its bucket opened with no key evidence.
CONFIRM_BOX = 0.2
MINIMIZE_BOX = 0.6
# Past the share, every this-many-th finding assigned to an unexplained bucket whose key has
# verdicts is replayed once without one of them (in turn): a second cause that first shows up
# after the share is spent still gets a bucket of its own, at a third of a replay per finding.
ASSIGN_CHECK_EVERY = 3
# Rule 5.19: after this many findings whose victim's later break did not survive enforcing its
# first one, findings with that later break are no longer triaged for it (one replay each).
REFUTED_ENOUGH = 3


@dataclass
class CampaignTriage:
    session: Session
    guard: Recovering
    arms: dict[str, list[str]]
    out: Path
    # How much each finding is re-run (--runs-fixed, --no-minimize, --minimize-seconds ...).
    settings: TriageSettings = field(default_factory=TriageSettings)
    confirm_runs: int = 3
    share: float = KNOWN_BUCKET_SHARE
    status: Callable[[str], None] = lambda _m: None
    # The campaign's buckets (id -> bucket) and merges (id -> the id it lives on in): in-process
    # the campaign state's own (``restore``), on Ray the committed ones sent with each task.
    known: dict[str, Bucket] = field(default_factory=dict)
    merges: dict[str, str] = field(default_factory=dict)
    # Where buckets' regression cases are read from (``Bucket.case`` is relative to it): the
    # campaign's OUT; a Ray worker's is the driver's (``WorkerSpec.cases_dir``), when readable.
    cases: Path | None = None
    # Whether ``known`` is final for the trace being triaged. A Ray worker's task is unsettled
    # while a lower index is uncommitted (fuzzer/distributed.py): a finding that agrees with no
    # bucket is then deferred, not triaged (that lower trace may be opening its bucket now).
    settled: bool = True
    known_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)
    assigned_n: int = 0
    _calls: int = 0
    # The device's clean arm; None: read from the toggles registry when first needed.
    clean_arm: list[str] | None = None
    # How long the current trace's own run took (its replays in triage cost about as much).
    _run_seconds: float = 0.0
    # Verdicts measured on existing buckets' own witnesses while triaging the current trace.
    _evidence: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    _checks: list[MechanismCheck] = field(default_factory=list)  # this finding's check replays
    # Rule 5.20: enforcements measured on existing buckets' own witnesses (bucket -> name ->
    # outcome) while triaging the current trace, and (bucket, name) pairs whose enforced replay
    # gave no evidence (not tried again; the finding's own are in its checks).
    _enforced: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    _unenforced: set[tuple[str, str]] = field(default_factory=set)
    # Check replays an earlier pass of this trace made (a Ray task deferred at the commit point
    # and run again, fuzzer/distributed.py): on a step-exact engine a replay gives the same
    # again, so a check against a bucket the first pass already saw is reused, not replayed.
    prior: list[MechanismCheck] = field(default_factory=list)
    # Rule 5.19: later break names enforcing the first break refuted or confirmed as a second
    # cause: the campaign's committed record (``restore``) plus this process's own replays.
    second: SecondCauses = field(default_factory=SecondCauses)
    # Rule 5.22: the current new bucket's rule 5.21 box was asked for and the budget could not pay.
    _unpaid: bool = False
    # The current finding goes to a new bucket's box unchecked: its check replays would cost more.
    _unchecked: bool = False

    def restore(self, buckets: dict[str, Bucket], merges: dict[str, str] | None = None,
                second: SecondCauses | None = None) -> None:
        """Share the campaign's buckets (the campaign adds to them as findings are recorded),
        and start from its rule 5.19 record when given (a resumed campaign; a Ray task, which
        sees exactly what was committed below its index)."""
        self.known = buckets
        self.merges = merges if merges is not None else {}
        if second is not None:
            self.second = second.model_copy(deep=True)

    @property
    def alive(self) -> list[Bucket]:
        return rule.live(self.known, self.merges)

    @property
    def explanations(self) -> list[str]:
        """The toggles the campaign's buckets are explained by: attribution tries their
        single-toggle arms first (a finding of a known bucket needs no other)."""
        return sorted({t for b in self.alive if b.key.explained_by for t in b.key.explained_by.split("+")})

    def __call__(self, trace: Trace) -> Triaged:
        if self._calls == 0:
            # The campaign's clock starts with its first trace, not when this was built (before
            # the engine started): the share and the budget's end are measured from here.
            self.started = time.monotonic()
        self._calls += 1
        # Teacher forcing only where it can change a class; a new bucket's triage scores in full.
        with self.session.scoring("near-ties"):
            return self._call(trace)

    def _call(self, trace: Trace) -> Triaged:
        runs = self.confirm_runs if self.settings.runs_fixed else 1
        t_run = time.monotonic()
        checked = self.guard.check(trace, runs=runs, arms=self.arms)
        t_run = self._run_seconds = time.monotonic() - t_run
        f = checked.finding
        if f is None:
            return Triaged(checked)
        if f.worst_class() == "engine-crash":
            # Not repeated nor minimized: each replay could crash the engine again (and a hang
            # costs the trace deadline each time).
            return self._place(checked, f, rule.keys_of(f), status="triaged", how="class")
        t0 = time.monotonic()
        self._evidence, self._checks, self._enforced, self._unchecked = {}, [], {}, False
        if not self.settled and not self._could_join(f):
            return self._defer(checked, f)  # before attribution: no known bucket can take it
        ending = self.over_budget or self._outlasts_budget(checked, t_run)
        if self.alive and (self.over_share or ending or self._outlasts_share(checked, t_run)):
            # Past the campaign's budget (its last trace), no replay at all: it must end on time.
            out = self._assign(checked, replays=not ending)
            self.known_seconds += time.monotonic() - t0
            if out is not None:
                return out
            t0 = time.monotonic()  # another cause: triaged like any finding from here
        if self.settings.attribute:
            checked = explain_guarded(self.guard, checked, runs=runs, first=self.explanations)
            f = checked.finding or f
        checked = self._repaired(checked)
        f = checked.finding or f
        joined: list[BucketMembership] = []
        new: list[BucketKey] = []
        for key in rule.keys_of(f):
            bucket, key, how = self._match(f, key, max_checks=0 if self._unchecked else rule.MAX_CHECKS)
            if bucket is None:
                new.append(key)
            else:
                joined.append(BucketMembership(bucket=bucket.id, key=key, status="triaged", how=how))
        if new and not self.settled:
            return self._defer(checked, f)
        if not new:
            if not self.session.step_exact and not self.settings.runs_fixed and self.confirm_runs > 1:
                checked = self._confirm(checked)
            self.known_seconds += time.monotonic() - t0
            f = checked.finding or f
            return self._done(checked, f, [*joined, *self._also_second(f, {m.bucket for m in joined})], "joined")
        return self._triage(checked, joined, new)

    def _repaired(self, checked: Checked) -> Checked:
        """Rule 5.19: the finding with its victims' named breaks enforced in one replay each,
        where a victim later broke another check (``repair_check``)."""
        f = checked.finding
        if f is None or not self._second_candidates(f):
            return checked
        self.status(f"finding {f.id}: replaying with its victim's first break enforced (rule 5.19)")
        g = repair_check(self.session, f)
        self.second.note(g)
        return dataclasses.replace(checked, finding=g)

    def _also_second(self, f: Finding, joined: set[str]) -> list[BucketMembership]:
        """Rule 5.19, once a second cause has its bucket: a finding whose victim's later break
        names a second cause an enforced replay confirmed in this campaign is listed in that
        bucket too (besides ``joined``), assigned on its own run's record (no replay: the AL + AI
        campaigns listed AL's bucket with its one triaged finding while six traces showed it)."""
        cls = f.worst_class()
        names = {d.later for d in f.divergences if d.later in self.second.confirmed and d.explained_by is None
                 and d.class_ == cls}
        out = []
        for n in sorted(names):
            b = next((b for b in self.alive if b.key.broke == n and b.key.cls == cls and b.key.explained_by is None),
                     None)
            if b is not None and b.id not in joined:
                out.append(BucketMembership(bucket=b.id, key=BucketKey(cls=cls, broke=n), status="assigned",
                                            how=f"a victim's later break: {n} (a second cause an enforced replay "
                                                "confirmed, rule 5.19; not replayed)"))
        return out

    def _second_candidates(self, f: Finding) -> set[str]:
        """Later breaks (rule 5.19) on ``f``'s victims that could name a second cause: no live
        bucket has the name, and enforcing the first break did not yet refute it
        ``REFUTED_ENOUGH`` times (the later break followed from the first)."""
        have = {b.key.broke for b in self.alive}
        return {d.later for d in f.divergences if d.later is not None and d.repair is None and d.later not in have
                and self.second.refuted.get(d.later, 0) < REFUTED_ENOUGH}

    # -- matching ------------------------------------------------------------------------------------
    def _match(self, f: Finding, key: BucketKey, max_checks: int = rule.MAX_CHECKS) -> tuple[Bucket | None, BucketKey, str]:
        """The earliest bucket ``key`` agrees with, after up to ``max_checks`` replays of the
        finding without one engine mechanism each (``rule.next_check``); none when it broke
        the same post-condition as that bucket's witness (rule 5)."""
        cands = rule.candidates(key, self.alive)
        named = rule.same_name(key, cands)
        if named:
            # Rule 5: the same post-condition broke on both witnesses; nothing to replay (the
            # bucket of that name, not an earlier unnamed one it also agrees with).
            return named[0], key, f"post-condition: {key.broke}"
        key, cands = self._enforce_on(f, key, cands)
        if cands and key.explained_by is None and not cands[0].key.verdicts:
            # The bucket opened without key evidence (its box ran out, or past the share): its
            # own witness is measured once, so there is something to check against.
            cands[0] = self._measured(cands[0], list(KEY_MECHANISMS))
        tried: list[str] = []
        while cands and key.explained_by is None and len(tried) < max_checks:
            m = rule.next_check(key, cands, tried)
            if m is None:
                break
            tried.append(m)
            key = key.model_copy(update={"verdicts": {**key.verdicts, **self._check(f, m, key)}})
            cands = rule.candidates(key, cands)
        if not cands:
            return None, key, ""
        if rule.name_unearned(key, cands[0].key, tried):
            return None, key, ""  # rule 5.7, in the merge check too
        checked = ", ".join([f"{m} {key.verdicts[m]}" for m in tried if m in key.verdicts] + _enforced_words(key))
        return cands[0], key, ("replay: " + checked) if checked else "key"

    # -- rule 5.20: does a name cause a victim that broke nothing? ----------------------------------
    def _enforce_on(self, f: Finding, key: BucketKey, cands: list[Bucket]) -> tuple[BucketKey, list[Bucket]]:
        """Rule 5.20: where ``key`` and a candidate differ by an enforceable post-condition one
        of them names (or measured) and the other has no evidence on, the side without it is
        replayed once with that post-condition enforced on every row: a candidate bucket's own
        witness (once per bucket; its key keeps the evidence), or the finding, on ``key``'s
        victim. Returns ``key`` with what was measured and the candidates that still agree.
        Step-exact engines only (a replay elsewhere is another schedule, not the same one
        enforced); nothing measured is no difference."""
        if key.explained_by is not None or not cands or not self.session.step_exact:
            return key, cands
        out = []
        for b in cands:
            if key.broke in REPAIRABLE and b.key.broke is None and key.broke not in b.key.enforced:
                b = self._bucket_enforced(b, key.broke)
            out.append(b)
        if key.broke is None:
            names = {n for b in out for n in (b.key.broke, *b.key.enforced) if n in REPAIRABLE}
            for n in sorted(names - set(key.enforced)):
                got = self._finding_enforced(f, key, n)  # once per victim and name: kept in its checks
                if got is not None:
                    key = key.model_copy(update={"enforced": {**key.enforced, n: got}})
        return key, [b for b in out if rule.agrees(key, b.key)]

    def _finding_enforced(self, f: Finding, key: BucketKey, name: str) -> Outcome | None:
        """One replay of ``f`` with ``name`` enforced, judged on ``key``'s victim (rule 5.20),
        kept with the finding's checks (an earlier pass's is reused: a step-exact replay gives
        the same again)."""
        victim = rule.victim_of(f, key)
        done = next((c for c in [*self.prior, *self._checks]
                     if c.kind == "enforced" and c.mechanism == name and c.victim == victim and victim is not None),
                    None)
        if done is not None:
            self._checks.append(done)
            return done.verdict
        self.status(f"finding {f.id}: replaying with {name} enforced (rule 5.20)")
        got = enforce_check(self.session, f, name, victim=victim)
        self._checks.append(MechanismCheck(mechanism=name, kind="enforced", victim=victim, outcome=got or "failed",
                                           verdict=got,
                                           detail=None if got else "no evidence: a milder divergence, a failed "
                                           "replay, or a victim that did not diverge in every run"))
        return got

    def _bucket_enforced(self, b: Bucket, name: str) -> Bucket:
        """``b`` with what enforcing ``name`` did to its own witness's victim (its regression
        case, as ``_measured``), recorded as evidence for the campaign to add to its key.
        Unchanged where the witness is not readable or the replay gave no evidence."""
        witness = None if (b.id, name) in self._unenforced else self._witness(b)
        if witness is None:
            return b
        self.status(f"bucket {b.id}: replaying its own witness with {name} enforced (rule 5.20)")
        got = enforce_check(self.session, witness, name, victim=rule.victim_of(witness, b.key))
        if got is None:
            self._unenforced.add((b.id, name))
            return b
        self._enforced[b.id] = {**self._enforced.get(b.id, {}), name: got}
        return b.model_copy(update={"key": with_evidence(b.key, {}, {name: got})})

    def _witness(self, b: Bucket) -> Finding | None:
        """``b``'s own witness, its regression case (``OUT/buckets/<id>.json``; a Ray worker
        reads the driver's OUT): None where it is not readable."""
        path = (self.cases or self.out) / b.case if b.case else None
        if path is None or not path.is_file():
            return None
        try:
            return load_finding(path)
        except (OSError, ValueError):
            return None

    def _measured(self, b: Bucket, mechanisms: list[str]) -> Bucket:
        """``b`` with the verdicts its key lacks among ``mechanisms`` measured on its own
        witness (its regression case, ``OUT/buckets/<id>.json``; one replay per mechanism the
        witness uses, once per bucket: the evidence stays in its key), recorded as evidence for
        the campaign to add to that key. Unchanged where the witness is not readable (a Ray
        worker without the driver's OUT) or the key is explained."""
        missing = [m for m in mechanisms if m not in b.key.verdicts]
        witness = self._witness(b) if missing and b.key.explained_by is None else None
        if witness is None:
            return b
        self.status(f"bucket {b.id}: measuring its own witness ({', '.join(missing)})")
        ex = explain(self.session, witness, mechanisms=missing)
        got = rule.verdicts_of(ex)
        if not got:
            return b
        self._evidence[b.id] = {**self._evidence.get(b.id, {}), **got}
        return b.model_copy(update={"key": with_evidence(b.key, got)})

    def _check_seconds(self, f: Finding, key: BucketKey) -> float:
        """About how long one check of ``f`` against a bucket takes: its run, up to where the
        victim ``key`` speaks for ended (the replay stops there: rule 5.24)."""
        victim = rule.victim_of(f, key)
        return (replay_seconds(f, [victim]) if victim is not None else 0.0) or self._run_seconds

    def _check(self, f: Finding, mechanism: str, key: BucketKey) -> dict[str, Outcome]:
        """One replay of ``f`` without ``mechanism``, judged on ``key``'s victim: its verdict,
        if it could be judged."""
        victim = rule.victim_of(f, key)
        # A step-exact replay gives the same again: a check this trace already made (an earlier
        # pass's on Ray, or this one's past the share before it was triaged) is reused.
        done = next((c for c in [*self.prior, *self._checks] if c.kind == "removed" and c.mechanism == mechanism
                     and c.victim == victim and victim is not None), None) if self.session.step_exact else None
        if done is not None:
            if done not in self._checks:
                self._checks.append(done)
            return {mechanism: done.verdict} if done.verdict else {}
        self.status(f"finding {f.id}: checking against buckets (without {mechanism})")
        ex = explain(self.session, f, victim=victim, mechanisms=[mechanism])
        got = rule.verdicts_of(ex)
        # Kept with the finding whatever it gave (a moved or failed replay is no verdict, and
        # the only trace of why it joined where it did).
        self._checks += [MechanismCheck(mechanism=a.mechanism, victim=ex.victim, outcome=a.outcome, detail=a.detail,
                                        verdict=got.get(a.mechanism))
                         for a in ex.ablations if a.mechanism == mechanism]
        return got

    def _assign(self, checked: Checked, *, replays: bool = True) -> Triaged | None:
        """Past the share: the bucket the cheap pre-key allows, or one replay decides. None:
        the sampled replay disagreed with the bucket (another cause: triage it). Without
        ``replays`` (past the campaign's budget): the pre-key alone, the earliest candidate."""
        f = checked.finding
        assert f is not None
        if replays and self.session.step_exact and self._second_candidates(f):
            # A victim broke another check after its named one, a name no bucket has (rule
            # 5.19): perhaps a second cause, triaged (one replay tells).
            return None
        cands = rule.prekey_candidates(f, self.alive, self.clean, self._inert(f))
        if not cands and replays and any(k.broke for k in rule.keys_of(f)):
            # Its own run broke a post-condition no bucket's witness broke (rule 5): another
            # cause, triaged like any new one (the share caps time on known buckets only).
            return None
        how = "pre-key"
        if len({b.key.base for b in cands}) != 1 and self.settings.attribute and replays:
            # Several explanations possible, or none known: one attribution replay.
            checked = explain_guarded(self.guard, checked, first=self.explanations)
            f = checked.finding or f
            how = "pre-key after attribution"
            keys = rule.keys_of(f)
            cands = [b for b in self.alive if any(b.key.base == k.base and same_break(k, b.key) for k in keys)]
        if not cands:
            # No bucket of its kind yet: it opens one, untriaged (a later triaged finding whose
            # key agrees joins it and brings the evidence).
            return self._place(checked, f, rule.keys_of(f), status="assigned", how="opened past the triage share")
        key = rule.keys_of(f)[0] if rule.keys_of(f) else cands[0].key
        if key.base != cands[0].key.base:
            key = cands[0].key.model_copy(update={"verdicts": {}})
        if len(cands) > 1 and key.explained_by is None and replays:
            bucket, key, how2 = self._match(f, key, max_checks=1)
            if bucket is None and key.broke is not None and not rule.same_name(key, cands):
                return None  # rule 5.7: no candidate earned its name (Y + P on Ray): triaged
            bucket = bucket or cands[0]
            how = how2 if how2 != "key" else how
        else:
            if replays:
                key, kept = self._enforce_on(f, key, cands)
                if not kept:
                    return None  # rule 5.20: the name did not cause its victim: triaged (another cause)
                cands = kept
                if key.enforced:
                    how += ", replay: " + ", ".join(_enforced_words(key))
            same = rule.same_name(key, cands)
            bucket = same[0] if same else cands[0]
            if not same and key.broke is not None and bucket.key.broke is None and not replays:
                # Rule 5.7 with no replay left (the campaign's last trace): a name is not lent on
                # no evidence (Y + P on Ray at 1ad31a0: the last P finding went to Y's bucket by
                # pre-key, which took P's name and merged with P's). Its own bucket, assigned.
                m = BucketMembership(bucket=key.digest(), key=key, status="assigned",
                                     description=rule.describe(key, f, triaged=False),
                                     how="opened past the campaign's budget: a name no candidate has, no replay left")
                return self._done(checked, f, [m], "assigned")
            if key.broke is not None and bucket.key.broke == key.broke:
                how = f"pre-key, post-condition: {key.broke}"
            elif key.explained_by is None and bucket.key.verdicts and replays:
                tried = sorted(bucket.key.verdicts)
                lends_name = key.broke is not None and bucket.key.broke is None \
                    and rule.name_unearned(key, bucket.key, ())  # rule 5.20 may have earned it
                if lends_name:
                    # Its run broke a post-condition no witness of the bucket did: a name the
                    # bucket never showed is checked on every verdict, not sampled (rule 5.5,
                    # issue 30: with faults Y and P on, P's first named finding was sampled on
                    # chunked prefill, which neither needs, joined Y's bucket and lent it P's
                    # name; every later P finding then joined by name).
                    mechs = tried[:rule.MAX_CHECKS]
                    if self._check_seconds(f, key) * len(mechs) > self.new_bucket_box:
                        # Unless those replays (each to where its victim ended) cost more than
                        # the box that triages it as a new cause, whose merge check then compares
                        # its minimized witness (Y + P at 3 minutes: P's first, a 15 s trace,
                        # spent 30 s on two checks before its 20 s box).
                        self._unchecked = True
                        return None
                else:
                    n, self.assigned_n = self.assigned_n, self.assigned_n + 1
                    mechs = [tried[(n // ASSIGN_CHECK_EVERY) % len(tried)]] if n % ASSIGN_CHECK_EVERY == 0 else []
                for mech in mechs:
                    got = self._check(f, mech, key)
                    key = key.model_copy(update={"verdicts": {**key.verdicts, **got}})
                    if not rule.agrees(key, bucket.key):
                        return None
                    if lends_name and rule.name_unearned(key, bucket.key, [mech]):
                        return None  # rule 5.7: another cause, triaged
                seen = [f"{m} {key.verdicts[m]}" for m in mechs if m in key.verdicts]
                if seen:
                    how += ", replay: " + ", ".join(seen)
        m = BucketMembership(bucket=bucket.id, key=key, status="assigned", how=how)
        return self._done(checked, f, [m, *self._also_second(f, {bucket.id})], "assigned")

    def _could_join(self, f: Finding) -> bool:
        """Whether any live bucket might take ``f`` (its pre-key for the worst class; any
        bucket of another class it diverged in)."""
        worst = f.worst_class()
        others = {d.class_ for d in f.divergences if d.class_ in DIVERGENT_CLASSES} - {worst}
        return bool(rule.prekey_candidates(f, self.alive, self.clean, self._inert(f))) or any(b.key.cls in others for b in self.alive)

    def _defer(self, checked: Checked, f: Finding) -> Triaged:
        """An unsettled task's finding that no known bucket takes: placed by its pre-key, for
        the driver to run again at the commit point (fuzzer/distributed.py)."""
        self.status(f"finding {f.id}: deferred until the traces below it are committed")
        placed = self._place(checked, f, rule.keys_of(f), status="assigned",
                             how="not triaged: the campaign ended before the traces below it")
        return dataclasses.replace(placed, status="deferred")

    # -- a new bucket: everything ------------------------------------------------------------------
    @property
    def new_bucket_box(self) -> float:
        """Seconds one new bucket's triage may take."""
        if self.settings.budget_s is None:
            return self.settings.minimize_seconds
        return min(self.settings.minimize_seconds, max(MIN_NEW_BUCKET_BOX_S, NEW_BUCKET_SHARE * self.settings.budget_s))

    def _triage(self, checked: Checked, joined: list[BucketMembership], new: list[BucketKey]) -> Triaged:
        start, box = time.monotonic(), self.new_bucket_box
        end = self.campaign_end
        if end is not None:
            # Not past the campaign's budget, but a bucket found at its end still gets a quarter
            # box for its key (issue 30: campaigns of 180 s ran 255-265 s).
            box = max(0.25 * box, min(box, end - start))
        if not self.settings.runs_fixed and self.confirm_runs > 1 and not self.session.step_exact:
            # A step-exact engine's repeats are identical histories (tests/test_engine.py): they
            # would only spend the box that minimization needs (fault AJ in bfloat16 at b6de30e:
            # a 9-request witness confirmed, left unminimized, opened a second bucket).
            self.status("new bucket: confirming the rate")
            checked = self._confirm(checked, start + CONFIRM_BOX * box)
        finding = checked.finding
        assert finding is not None
        # The minimized finding is recorded afresh and scored in full. (Re-judging an unminimized
        # one here would drop its attribution: tests/test_toggles.py's bench found it.)
        with self.session.scoring("all"):
            return self._open(checked, finding, joined, new, start, box)

    def _open(self, checked: Checked, finding: Finding, joined: list[BucketMembership], new: list[BucketKey],
              start: float, box: float) -> Triaged:
        deadline = start + box
        if self.settings.controls and finding.worst_class() == "numeric-near-tie" and \
                finding.trace.engine.dtype in ("bfloat16", "float16"):
            # The class first: a 16-bit near tie's float32 control decides whether it is noise
            # or corruption, and so which section its bucket is shown in. It ran last in the box
            # and an 18-request witness spent the box before it: fault AR in bfloat16 at 79c3552
            # filed a corruption (the same trace corrupts in float32) among the near ties.
            self.status(f"finding {finding.id}: float32 control first (a 16-bit near tie)")
            arm, toggles = primary_arm(finding)
            early = float32_control(self.session, finding, toggles=toggles,
                                    runs=max(1, sum(1 for h in finding.runs if h.arm == arm)))
            up = escalate(finding.model_copy(update={"controls": [early]}))
            if up.worst_class() != finding.worst_class():
                # Its id is a hash of its content, class included: name the new one, or the
                # id in the log is found in no file (fault AR in bfloat16, 10 minutes, ecc5b15).
                self.status(f"finding {finding.id}: {up.worst_class()} in float32: recorded as {up.id}")
                finding, joined, new = up, [], rule.keys_of(up)
        small = finding
        self._unpaid = False
        # The witness of the new key's own victim (rule 5.6: in a finding two causes hit, the
        # victim that broke the key's post-condition, not the other cause's).
        victim = rule.victim_of(finding, new[0]) if new else None
        left = start + MINIMIZE_BOX * box - time.monotonic()
        second = bool(new) and new[0].broke is not None and any(
            d.second_cause == new[0].broke for d in finding.divergences)
        if self.settings.minimize and second:
            # Rule 5.19: the victim is hit by another cause first; minimizing for its class could
            # keep that cause alone. The witness stays whole (`kvfuzz minimize` can still run).
            small = finding.model_copy(deep=True)
            small.notes["minimize"] = ("not minimized: its bucket names a second cause on a victim another cause "
                                       "hits first (rule 5.19)")
        elif self.settings.minimize and left < self._original_replays * self._run_seconds:
            # Its share of the box cannot pay for the replays of the trace a minimization that
            # shrinks nothing makes: not started. It replays the original to accept it (not on a
            # step-exact engine: its recorded run shows it) and again to verify it (a clean
            # bfloat16 LoRA campaign's 9-request near tie, 12 s a replay: 36 s past a 20 s box
            # with 0.3 s of its share left).
            small = finding.model_copy(deep=True)
            small.notes["minimize"] = ("not minimized: the triage time box was spent before minimization "
                                       "started (`kvfuzz minimize` finishes it)")
        elif self.settings.minimize:
            self.status(f"finding {finding.id}: minimizing")
            # Minimization until MINIMIZE_BOX of the box; the ablation of the (small) result, then
            # its control arms, the rest: the key's evidence before what is only described.
            small = finish_finding(self.session, finding, out=self.out, do_minimize=True, controls=False,
                                   max_seconds=max(1.0, left), victim=victim, recorded_here=True)
        if self.settings.ablate:
            self.status(f"finding {small.id}: causal ablation")
            small.explanation = self._ablation(small, victim, deadline)
            if self.settings.minimize and not second:
                small = self._smaller_if_split(small, new, victim)
        if self.settings.controls:
            # Inside the box too (issue 30: a clean bfloat16 campaign's one near-tie finding spent
            # 120 s on its serialized and float32 controls past a 30 s box).
            self.status(f"finding {small.id}: control arms")
            small = escalate(add_controls(self.session, small, deadline=deadline))
        worst = small.worst_class()
        if worst in DIVERGENT_CLASSES and (any(k.cls != worst for k in new) or any(m.key.cls != worst for m in joined)):
            # Its class changed since it was keyed (the float32 control re-filed a near tie as
            # corruption; a wall-clock engine's confirmation): the keys are the finding's now.
            # AJ + AH on Ray in bfloat16 at a429c6d: a corruption finding was filed under the
            # near-tie key it had before its controls, and shown among the ties.
            joined, new = [], rule.keys_of(small)
        self.status("fuzzing")
        measured = rule.verdicts_of(small.explanation)
        # Rule 5.22: the new key's verdicts measured on a minimal witness (the rest came from the
        # original's checks, or from a witness the box cut short).
        minimal = set(measured) if _minimal(small) else set()
        out = list(joined)
        for key in new:
            if key.explained_by is None:
                # The minimal witness's ablation, over the checks the original one had.
                key = key.model_copy(update={"verdicts": {**key.verdicts, **measured}})
            # The merge check: the full key against the buckets once more, each candidate's own
            # witness measured on what the new key tried and its key lacks (both directions).
            measured_cands = [self._measured(b, list(key.verdicts)) for b in rule.candidates(key, self.alive)]
            key, measured_cands = self._enforce_on(small, key, measured_cands)  # rule 5.20 here too
            cands = [b for b in measured_cands if rule.agrees(key, b.key)
                     and not rule.name_unearned(key, b.key, b.key.verdicts)]  # rule 5.7 here too
            again = None if cands else self._rewitnessed(key, minimal)
            unsettled_in = None if cands or again is not None else self._unsettled(key, minimal)
            if cands:
                out.append(BucketMembership(bucket=cands[0].id, key=key, status="triaged",
                                            how="merge check: agrees after full triage"))
            elif again is not None and again[1]:
                r = again[0]
                out.append(BucketMembership(
                    bucket=r.bucket, key=key, status="triaged", rewitness=r,
                    how=(f"merge check after rule 5.22: the bucket's own witness, not minimal, was minimized further "
                         f"({r.requests[0]} -> {r.requests[1]} requests, {r.tokens[0]} -> {r.tokens[1]} tokens) and "
                         "agrees")))
            elif unsettled_in is not None:
                b, split = unsettled_in
                out.append(BucketMembership(
                    bucket=b.id, key=key, status="triaged", unsettled=split,
                    how=(f"split unsettled (rule 5.22): its key differs from this bucket's only on {', '.join(split)}, "
                         "where the divergence disappeared on a witness whose minimization did not finish, and the "
                         "campaign's budget left no box to finish it (`kvfuzz minimize` then `kvfuzz explain` on "
                         "both witnesses settle it)")))
            else:
                out.append(BucketMembership(bucket=key.digest(), key=key, status="opened",
                                            description=rule.describe(key, small), how="new key",
                                            rewitness=again[0] if again is not None else None))
        return self._done(dataclasses.replace(checked, finding=small), small, out,
                          "opened" if any(m.status == "opened" for m in out) else "joined")

    def _smaller_if_split(self, small: Finding, new: list[BucketKey], victim: str | None) -> Finding:
        """Rule 5.21: a witness whose minimization did not finish, about to open a bucket only
        because its removal verdicts differ from a live bucket's, is minimized further (one more
        box) and ablated again, and the merge check reads the smaller one. A large witness's
        schedule hangs on every mechanism: removing chunked prefill or KV pressure from fault
        AJ's unminimized 9-request witness moved its victim off the batch position the fault
        writes short ("needs chunked prefill, KV pressure"), while its 2-request minimum needs
        neither, as the bucket's witness did. A second cause whose needs really differ keeps
        the difference on its smaller witness, and opens its bucket with it."""
        if _minimal(small):
            return small  # minimal already: its verdicts are the key's
        measured = rule.verdicts_of(small.explanation)
        split = sorted({c for key in new if key.explained_by is None for b in self.alive
                        for c in removal_conflicts(key.model_copy(update={"verdicts": {**key.verdicts, **measured}}),
                                                   b.key)})
        if not split:
            return small
        t0, box = time.monotonic(), self._another_box()
        if box < self._original_replays * self._run_seconds or \
                (1 - MINIMIZE_BOX) * box < len(split) * (replay_seconds(small) or self._run_seconds):
            # The campaign's budget cannot pay for it, or its ablation could not measure the split
            # again on a witness no smaller (Y + P at 3 minutes: P's 18-request witness, 7 s a
            # replay, came back from a further minimization with nothing measured): rule 5.22 decides.
            self._unpaid = True
            return small
        self.status(f"finding {small.id}: its key differs from a bucket's only on {', '.join(split)}: "
                    "minimizing further (rule 5.21)")
        smaller = self._further(small, victim, t0, box, "rule 5.21", "before the merge check: on the larger witness "
                                f"its key differed from a bucket's only on {', '.join(split)}", split)
        return small if smaller is None else smaller

    def _further(self, witness: Finding, victim: str | None, t0: float, box: float, rule_name: str,
                 why: str, split: list[str]) -> Finding | None:
        """Rules 5.21 and 5.22: ``witness`` minimized further (``MINIMIZE_BOX`` of ``box``; a
        minimization its budget cut after the structure passes goes on at the numbers pass) and
        ablated again by ``t0 + box``, its note saying so; None when it did not get smaller."""
        smaller = finish_finding(self.session, witness, out=self.out, do_minimize=True, controls=False,
                                 max_seconds=max(1.0, MINIMIZE_BOX * box), victim=victim, recorded_here=True)
        if size(smaller.trace) >= size(witness.trace):
            return None
        smaller.explanation = self._ablation(smaller, victim, t0 + box, first=split)
        (n0, k0), (n1, k1) = size(witness.trace), size(smaller.trace)
        smaller.notes[rule_name] = f"minimized further ({n0} -> {n1} requests, {k0} -> {k1} tokens) {why}"
        return smaller

    def _rewitnessed(self, key: BucketKey, minimal: set[str]) -> tuple[Rewitness, bool] | None:
        """Rule 5.22, mid-campaign: the earliest live bucket ``key`` differs from only on removal
        verdicts where the bucket's own witness (its regression case, whose minimization did not
        finish) made the divergence disappear and ``key`` persisted, is minimized further in one
        more box and ablated again (rule 5.21 from the bucket's side). Returns the smaller
        witness (written to ``OUT/rewitnessed/<id>.json`` for the campaign to make the bucket's
        case) and whether ``key`` agrees with the bucket on it; None when no bucket is so, no box
        pays, or the witness did not shrink. Fault AQ at 10 minutes (2b860da): trace 35's
        witness, cut by its box at 5 requests, "needed chunked prefill"; trace 41's, minimal at 3
        requests, did not, and opened a second bucket."""
        if key.explained_by is not None or not (self.settings.minimize and self.settings.ablate):
            return None
        for b in self.alive:
            if b.key.base != key.base:
                continue
            split = unsettled(key, b.key, key_minimal=minimal, bucket_minimal=False)
            if not split or any(key.verdicts[m] == "disappears" for m in split):
                continue
            witness = self._witness(b)
            if witness is None or _minimal(witness) or not self._box_pays():
                continue
            t0, box = time.monotonic(), self._another_box()
            victim = rule.victim_of(witness, b.key)
            self.status(f"bucket {b.id}: its witness differs from finding's only on {', '.join(split)}: "
                        "minimizing it further (rule 5.22)")
            smaller = self._further(witness, victim, t0, box, "rule 5.22", f"as bucket {b.id}'s witness: on the "
                                    f"larger one it differed from a later finding's key only on {', '.join(split)}",
                                    split)
            if smaller is None:
                continue
            measured = rule.verdicts_of(smaller.explanation)
            again = b.key.model_copy(update={"verdicts": {**b.key.verdicts, **measured}})
            rel = Path("rewitnessed") / f"{b.id}.json"
            save(smaller, self.out / rel)
            (n0, k0), (n1, k1) = size(witness.trace), size(smaller.trace)
            r = Rewitness(bucket=b.id, case=str(rel), verdicts=measured, description=rule.describe(again, smaller),
                          requests=(n0, n1), tokens=(k0, k1))
            return r, rule.agrees(key, again) and not rule.name_unearned(key, again, again.verdicts)
        return None

    def _unsettled(self, key: BucketKey, minimal: set[str]) -> tuple[Bucket, list[str]] | None:
        """Rule 5.22: the earliest live bucket ``key`` differs from only on removal verdicts whose
        "disappears" side was measured on a witness whose minimization did not finish, where the
        campaign's budget left no box to finish it — rule 5.21 was not paid for on the new
        witness, or no box pays for minimizing the bucket's own further (``_rewitnessed``). With
        the mechanisms. Fault AQ (written after rule 5.21) split in-process at 3 minutes so: its
        two findings came at traces 35 and 41 of 42, each witness cut by its box at 5 requests,
        one "needing chunked prefill"."""
        if key.explained_by is not None:
            return None
        for b in self.alive:
            if b.key.base != key.base:
                continue
            witness = self._witness(b)
            split = unsettled(key, b.key, key_minimal=minimal,
                              bucket_minimal=witness is None or _minimal(witness))  # unreadable: no claim
            if not split:
                continue
            if any(key.verdicts[m] == "disappears" for m in split) and not self._unpaid:
                continue  # rule 5.21 was paid for (or not asked): its smaller witness's verdicts stand
            if any(key.verdicts[m] == "persists" for m in split) and self._box_pays():
                continue  # a box paid for the bucket's witness and it did not shrink: the split stands
            return b, split
        return None

    def _another_box(self) -> float:
        """Seconds of one more new-bucket box from now, capped by the campaign's budget."""
        end = self.campaign_end
        return self.new_bucket_box if end is None else min(self.new_bucket_box, end - time.monotonic())

    def _box_pays(self) -> bool:
        """Whether one more box pays for the replays of the trace a minimization makes (rule
        5.21's test)."""
        return self._another_box() >= self._original_replays * self._run_seconds

    def _ablation(self, witness: Finding, victim: str | None, deadline: float,
                  first: list[str] | None = None) -> Explanation:
        """The causal ablation of a new bucket's witness, judged on the key's victim where the
        witness shows it diverging (else on the witness's own choice of victim); ``first``
        ablated first (the mechanisms a split hangs on)."""
        kept = victim if victim in {d.request_id for d in witness.divergences} else None
        return explain(self.session, witness, victim=kept, deadline=deadline, first=first)

    @property
    def _original_replays(self) -> int:
        """Replays of the whole trace a minimization that shrinks nothing makes: verifying it,
        and on a wall-clock engine accepting it first."""
        return 1 if self.session.step_exact else 2

    def _confirm(self, checked: Checked, deadline: float | None = None) -> Checked:
        """The same trace up to ``confirm_runs`` times in every arm it ran in: the rate. A new
        bucket's confirmation is inside its triage box (``deadline``): issue 30 measured an
        18-request finding whose confirmation ran 88 s past a campaign's budget."""
        rec = self.session.confirm(checked.recording, self.confirm_runs, deadline=deadline)
        again = self.session.verdicts_of(rec, carry=checked.finding)
        if self.settings.attribute and checked.finding is not None and checked.finding.attribution is not None:
            late = deadline is not None and time.monotonic() >= deadline
            again = explain_guarded(self.guard, again, runs=1 if late else self.confirm_runs, first=self.explanations)
        return again

    # -- filing --------------------------------------------------------------------------------------
    def _place(self, checked: Checked, f: Finding, keys: list[BucketKey], *, status: str, how: str) -> Triaged:
        """Keys matched by base alone (engine crashes; findings past the share with no bucket
        of their kind): the earliest agreeing bucket, else a new one."""
        out = []
        for key in keys:
            cands = rule.candidates(key, self.alive)
            if cands:
                out.append(BucketMembership(bucket=cands[0].id, key=key, status=status, how=how))  # type: ignore[arg-type]
            else:
                out.append(BucketMembership(bucket=key.digest(), key=key, status="opened" if status != "assigned"
                                            else "assigned", description=rule.describe(key, f, triaged=status != "assigned"),
                                            how=how))
        return self._done(checked, f, out, status)

    def _done(self, checked: Checked, f: Finding, memberships: list[BucketMembership], status: str) -> Triaged:
        if memberships and (self._evidence or self._checks or self._enforced):
            memberships[0] = memberships[0].model_copy(update={"evidence": dict(self._evidence),
                                                               "enforced": dict(self._enforced),
                                                               "checks": list(self._checks)})
        f.buckets = memberships
        f.bucket = memberships[0].bucket if memberships else None
        return Triaged(dataclasses.replace(checked, finding=f), memberships, status)

    @property
    def clean(self) -> list[str]:
        """The device's clean arm (every applicable fix): what an arm's toggles differ from."""
        if self.clean_arm is None:
            self.clean_arm = list(clean_set(self.session.device))
        return self.clean_arm

    @property
    def campaign_end(self) -> float | None:
        """When the campaign's budget ends (time.monotonic()), if it has one."""
        return None if self.settings.budget_s is None else self.started + self.settings.budget_s

    def _inert(self, f: Finding) -> set[str]:
        """Toggles of the clean arm and ``f``'s arms that its engine never reaches."""
        return unreachable({*self.clean, *(t for ts in f.arms.values() for t in ts)}, f.trace.engine)

    @property
    def over_budget(self) -> bool:
        end = self.campaign_end
        return end is not None and time.monotonic() >= end

    def _outlasts_budget(self, checked: Checked, t_run: float) -> bool:
        """Whether the attribution re-runs (one per arm it may add, each about as long as the
        trace's own run) would end past the campaign's budget: a finding of a known bucket is
        then filed by its pre-key (issue 30: two 30 s LoRA-bug attributions started 16 s before
        the end of a 3-minute campaign)."""
        end = self.campaign_end
        if end is None or not self.settings.attribute or checked.finding is None:
            return False
        return time.monotonic() + t_run * self._attribution_runs(checked) > end

    def _attribution_runs(self, checked: Checked) -> int:
        """The re-runs attribution may add for ``checked``'s finding (one per arm), each about as
        long as the trace's own run."""
        f = checked.finding
        if f is None or not self.settings.attribute:
            return 0
        return len(plan({d.arm for d in f.divergences if d.class_ in DIVERGENT_CLASSES}, checked.recording.arms,
                        self.clean, self._inert(f)))

    def _outlasts_share(self, checked: Checked, t_run: float) -> bool:
        """Whether matching this finding in full (its attribution re-runs and up to
        ``rule.MAX_CHECKS`` check replays, each about as long as the trace's own run) would take
        the time on known buckets past the share: it is then assigned. The share was checked
        only before a match, so each match could overshoot it by its whole cost: fault AS, a
        frequent one, spent 28% of a 3-minute bfloat16 campaign in triage at bce9bfc (ran at
        0.60x the clean rate), its matches 15-20 s each on this machine."""
        if checked.finding is None:
            return False
        return t_run * (self._attribution_runs(checked) + rule.MAX_CHECKS) > self._share_left()

    def _share_left(self) -> float:
        """Seconds the known buckets may still take: their share of the time so far, less what
        they took (negative past it)."""
        return self.share * max(1.0, time.monotonic() - self.started) - self.known_seconds

    @property
    def over_share(self) -> bool:
        return self._share_left() < 0


def _minimal(f: Finding) -> bool:
    """Whether ``f``'s minimization ran to its end and was verified (a 1-minimal witness)."""
    m = f.minimization
    return m is not None and m.stopped is None and m.verified


def _enforced_words(key: BucketKey) -> list[str]:
    """Rule 5.20's outcomes on ``key``, as a finding's ``how`` lists them."""
    return [f"enforced {n} {o}" for n, o in sorted(key.enforced.items())]


def build_triage(settings: CampaignSettings, session: Session, guard: Recovering, out: Path, *,
                 status: Callable[[str], None] = lambda _m: None) -> CampaignTriage:
    """The one way a campaign's triage is made (``kvfuzz run``, each Ray worker, ``kvfuzz bench``)."""
    return CampaignTriage(session, guard, settings.arms, out, settings=settings.triage,
                          confirm_runs=settings.session.runs, status=status)
