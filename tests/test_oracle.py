"""Oracle logic on constructed histories (pure; no engine)."""

import pytest

from kvfuzz.oracle import ENGINE, NoiseBounds, check, compare, wilson
from kvfuzz.traces import At, GenPrompt, History, RequestRecord, Scoring, SendEvent, Trace


def rec(rid, tokens, margins=None, **kw):
    margins = margins or [1.0] * len(tokens)
    lps = [[(t, -0.1), (t + 1, -0.1 - m)] for t, m in zip(tokens, margins)]
    return RequestRecord(request_id=rid, token_ids=list(tokens), logprobs=lps, finish_reason=kw.pop("finish_reason", "length"), **kw)


def trace(n=1, max_tokens=4):
    return Trace(events=[SendEvent(request_id=f"r{i}", at=At(step=0), prompt=GenPrompt(length=8, seed=i),
                                   max_tokens=max_tokens) for i in range(n)])


def hist(requests, run=0, **kw):
    return History(trace_id="t", engine="inprocess", run_index=run, requests={r.request_id: r for r in requests}, **kw)


REF = rec("r0", [1, 2, 3, 4], margins=[2.0, 0.0005, 1.5, 0.5])


FP32 = NoiseBounds(dtype="float32", near_tie=1e-3, drift=1e-3, teacher=1e-3)


def verdict(runs, ref=REF, th=FP32, scores=()):
    (v,) = [d for d in check(trace(), runs, {"r0": ref}, th, scores) if d.request_id == "r0"]
    return v


def test_identical_is_ok():
    v = verdict([hist([rec("r0", [1, 2, 3, 4])]) for _ in range(3)])
    assert v.class_ == "ok" and v.runs_diverged == 0 and v.runs == 3 and v.variants == 1


def test_cancelled_prefix_is_truncation_not_divergence():
    v = verdict([hist([rec("r0", [1, 2], cancelled=True, finish_reason="abort")])])
    assert v.class_ == "truncation" and v.runs_diverged == 0


def test_divergence_with_large_margin_is_corruption():
    v = verdict([hist([rec("r0", [1, 2, 9, 9])]), hist([rec("r0", [1, 2, 3, 4])], run=1)])
    assert v.class_ == "corruption"
    assert v.first_divergence == 2 and v.margin == pytest.approx(1.5)
    assert v.runs_diverged == 1 and v.runs == 2 and v.variants == 2


def test_divergence_at_a_near_tie_is_numeric():
    # The run's own choice is a near tie too (margin 0.0003): noise flips a tie into a tie.
    v = verdict([hist([rec("r0", [1, 7, 3, 4], margins=[1, 0.0003, 1, 1])])])
    assert v.class_ == "numeric-near-tie" and v.first_divergence == 1 and v.evidence == []
    assert v.run_margin == pytest.approx(0.0003) and "noise by every measure" in v.detail


def test_a_near_tie_the_run_wins_by_far_is_corruption():
    """The reference's tie was near (0.0005), but the run chose its token by 0.5 nats: the
    pair's logit gap moved by >= 0.5, far more than noise moves it."""
    v = verdict([hist([rec("r0", [1, 7, 3, 4], margins=[1, 0.5, 1, 1])])])
    assert v.class_ == "corruption" and v.evidence == ["margin"]
    assert "the run's own margin 0.5" in v.detail and v.run_margin == pytest.approx(0.5)


@pytest.mark.parametrize("margin,expected", [(0.000999, "numeric-near-tie"), (0.001, "corruption"), (0.0011, "corruption")])
def test_threshold_boundary(margin, expected):
    ref = rec("r0", [1, 2, 3, 4], margins=[margin, 1, 1, 1])
    assert verdict([hist([rec("r0", [5, 2, 3, 4], margins=[0, 1, 1, 1])])], ref=ref).class_ == expected


def test_cancelled_but_wrong_is_still_a_divergence():
    v = verdict([hist([rec("r0", [1, 2, 8], cancelled=True, finish_reason="abort")])])
    assert v.class_ == "corruption"


def test_errors_and_crashes():
    assert verdict([hist([rec("r0", [], error="HTTP 500: boom", finish_reason=None)])]).class_ == "error"
    crashed = hist([rec("r0", [1], finish_reason=None)], crashed=True, crash_detail="server died")
    v = verdict([crashed])
    assert v.class_ == "engine-crash" and "server died" in v.detail


def test_crash_that_hit_no_request_is_reported_on_the_engine():
    h = hist([rec("r0", [1, 2, 3, 4])], crashed=True, crash_detail="died after the last request")
    vs = check(trace(), [h], {"r0": REF})
    assert any(d.request_id == ENGINE and d.class_ == "engine-crash" for d in vs)


def test_only_the_victim_is_named():
    t = trace(n=2)
    ref = {"r0": REF, "r1": rec("r1", [5, 6, 7, 8])}
    h = hist([rec("r0", [1, 2, 3, 4]), rec("r1", [5, 6, 0, 0])])
    vs = {d.request_id: d.class_ for d in check(t, [h], ref)}
    assert vs == {"r0": "ok", "r1": "corruption"}


def test_compare_uses_reference_prefix_for_shorter_requests():
    assert compare(rec("x", [1, 2, 3, 4, 5, 6]), rec("x", [1, 2, 3]), expected_len=3).kind == "same"


def test_wilson():
    lo, hi = wilson(3, 3)
    assert 0.43 < lo < 0.44 and hi == 1.0
    assert wilson(0, 10)[0] == 0.0
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(1 - hi)


# -- thresholds per dtype, boundaries, end-of-sequence, aggregation -------------------------------

from kvfuzz.oracle.noise import DEFAULTS, HEADROOM, bounds_from, default_bounds, measure_context, resolution  # noqa: E402
from kvfuzz.traces import EngineConfig  # noqa: E402
from kvfuzz.traces.calibration import CalibrationProfile, ContextNoise, NoiseKey  # noqa: E402


def test_default_bounds_depend_on_dtype():
    assert default_bounds("float32").near_tie == DEFAULTS["float32"]["near_tie"] == 1e-3
    assert default_bounds("bf16") == default_bounds("torch.bfloat16") == default_bounds("bfloat16")
    assert default_bounds("half").dtype == "float16"
    for d in ("float32", "bfloat16", "float16"):
        b = default_bounds(d)
        assert b.source == "default" and b.profile is None
        assert min(b.near_tie, b.drift, b.teacher) >= 2 * resolution(d)  # never finer than the dtype
    # Unknown / auto: the widest defaults (never call 16-bit noise corruption).
    assert default_bounds("auto").near_tie == max(v["near_tie"] for v in DEFAULTS.values())
    b = default_bounds("float32").with_overrides(near_tie=0.2, drift=None)
    assert b.near_tie == 0.2 and b.drift == 1e-3 and b.overrides == ("near_tie",)
    assert "overridden: near_tie" in b.describe()


def test_resolution_is_one_logit_step_between_16_and_32():
    assert resolution("bfloat16") == 0.125 and resolution("float16") == 2 ** -6 and resolution("float32") == 2 ** -19


def _profile(dtype="bfloat16", **ctx):
    key = NoiseKey(device="cpu", device_name="test cpu", dtype=dtype, model="m")
    return CalibrationProfile(key=key, contexts=[ContextNoise(name="batched", **ctx)], prefill_vs_decode=0.01)


def test_bounds_from_a_profile_are_the_measured_maxima_times_the_headroom_above_a_floor():
    b = bounds_from(_profile(max_dmargin=0.1, max_dlogprob=0.05, max_teacher=0.08, flip_shifts=[0.12]))
    assert b.source == "profile" and b.profile == _profile().id
    assert b.near_tie == pytest.approx(HEADROOM * 0.12)  # the largest of |d margin| and the flips' shifts
    assert b.drift == pytest.approx(max(HEADROOM * 0.05, 0.25))
    assert b.teacher == pytest.approx(HEADROOM * 0.08)
    tiny = bounds_from(_profile(max_dmargin=1e-6))  # a profile that saw no noise still has a floor
    assert tiny.near_tie == tiny.drift == tiny.teacher == 2 * resolution("bfloat16")
    f32 = bounds_from(_profile("float32", max_dmargin=2e-5, max_dlogprob=1e-5, max_teacher=1e-5))
    assert f32.near_tie == pytest.approx(8e-5) and f32.teacher == pytest.approx(HEADROOM * 0.01)


def test_a_prompt_measured_in_a_batch_widens_the_bound_that_judges_prompt_logprobs():
    # The alone run and the batched run of one prompt: its logprobs moved by 3e-5 at one position.
    alone = rec("c0", [1, 2], prompt_logprobs=[[(7, -1.0)], [(8, -2.0)]])
    batched = rec("c0", [1, 2], prompt_logprobs=[[(7, -1.0)], [(8, -2.00003)]])
    ctx = measure_context("batched", {"c0": alone}, {"c0": batched}, {})
    assert ctx.max_prompt == pytest.approx(3e-5)
    profile = CalibrationProfile(key=NoiseKey(device="cpu", device_name="t", dtype="float32", model="m"),
                                 contexts=[ctx], prefill_vs_decode=1e-7)
    assert bounds_from(profile).teacher == pytest.approx(HEADROOM * 3e-5)
    # Without it the teacher bound is what teacher forcing alone measured.
    assert bounds_from(profile.model_copy(update={"contexts": [ctx.model_copy(update={"max_prompt": 0.0})]})).teacher \
        == pytest.approx(2 * resolution("float32"))


def _dtype_trace(dtype):
    return Trace(engine=EngineConfig(dtype=dtype), events=trace().events)


@pytest.mark.parametrize("dtype,margin,expected", [
    ("float32", 0.125, "corruption"),       # far above fp32 batch-order noise (docs/oracle.md)
    ("bfloat16", 0.125, "numeric-near-tie"),  # one bf16 step at logits 16-32: the reports' flips
    ("bfloat16", 0.0, "numeric-near-tie"),    # exact tie
    ("bfloat16", DEFAULTS["bfloat16"]["near_tie"], "corruption"),  # at the bound: not below it
    ("float32", 0.0, "numeric-near-tie"),
    ("float32", 2.05e-5, "numeric-near-tie"),  # the largest fp32 noise measured on CPU
])
def test_classification_follows_the_engine_dtype(dtype, margin, expected):
    ref = rec("r0", [1, 2, 3, 4], margins=[1, margin, 1, 1])
    run = rec("r0", [1, 7, 3, 4], margins=[1, 0.0, 1, 1])
    (v,) = [d for d in check(_dtype_trace(dtype), [hist([run])], {"r0": ref}) if d.request_id == "r0"]
    assert v.class_ == expected and v.margin == pytest.approx(margin)


def test_early_end_of_sequence_is_a_divergence_judged_by_margin():
    # Stopped (EOS) after 2 tokens where the reference went on: the run chose EOS over token 3.
    stopped = rec("r0", [1, 2], finish_reason="stop")
    v = verdict([hist([stopped])])
    assert v.class_ == "corruption" and v.first_divergence == 2 and v.margin == pytest.approx(1.5)
    assert "end of sequence" in v.detail
    near = rec("r0", [1], finish_reason="stop")  # position 1 has reference margin 0.0005
    assert verdict([hist([near])]).class_ == "numeric-near-tie"


def test_shorter_streams_that_agree_are_truncation():
    for r in [rec("r0", [1, 2, 3], cancelled=True, finish_reason="abort"),
              rec("r0", [], cancelled=True, finish_reason="abort"),   # cancelled in prefill
              rec("r0", [1, 2], finish_reason="length")]:            # cut short, no stop decision
        v = verdict([hist([r])])
        assert v.class_ == "truncation" and v.runs_diverged == 0 and v.first_divergence is None


def test_unknown_margin_is_corruption_and_says_so():
    ref = RequestRecord(request_id="r0", token_ids=[1, 2, 3, 4], finish_reason="length")  # no logprobs
    v = verdict([hist([rec("r0", [1, 9, 3, 4])])], ref=ref)
    assert v.class_ == "corruption" and v.margin is None and "unknown" in v.detail


def _masked_at(r, i):
    """``r`` as vLLM reports a position where every token was masked: NaN logprobs."""
    r.logprobs[i] = [(r.token_ids[i], float("nan")), (r.token_ids[i] + 1, float("nan"))]
    return r


def test_a_flip_where_every_token_was_masked_is_not_noise():
    """NaN logprobs (vLLM's report for a fully masked row) give no margin: no evidence of noise."""
    ref = _masked_at(rec("r0", [1, 2, 3, 4]), 1)
    v = verdict([hist([_masked_at(rec("r0", [1, 7, 3, 4]), 1)])], ref=ref)
    assert v.class_ == "corruption" and "NaN" in v.detail


@pytest.mark.parametrize("run_masked, expected", [(True, "numeric-near-tie"), (False, "corruption")])
def test_nan_logprobs_before_a_near_tie_agree_only_with_nan(run_masked, expected):
    ref = _masked_at(rec("r0", [1, 2, 3, 4], margins=[1, 0.0005, 1, 1]), 0)
    run = rec("r0", [1, 7, 3, 4], margins=[1, 0.0003, 1, 1])
    v = verdict([hist([_masked_at(run, 0) if run_masked else run])], ref=ref)
    assert v.class_ == expected


def test_runner_up_is_named_when_the_run_took_a_third_choice():
    v = verdict([hist([rec("r0", [1, 2, 99, 4])])])  # reference runner-up at 2 is 4 (3 + 1)
    assert v.class_ == "corruption" and "not even the reference's runner-up (4)" in v.detail
    v = verdict([hist([rec("r0", [1, 2, 4, 4])])])
    assert "runner-up" not in v.detail


def test_aggregation_over_runs_worst_class_rates_and_variants():
    runs = [hist([rec("r0", [1, 7, 3, 4], margins=[1, 0.0001, 1, 1])], run=0),   # near tie at 1
            hist([rec("r0", [1, 2, 9, 4])], run=1),   # corruption at 2
            hist([rec("r0", [1, 2, 9, 4])], run=2),   # same corrupt variant
            hist([rec("r0", [1, 2, 3, 4])], run=3)]   # clean
    v = verdict(runs)
    assert v.class_ == "corruption" and v.runs_diverged == 3 and v.runs == 4
    assert v.variants == 3  # three distinct sequences: near-tie, corrupt, clean
    assert v.first_divergence == 1 and v.margin == pytest.approx(0.0005)  # the earliest divergence
    lo, hi = wilson(3, 4)
    assert (v.rate_low, v.rate_high) == (pytest.approx(lo), pytest.approx(hi))
    err = verdict(runs + [hist([rec("r0", [], error="HTTP 500", finish_reason=None)], run=4)])
    assert err.class_ == "error" and err.runs_diverged == 4 and err.runs == 5


def test_missing_record_and_missing_reference_are_errors():
    assert verdict([hist([])]).class_ == "error"
    (v,) = [d for d in check(trace(), [hist([rec("r0", [1, 2, 3, 4])])], {}) if d.request_id == "r0"]
    assert v.class_ == "error" and "reference" in v.detail


def _drifted(ref_rec, positions, by):
    """A copy of ``ref_rec`` whose logprobs at ``positions`` moved by ``by`` nats."""
    lps = [list(map(list, p)) for p in ref_rec.logprobs]
    for i in positions:
        lps[i] = [[t, lp - by] for t, lp in lps[i]]
    return lps


@pytest.mark.parametrize("by,expected", [(2e-5, "numeric-near-tie"), (5e-4, "numeric-near-tie"),
                                         (0.02, "corruption")])
def test_near_tie_flip_after_logprob_drift_is_corruption(by, expected):
    """Noise that flips a near tie moves logprobs by about the tie's width; a run whose
    logprobs had drifted far beyond the threshold before the flip saw other KV (measured: a
    preemption fault flipped a 7e-4 tie after a 0.019-nat drift)."""
    ref = rec("r0", [1, 2, 3, 4], margins=[2.0, 1.0, 0.0005, 1.0])
    run = rec("r0", [1, 2, 9, 9], margins=[1, 1, 0.0001, 1])
    run.logprobs = _drifted(ref, [0, 1], by)[:2] + run.logprobs[2:]
    v = verdict([hist([run])], ref=ref)
    assert v.class_ == expected and v.first_divergence == 2 and v.drift == pytest.approx(by, rel=1e-6)
    if expected == "corruption":
        assert "drifted by" in v.detail


def test_drift_only_counts_positions_before_the_divergence():
    ref = rec("r0", [1, 2, 3, 4], margins=[0.0005, 1.0, 1.0, 1.0])
    run = rec("r0", [7, 2, 3, 4], margins=[0.0001, 1, 1, 1])  # flips at position 0: no earlier evidence
    run.logprobs = [run.logprobs[0]] + _drifted(ref, [1, 2, 3], 0.5)[1:]
    v = verdict([hist([run])], ref=ref)
    assert v.class_ == "numeric-near-tie" and v.drift is None


def test_early_end_of_sequence_at_a_near_tie_after_drift_is_corruption():
    ref = rec("r0", [1, 2, 3, 4], margins=[2.0, 0.0005, 1.5, 0.5])
    near = rec("r0", [1], finish_reason="stop")  # EOS where the reference had a 0.0005 tie
    near.logprobs = _drifted(ref, [0], 0.02)[:1]
    v = verdict([hist([near])], ref=ref)
    assert v.class_ == "corruption" and v.first_divergence == 1 and v.drift == pytest.approx(0.02)


# -- teacher forcing ---------------------------------------------------------------------------------

def _scoring(run, by_position, run_index=0):
    """A teacher-forced scoring of ``run``'s tokens whose logprob at position i differs from the
    run's by ``by_position[i]``."""
    return Scoring(request_id="r0", arm="default", run_index=run_index, token_ids=list(run.token_ids),
                   logprobs=[[(t, lp + by_position[i]), alt] for i, ((t, lp), alt) in enumerate(run.logprobs)])


@pytest.mark.parametrize("drifts,expected,over", [
    ([0.0, 0.0002, 0.0001, 0.0], "numeric-near-tie", 0),   # noise: within the bound everywhere
    ([0.0, 0.0002, 0.05, 0.3], "corruption", 2),            # wrong KV moves positions, also after the flip
])
def test_teacher_forced_drift_decides_a_near_tie(drifts, expected, over):
    run = rec("r0", [1, 7, 3, 4], margins=[1, 0.0003, 1, 1])  # a near-tie flip at 1, by margin and drift
    v = verdict([hist([run])], scores=[_scoring(run, drifts)])
    assert v.class_ == expected and v.teacher_drift == pytest.approx(max(drifts)) and v.teacher_over == over
    if expected == "corruption":
        assert v.evidence == ["teacher"] and "teacher-forced alone on a clean cache" in v.detail
        assert "at 2 of 4 positions" in v.detail
    else:
        assert "teacher-forced drift 0.0002" in v.detail


def test_a_scoring_of_another_run_or_other_tokens_is_not_used():
    run = rec("r0", [1, 7, 3, 4], margins=[1, 0.0003, 1, 1])
    other = _scoring(run, [0.0, 0.0, 0.5, 0.5], run_index=1)  # scored run 1, not run 0
    assert verdict([hist([run])], scores=[other]).class_ == "numeric-near-tie"
    wrong = _scoring(run, [0.0, 0.0, 0.5, 0.5])
    wrong.token_ids = [1, 2, 3, 4]  # the reference's tokens, not the run's
    v = verdict([hist([run])], scores=[wrong])
    assert v.class_ == "numeric-near-tie" and v.teacher_drift is None


def test_bfloat16_blind_spot_cases_are_corruption_with_teacher_forcing():
    """The self-test cases that margins alone miss in bfloat16, in miniature: a 16-bit flip at a
    0.125 margin (one bf16 step) whose run saw an adapter's delta: tiny by the margin, but the
    run's own tokens, scored alone, are off by far more than bf16 noise."""
    bf16 = default_bounds("bfloat16")
    ref = rec("r0", [1, 2, 3, 4], margins=[0.125, 1, 1, 1])
    run = rec("r0", [5, 2, 3, 4], margins=[0.0, 1, 1, 1])
    (v,) = [d for d in check(_dtype_trace("bfloat16"), [hist([run])], {"r0": ref}, bf16) if d.request_id == "r0"]
    assert v.class_ == "numeric-near-tie"
    scored = _scoring(run, [0.9, 1.1, 0.7, 1.3])
    (v,) = [d for d in check(_dtype_trace("bfloat16"), [hist([run])], {"r0": ref}, bf16, [scored])
            if d.request_id == "r0"]
    assert v.class_ == "corruption" and v.evidence == ["teacher"] and v.teacher_over == 4
