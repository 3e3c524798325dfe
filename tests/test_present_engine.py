"""The schedule picture's data from a history recorded live on the real vLLM CPU engine, with
an adapter lifecycle event in it (tests/test_present.py checks the recorded files). One short
check on the shared LoRA engine (a few seconds)."""

import pytest

from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK
from kvfuzz.present.data import divergence_data, schedule_data, token_steps
from kvfuzz.traces import parse_trace

pytestmark = pytest.mark.engine


def test_a_live_reload_is_drawn_where_the_engine_applied_it(session, lora_engine_config):
    """vLLM #42125 live: lora_a reloaded from the same path; the next request on it reads the old
    weights' cached blocks. The picture's line sits at the step the engine applied the reload,
    the stale prefix hit on the victim's bar, and its first differing token where it came out."""
    prompt = {"length": 200, "prefix_group": "g", "prefix_len": 160}
    trace = parse_trace({"schema_version": 2, "engine": lora_engine_config.model_dump(mode="json"), "events": [
        {"kind": "send", "request_id": "old", "at": {"step": 0}, "adapter": "a", "max_tokens": 4,
         "prompt": {**prompt, "seed": 1}},
        {"kind": "reload-adapter", "name": "a", "source": "embedded:a@v2", "same_path": True, "at": {"step": 30}},
        {"kind": "send", "request_id": "new", "at": {"step": 31}, "adapter": "a", "max_tokens": 6,
         "prompt": {**prompt, "seed": 2}},
    ]})
    c = session.check(trace, runs=1, arms={"vanilla": [LORA_CPU_MASK]})
    f = c.finding
    assert f is not None and f.worst_class() == "corruption"
    h = next(h for h in f.runs if h.arm == "vanilla")
    s = schedule_data(f)
    (ev,) = [e for e in h.events if e.kind == "reload-adapter"]
    (line,) = s.lines
    assert line.at == ev.actual_step == 30 and line.adapter == "a" and "same path" in line.label
    new = s.bar("new")
    rec = h.requests["new"]
    assert new.victim and (new.start, new.end) == (rec.sent_step, rec.finished_step + 1)
    (hit,) = new.marker("prefix-hit")
    assert hit.note == "160 cached" and hit.at == min(st.step for st in h.steps if st.scheduled.get("new"))
    d = divergence_data(f)
    (first,) = new.marker("first-divergence")
    assert first.at == token_steps("new", h)[d.first]
    assert s.bar("old").end <= line.at + 1 and not s.bar("old").victim
