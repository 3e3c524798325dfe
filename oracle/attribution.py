"""Attribution: which toggle explains a divergence, or none (a candidate new vLLM bug).

Pure functions over verdicts and arm definitions (no engine, no vLLM). The reasoning:

- The *clean* arm is the best-known-correct vLLM on this device: every applicable fix on, no
  fault. A divergence there has nothing to blame: it is **unexplained**.
- Any other arm differs from clean by a few toggles (its *candidates*): faults or extra fixes
  it turns on, clean fixes it leaves off. A divergence of request R in such an arm is
  explained when R is fine in the clean arm: by the only candidate, or, with several, by the
  candidate whose single-toggle arm (clean with just that difference) reproduces it.
- If R also diverges in the clean arm, the arm's toggles do not explain it: unexplained.
- Without a clean run to compare with, nothing is claimed (unexplained, with a note).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvfuzz.traces import Divergence
from kvfuzz.traces.finding import DIVERGENT_CLASSES

CLEAN = "clean"


def candidates(arm_toggles: Iterable[str], clean: Iterable[str], inert: Iterable[str] = ()) -> list[str]:
    """Toggles by which an arm differs from the clean arm, in a stable order; ``inert`` ones
    (whose code path the trace's engine never reaches: ``harness.toggles.unreachable``) are no
    difference — they can explain nothing."""
    a, c, i = set(arm_toggles), set(clean), set(inert)
    return sorted(a - c - i) + sorted(c - a - i)


def single_arm(toggle: str, clean: Iterable[str]) -> tuple[str, list[str]]:
    """The arm that differs from clean by exactly ``toggle``: (name, toggles)."""
    c = sorted(clean)
    if toggle in c:
        return f"without:{toggle}", [t for t in c if t != toggle]
    return f"with:{toggle}", sorted([*c, toggle])


def _same(a: Iterable[str], b: Iterable[str]) -> bool:
    return set(a) == set(b)


def find_arm(arms: Mapping[str, list[str]], toggles: Iterable[str]) -> str | None:
    for name, ts in arms.items():
        if _same(ts, toggles):
            return name
    return None


def plan(diverged_arms: Iterable[str], arms: Mapping[str, list[str]], clean: list[str],
         inert: Iterable[str] = ()) -> dict[str, list[str]]:
    """Arms to run in addition to ``arms`` so every divergence in ``diverged_arms`` can be
    attributed: the clean arm, and a single-toggle arm per candidate when an arm has several."""
    extra: dict[str, list[str]] = {}
    have = dict(arms)

    def need(name: str, toggles: list[str]) -> None:
        if find_arm(have, toggles) is None:
            extra[name] = toggles
            have[name] = toggles

    for arm in diverged_arms:
        cands = candidates(arms[arm], clean, inert)
        if not cands:
            continue  # the arm is the clean arm on this trace: nothing to compare with
        need(CLEAN, sorted(clean))
        if len(cands) > 1:
            for t in cands:
                need(*single_arm(t, clean))
    return extra


def singles_needed(verdicts: Iterable[Divergence], arms: Mapping[str, list[str]], clean: list[str],
                   inert: Iterable[str] = ()) -> bool:
    """Whether the single-toggle arms ``plan`` adds can change any attribution, given the
    clean arm's verdicts: only for a divergence, in an arm with several candidates, of a
    request that is fine in the clean arm (one that also diverges there is unexplained
    whatever the single arms show). Running clean first and the single arms only when this
    holds gives the same attributions for fewer runs (running them all can spend minutes of a
    short campaign on LoRA-fix arms for a trace without adapters).
    A divergence that a single-toggle arm already run reproduces needs no more of them: it is
    explained by that toggle (a campaign runs the single arms of its buckets' explanations
    first; triage/attribution.py)."""
    vs = list(verdicts)
    clean_arm = find_arm(arms, clean)

    def diverging(arm: str | None, v: Divergence) -> set[str]:
        return _divergent_requests(vs, arm, noise=v.class_ == "numeric-near-tie") if arm else set()

    def reproduced(v: Divergence, cands: list[str]) -> bool:
        return any(v.request_id in diverging(find_arm(arms, single_arm(t, clean)[1]), v) for t in cands)

    for v in vs:
        cands = candidates(arms.get(v.arm, []), clean, inert)
        if (v.class_ in DIVERGENT_CLASSES and len(cands) > 1 and v.request_id not in diverging(clean_arm, v)
                and not reproduced(v, cands)):
            return True
    return False


def _divergent_requests(verdicts: Iterable[Divergence], arm: str, *, noise: bool = True) -> set[str]:
    """Requests that diverge in ``arm``; without ``noise``, a numeric near tie does not count:
    a corruption that became a flipped near tie in another arm disappeared there (16-bit noise
    remains in every arm). A bfloat16 LoRA-bug corruption was filed unexplained because its
    request flipped a near tie 83 tokens later in the clean arm."""
    return {v.request_id for v in verdicts if v.arm == arm and v.class_ in DIVERGENT_CLASSES
            and (noise or v.class_ != "numeric-near-tie")}


def attribute(verdicts: list[Divergence], arms: Mapping[str, list[str]], clean: list[str],
              inert: Iterable[str] = ()) -> list[Divergence]:
    """Fill ``explained_by`` (and a short ``detail`` suffix) on every divergent verdict."""
    inert = sorted(set(inert))
    clean_arm = find_arm(arms, clean)
    single = {t: find_arm(arms, single_arm(t, clean)[1]) for name in arms for t in candidates(arms[name], clean, inert)}
    # A near tie is matched by any divergence elsewhere; anything worse only by worse than a
    # near tie (a corruption that is a near tie in clean disappeared there).
    by_noise = {}
    for noise in (True, False):
        by_noise[noise] = (_divergent_requests(verdicts, clean_arm, noise=noise) if clean_arm else set(),
                           {t: _divergent_requests(verdicts, a, noise=noise) for t, a in single.items() if a is not None})
    out = []
    for v in verdicts:
        if v.class_ not in DIVERGENT_CLASSES:
            out.append(v)
            continue
        clean_div, single_div = by_noise[v.class_ == "numeric-near-tie"]
        every = candidates(arms.get(v.arm, []), clean)
        cands = [t for t in every if t not in inert]
        why: str | None = None
        note: str
        if not cands and every:
            note = ("unexplained: its arm differs from clean only by toggles this trace's engine never reaches "
                    f"({', '.join(every)})")
        elif not cands:
            note = "unexplained: diverges with every applicable fix on and no fault"
        elif clean_arm is None:
            note = "not attributed: the clean arm was not run"
        elif v.request_id in clean_div:
            note = f"unexplained: also diverges in the clean arm ({clean_arm!r})"
        elif len(cands) == 1:
            why = cands[0]
            note = f"explained by {why}: clean in arm {clean_arm!r}"
        else:
            hits = [t for t in cands if v.request_id in single_div.get(t, set())]
            why = hits[0] if hits else "+".join(cands)
            note = (f"explained by {why}: reproduces with only that toggle changed" if hits
                    else f"explained by the combination {why}: no single toggle reproduces it")
        detail = f"{v.detail}; {note}" if v.detail else note
        out.append(v.model_copy(update={"explained_by": why, "detail": detail}))
    return out


def unexplained(divergences: Iterable[Divergence]) -> list[Divergence]:
    """Divergences no toggle explains: candidate new vLLM bugs (near-ties included, they are
    reported but are usually floating-point noise)."""
    return [d for d in divergences if d.class_ in DIVERGENT_CLASSES and d.explained_by is None]


def loudest_first(divergences: Iterable[Divergence]) -> list[Divergence]:
    """Unexplained first, then by severity."""
    from kvfuzz.traces.finding import SEVERITY

    return sorted(divergences, key=lambda d: (d.explained_by is not None, SEVERITY[d.class_], d.arm, d.request_id))

