"""``kvfuzz calibrate``: measure how far batch-order floating-point noise moves temperature-0
logprobs on this device, dtype, model and engine flags, and write the profile the oracle's
noise bounds come from (traces/calibration.py, oracle/noise.py, docs/oracle.md).

Each request runs alone on a clean cache (its reference, decode), is scored alone by teacher
forcing (what that comparison itself adds: prefill vs decode), and runs in batch contexts:
all at once (and prompts split by chunked prefill when the batch exceeds the token budget),
staggered (later requests hit the prefix cache of earlier ones), reversed, in bursts, and
under KV pressure that preempts and recomputes some of them. In every context each run is
compared with its reference and with its own tokens scored alone. Every context runs with
the clean arm's toggles (every known fix), so a known bug is not measured as noise.

A budget bounds it: contexts run in order until the time is spent (the reference and the
batched context always run), and the profile lists what ran.
"""

from __future__ import annotations

import datetime as _dt
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfuzz.harness.toggles import clean_set
from kvfuzz.oracle.noise import HEADROOM, NoiseBounds, bounds_from, measure_context
from kvfuzz.driver.session import Session
from kvfuzz.traces import At, EngineConfig, GenPrompt, History, RequestRecord, Sampling, Scoring, SendEvent, Trace
from kvfuzz.traces.calibration import (
    DEFAULT_BUDGET_S,
    CalibrationProfile,
    ContextNoise,
    NoiseKey,
    find_profile,
    load_profile,
    profile_path,
    save_profile,
)
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.trace import Binding


@dataclass(frozen=True)
class Plan:
    requests: int = 16
    max_tokens: int = 24
    seed: int = 0
    budget_s: float = DEFAULT_BUDGET_S


# Batch-order noise grows with the context a position attends to, so the calibration's prompts
# span the lengths campaigns draw (fuzzer/generate.py: up to 6,000 tokens, pressure shapes more);
# bounds measured on short prompts alone called a long prompt's noise corruption.
LONG_PROMPT = (3000, 7000)


def calibration_sends(config: EngineConfig, plan: Plan) -> list[SendEvent]:
    """The calibration requests: lengths on and next to block boundaries, some long enough to
    be split by chunked prefill in a batch, two of several thousand tokens, half sharing
    prefixes, LoRA adapters when on. The long ones and a few others ask for their prompt's
    logprobs: a prefill in a batch against the same prefill alone is a comparison the oracle
    makes (``prompt_logprobs``), so it is measured too."""
    rng = random.Random(plan.seed)
    bs = config.block_size
    fits = max(8, config.max_model_len - plan.max_tokens - 1)
    longest = min(1500, fits)
    adapters = sorted(config.lora.adapters) if config.lora.enabled else []
    sends = []
    for i in range(plan.requests):
        kind = i % 4
        long = i % 8 == 5  # of kind 1: thousands of positions of context
        if kind == 0:  # on / next to a block boundary
            length = rng.randint(1, 30) * bs + rng.choice((-1, 0, 1))
        elif long:
            length = rng.randint(*LONG_PROMPT)
        elif kind == 1:  # split by chunked prefill when batched with others
            length = rng.randint(600, 1500)
        else:
            length = rng.randint(8, 500)
        length = max(1, min(length, fits if long else longest))
        group, prefix = None, 0
        if rng.random() < 0.5:  # shared prefixes: later requests hit the prefix cache
            group = f"cal{rng.randint(0, 2)}"
            prefix = min(length, rng.choice((bs, 2 * bs, 4 * bs, 4 * bs + 3)))
        adapter = rng.choice([*adapters, None, None]) if adapters else None
        sampling = Sampling(prompt_logprobs=0) if kind == 1 else Sampling()
        sends.append(SendEvent(request_id=f"c{i}", at=At(step=0), max_tokens=plan.max_tokens, adapter=adapter,
                               sampling=sampling, prompt=GenPrompt(length=length, prefix_group=group,
                                                                   prefix_len=prefix, seed=rng.randrange(1 << 30))))
    return sends


def _at(s: SendEvent, step: int) -> SendEvent:
    return s.model_copy(update={"at": At(step=step)})


def _contexts(sends: list[SendEvent], capacity: int | None, config: EngineConfig) -> dict[str, list[SendEvent]]:
    # In order of what they add (a short budget keeps the first ones).
    out = {"batched (all at once; chunked prefill)": [_at(s, 0) for s in sends]}
    if capacity:
        # Holders fill the KV cache but for exactly the measured requests' prompts and keep
        # decoding; the measured requests arrive once the holders decode (vLLM admits a request
        # only when its whole prompt fits) and take the last free blocks. The next block anyone
        # needs makes the scheduler preempt the newest — measured — requests, and recompute them
        # later: a prefill of what decode had computed, a numeric path of its own (the fuzzer's
        # pressure shape, fuzzer/shapes.py, without its slack).
        bs, max_model_len, token_budget = config.block_size, config.max_model_len, config.max_num_batched_tokens
        # Prompts one step prefills whole: a longer one's prefill spans steps in which the
        # others decode and finish before anyone needs a block (the other contexts measure it).
        whole = [s for s in sends if s.prompt.length <= token_budget]
        blocks = capacity // bs
        hold_tokens = 256
        per = max_model_len - hold_tokens - 1
        # Seats count too (max_num_seqs): measured requests beyond the free seats wait without
        # holding blocks, and their blocks were a slack nobody outgrew (0 preemptions in 263
        # steps with 16 seats, 2 holders and 16 measured requests). So the holders
        # leave exactly the blocks of the measured requests that get a seat.
        n_hold, hold_blocks = 1, 0
        for _ in range(8):
            seated = whole[: max(1, config.max_num_seqs - n_hold)]
            hold_blocks = blocks - sum(-(-s.prompt.length // bs) for s in seated)
            need = max(1, -(-hold_blocks * bs // per))
            if need <= n_hold:
                break
            n_hold = need  # >= max_num_seqs: no seat left for a measured request (no context)
        if hold_blocks > 0 and n_hold < config.max_num_seqs:
            lengths = [hold_blocks * bs // n_hold - bs // 2] * n_hold
            holders = [SendEvent(request_id=f"hold{k}", at=At(step=0), max_tokens=hold_tokens,
                                 prompt=GenPrompt(length=n, seed=9000 + k)) for k, n in enumerate(lengths)]
            late = -(-hold_blocks * bs // token_budget) + 2
            out["preempted and recomputed (KV pressure)"] = holders + [_at(s, late) for s in whole]
    out["staggered (1 per step; prefix hits)"] = [_at(s, i) for i, s in enumerate(sends)]
    out["reversed, staggered"] = [_at(s, i) for i, s in enumerate(reversed(sends))]
    out["bursts of 4 every 7 steps"] = [_at(s, 7 * (i // 4)) for i, s in enumerate(sends)]
    return out


def calibrate(session: Session, config: EngineConfig, plan: Plan = Plan(),
              progress: Callable[[str], None] | None = None) -> CalibrationProfile:
    """Measure the noise of ``config`` on ``session``'s engine and return the profile."""
    say = progress or (lambda _m: None)
    engine = session.engine_for(config)
    # The budget is the measurement's: the engine start is paid by the campaign anyway.
    t0 = time.monotonic()
    toggles = clean_set(session.device) if engine.kind != "url" else []
    sends = calibration_sends(config, plan)
    refs: dict[str, RequestRecord] = {}
    for s in sends:
        refs[s.request_id] = session.references.get(engine, s, Binding.initial(config, s.adapter))
    say(f"calibrating: {len(sends)} requests alone ({time.monotonic() - t0:.0f} s)")

    def scored(runs: dict[str, RequestRecord]) -> dict[str, Scoring]:
        out = {}
        for s in sends:
            if s.request_id not in runs:  # a context that leaves it out
                continue
            toks = runs[s.request_id].token_ids[: s.max_tokens]
            if toks:
                out[s.request_id] = Scoring(request_id=s.request_id, arm="calibration", token_ids=list(toks),
                                            logprobs=session.scores.get(engine, s, list(toks), Binding.initial(config, s.adapter)))
        return out

    alone = measure_context("alone (teacher forcing vs decode)", refs, refs, scored(refs))
    contexts: list[ContextNoise] = []
    skipped = []
    for name, events in _contexts(sends, engine.kv_capacity_tokens(), config).items():
        if contexts and time.monotonic() - t0 > plan.budget_s:
            skipped.append(name)
            continue
        h = engine.replay(Trace(engine=config, events=events), arm="calibration", toggles=toggles)
        runs = {s.request_id: h.requests[s.request_id] for s in sends if s.request_id in h.requests}
        contexts.append(measure_context(name, refs, runs, scored(runs), **_observed(h, {s.request_id for s in sends})))
        say(f"calibrating: {name} ({time.monotonic() - t0:.0f} s)")
    profile = CalibrationProfile(
        key=engine.noise_key(), created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        seconds=round(time.monotonic() - t0, 1), requests=len(sends), max_tokens=plan.max_tokens,
        contexts=contexts, prefill_vs_decode=alone.max_teacher, headroom=HEADROOM, skipped=skipped)
    b = bounds_from(profile)
    profile.bounds = {"near_tie": b.near_tie, "drift": b.drift, "teacher": b.teacher}
    return profile


def _observed(h: History, measured: set[str]) -> dict[str, int]:
    """What a context did to the measured requests (so a profile shows what it exercised)."""
    preempted = {r for st in h.steps for r in st.preempted} & measured
    chunked = {r for st in h.steps for r in st.partial_prefills} & measured
    hits = {r for r, rec in h.requests.items() if rec.num_cached_tokens} & measured
    return {"prefix_hit_requests": len(hits), "chunked_requests": len(chunked), "preempted_requests": len(preempted)}


# Bounds no batch-order noise reaches (nats): a float32 logit moves by ~1e-5 with batch order,
# a 16-bit one by a few steps of 0.125. A profile beyond them measured something else — a fault
# patched into the engine (KVFUZZ_PLUGIN_MODULES). Kept in the shared cache, such a profile (8.4
# nats in float32, say) would have every later campaign call corruption a near tie.
PLAUSIBLE = {"float32": 0.1, "float16": 1.0, "bfloat16": 2.0}


def implausible(profile: CalibrationProfile) -> str | None:
    """Why ``profile`` cannot be batch-order noise, or None."""
    ceiling = PLAUSIBLE.get(profile.key.dtype, max(PLAUSIBLE.values()))
    over = {k: v for k, v in profile.bounds.items() if v > ceiling}
    if not over:
        return None
    what = ", ".join(f"{k} {v:.3g}" for k, v in sorted(over.items()))
    return (f"the measured {profile.key.dtype} noise ({what} nats) is beyond what batch order can do "
            f"(<= {ceiling:g}): the engine is not clean (a patch or fault in it?)")


def unclean_engine() -> str | None:
    """Why this process's engines cannot be calibrated: patches of the user's own
    (KVFUZZ_PLUGIN_MODULES) are always on, so their effect would be measured as noise."""
    from kvfuzz.harness.toggles.plugin import PLUGIN_MODULES_VAR, plugin_modules

    mods = plugin_modules()
    if not mods:
        return None
    return (f"{PLUGIN_MODULES_VAR} patches this engine ({', '.join(m for m, _ in mods)}), so its noise would "
            f"include them; measure a profile without them (`kvfuzz calibrate`)")


def describe_key(key: NoiseKey) -> str:
    flags = f"block {key.block_size}, chunked prefill {'on' if key.chunked_prefill else 'off'}"
    return (f"{key.device} ({key.device_name}), {key.dtype}, {key.model}"
            + (f" [{key.model_hash}]" if key.model_hash else "") + f", {key.vllm or 'vLLM ?'}, "
            f"attention {key.attention_backend}, {flags}" + (", LoRA" if key.lora else ""))


# A drawn engine configuration's calibration (``calibrate_drawn``): shorter than a campaign's own,
# since it happens mid-campaign, once per configuration whose noise key has no profile yet.
DRAWN_BUDGET_S = 20.0


def calibrate_drawn(session: Session, progress: Callable[[str], None] | None,
                    warned: list[str]) -> Callable[[EngineConfig], NoiseBounds | None]:
    """What a calibrating campaign measures for an engine configuration a trace drew whose noise
    has no profile yet (``Session.calibrate_missing``): a short calibration, kept in the cache;
    a reason it did not is warned once."""

    def measure(config: EngineConfig) -> NoiseBounds | None:
        said: list[str] = []
        bounds = prepare_bounds(session, config, calibrate_if_missing=True, plan=Plan(budget_s=DRAWN_BUDGET_S),
                                progress=progress, warn=said.append)
        warned.extend(w for w in said if w not in warned)
        return bounds

    return measure


def prepare_bounds(session: Session, config: EngineConfig, *, profile_file: Path | None = None,
                   calibrate_if_missing: bool = False, plan: Plan = Plan(),
                   progress: Callable[[str], None] | None = None,
                   warn: Callable[[str], None] | None = None) -> NoiseBounds:
    """The noise bounds ``session`` judges runs of ``config`` by: the profile file named,
    else the cache's profile for this engine, else (when allowed) one measured now and kept in
    the cache, else the dtype's defaults — said in one line through ``warn``."""
    engine = session.engine_for(config)
    key = engine.noise_key()
    if profile_file is not None:
        named = load_profile(profile_file)
        if named.key != key:
            diff = sorted(k for k, v in named.key.model_dump().items() if key.model_dump()[k] != v)
            raise BadInput(f"the profile was measured for another engine ({', '.join(diff)} differ: "
                           f"{describe_key(named.key)})", source=str(profile_file), field="--calibration")
        return session.use_profile(config, named)
    profile = find_profile(key, session.profiles_dir)
    if profile is None and calibrate_if_missing:
        if (why := unclean_engine()) is not None:
            if warn is not None:
                warn(f"not calibrating: {why}")
        else:
            profile = calibrate(session, config, plan, progress)
            if (why := implausible(profile)) is not None:
                if warn is not None:
                    warn(f"calibration refused, not saved: {why}")
                profile = None
            else:
                save_profile(profile, profile_path(key, session.profiles_dir))
    if profile is not None:
        return session.use_profile(config, profile)
    bounds = session.bounds_for(config)
    if warn is not None:
        warn(f"no calibration profile for {describe_key(key)}: judging with the {bounds.dtype} defaults "
             f"(`kvfuzz calibrate` measures one)")
    return bounds
