"""Engine configurations per trace (fuzzer/configs.py): drawn one knob at a time on their own
random stream, named by region for coverage and the campaign's counts, mutated one knob at a
time, passed to vLLM, and skipped with a counted reason when the engine refuses one."""

import random

import pytest

from kvfuzz.fuzzer import configs
from kvfuzz.fuzzer.campaign import CampaignOptions, run_campaign
from kvfuzz.fuzzer.generate import GenOptions, default_engine, generate
from kvfuzz.harness.vllm_args import engine_args, server_command
from kvfuzz.traces import EngineConfig
from kvfuzz.traces.errors import ConfigRefused


def test_a_draw_moves_one_knob_at_the_share_asked_and_leaves_the_other_traces_as_they_were():
    base = default_engine()
    moved = [configs.moved(configs.draw(s, base, 0.4), base) for s in range(400)]
    share = sum(bool(m) for m in moved) / len(moved)
    assert 0.3 < share < 0.5
    # One knob, besides the token budget chunked prefill off raises with it.
    assert all(len({k for k in m if not (k == "max_num_batched_tokens" and "enable_chunked_prefill" in m)}) <= 1
               for m in moved)
    assert {k for m in moved for k in m} == set(configs.VARIANTS)
    for seed in range(200):
        t = generate(seed, opts=GenOptions(p_config=0.4, p_spec=0.5, p_embeds=0.5, p_priority=0.5))
        if configs.region(t.engine) != "default":  # one engine dimension a trace
            assert t.engine.speculative is None and not t.engine.enable_prompt_embeds
            assert t.engine.scheduling_policy is None
    moved_any = False
    for seed in range(60):
        with_ = generate(seed, opts=GenOptions(p_config=0.4))
        without = generate(seed, opts=GenOptions())
        if with_.engine == without.engine:
            assert with_.events == without.events  # its own random stream
        else:
            moved_any = True
            assert configs.region(with_.engine) != "default" and configs.region(without.engine) == "default"
    assert moved_any


def test_speculative_decoding_is_drawn_first_at_its_share_from_few_settings_and_moves_nothing_else():
    from kvfuzz.fuzzer.requests import SPECULATIVE
    traces = [generate(s, opts=GenOptions(p_config=0.4, p_spec=0.3)) for s in range(300)]
    drafting = [t for t in traces if t.engine.speculative is not None]
    assert 0.22 < len(drafting) / len(traces) < 0.38
    settings = {(t.engine.speculative.num_speculative_tokens, t.engine.speculative.prompt_lookup_min,
                 t.engine.speculative.prompt_lookup_max) for t in drafting}
    assert settings == set(SPECULATIVE)
    for t in drafting:  # one engine dimension a trace
        assert configs.region(t.engine) == "default" and not t.engine.enable_prompt_embeds
        assert t.engine.scheduling_policy is None
    # The knobs keep their share among the others.
    others = [t for t in traces if t.engine.speculative is None]
    assert 0.28 < sum(configs.region(t.engine) != "default" for t in others) / len(others) < 0.52


def test_chunked_prefill_off_holds_a_whole_prompt_and_a_region_reads_as_its_knob():
    base = default_engine()
    off = configs.with_knob(base, "enable_chunked_prefill", False)
    assert off.max_num_batched_tokens >= off.max_model_len
    assert configs.region(off) == "enable_chunked_prefill=False"
    assert configs.region(base) == "default"
    assert configs.region(configs.with_knob(base, "block_size", 64)) == "block_size=64"
    assert configs.counts_text({"default": 5, "block_size=64": 2}) == "default 5, block_size=64 2"


def test_the_mutation_moves_one_knob_or_moves_it_back():
    rng = random.Random(0)
    base = default_engine()
    seen = set()
    for _ in range(200):
        e = configs.mutate_knob(base, rng)
        assert e is not None and configs.region(e) != "default"
        seen.add(configs.region(e))
        back = configs.mutate_knob(e, random.Random(1))
        assert back is None or back != e
    assert len(seen) >= 8
    # Chunked prefill back on returns to the campaign's token budget.
    off = configs.with_knob(base, "enable_chunked_prefill", False)
    for seed in range(50):
        e = configs.mutate_knob(off, random.Random(seed))
        if e is not None and e.enable_chunked_prefill:
            assert e.max_num_batched_tokens == base.max_num_batched_tokens


def test_every_knob_reaches_vllm_and_the_server_alike():
    e = EngineConfig(block_size=64, enable_prefix_caching=False, max_num_seqs=2, long_prefill_token_threshold=64)
    args = engine_args(e, "/m")
    assert (args["block_size"], args["enable_prefix_caching"], args["max_num_seqs"],
            args["long_prefill_token_threshold"]) == (64, False, 2, 64)
    cmd = server_command(e, model_path="/m", adapter_paths={}, port=1)
    assert cmd[cmd.index("--long-prefill-token-threshold") + 1] == "64" and "--no-enable-prefix-caching" in cmd
    assert "long_prefill_token_threshold" not in EngineConfig().model_dump(mode="json")  # not written unset


def test_a_refused_configuration_is_skipped_and_counted(tmp_path):
    seen = []

    def check(trace):
        seen.append(trace)
        if len(seen) % 2 == 0:
            raise ConfigRefused("block_size 64 is not supported")
        from kvfuzz.traces import Environment
        from kvfuzz.traces.result import Checked, Recording

        return Checked(Recording(trace=trace, histories=[], references={},
                                 environment=Environment(kvfuzz_version="t")), [], None)

    st = run_campaign(CampaignOptions(out=tmp_path, max_traces=3, budget_s=None, mode="random"), check)
    assert st.traces == 3 and st.refused == {"block_size 64 is not supported": 2} and len(seen) == 5


def test_a_configuration_that_fails_to_start_after_another_one_started_is_refused():
    from kvfuzz.driver.recovery import Recovering
    from kvfuzz.traces.errors import InfraError

    class Session:
        def __init__(self):
            self.fail = [True, False, True]

        def engine_for(self, config):
            if self.fail.pop(0):
                raise InfraError("engine did not start\nValueError: block_size must be a multiple of 32")

        def check(self, trace, **kw):
            from kvfuzz.traces import Environment
            from kvfuzz.traces.result import Checked, Recording

            return Checked(Recording(trace=trace, histories=[], references={},
                                     environment=Environment(kvfuzz_version="t")), [], None)

    guard = Recovering(Session())  # type: ignore[arg-type]
    t = generate(0)
    with pytest.raises(InfraError):
        guard.check(t)  # the first configuration: the machine's failure, exit 3
    guard.check(t)
    with pytest.raises(ConfigRefused, match="block_size must be a multiple of 32"):
        guard.check(t)



def test_a_speculative_engine_takes_its_references_twin_from_the_pool_and_is_never_evicted_by_it(monkeypatch):
    from kvfuzz.harness import inprocess
    from kvfuzz.harness.base import reference_config
    from kvfuzz.traces import Speculative

    def start(self):
        self._llm = object()
        return self

    monkeypatch.setattr(inprocess.InProcessEngine, "start", start)
    monkeypatch.setattr(inprocess.InProcessEngine, "close", lambda self: setattr(self, "_llm", None))
    pool = inprocess.EnginePool(2)
    monkeypatch.setattr(inprocess, "_POOL", pool)
    plain = default_engine()
    drafting = plain.model_copy(update={"speculative": Speculative()})
    campaigns_own = pool.acquire(plain, device="cpu", log_file=None, trace_deadline_s=None)
    spec = pool.acquire(drafting, device="cpu", log_file=None, trace_deadline_s=None)
    assert reference_config(drafting) == plain
    assert spec.reference_engine() is campaigns_own and pool.starts == 2  # no twin of its own
    # A full pool evicts another engine for the twin, never the engine asking.
    pool.size = 1
    asking = pool.acquire(drafting.model_copy(update={"block_size": 64}), device="cpu", log_file=None,
                          trace_deadline_s=None)
    twin = asking.reference_engine()
    assert twin is not asking and twin._llm is not None and asking._llm is not None


def test_the_engine_pool_keeps_engines_while_memory_allows(monkeypatch):
    from kvfuzz.harness import inprocess

    monkeypatch.setattr(inprocess.InProcessEngine, "start", lambda self: setattr(self, "_llm", object()) or self)
    monkeypatch.setattr(inprocess.InProcessEngine, "close", lambda self: setattr(self, "_llm", None))
    free = {"bytes": 64 << 30}
    monkeypatch.setattr(inprocess, "available_memory", lambda: free["bytes"])
    pool = inprocess.EnginePool(48)
    configs = [default_engine().model_copy(update={"block_size": b}) for b in (16, 32, 64, 128)]
    first = [pool.acquire(c, device="cpu", log_file=None, trace_deadline_s=None) for c in configs[:3]]
    assert pool.starts == 3 and all(e._llm is not None for e in first)  # plenty of memory: all kept
    # Short of memory for one more engine's KV cache and the headroom: the least recently used
    # engine is closed before the new one starts, and only as many as needed.
    free["bytes"] = inprocess.MEMORY_HEADROOM
    pool.acquire(configs[1], device="cpu", log_file=None, trace_deadline_s=None)  # used again: newest
    calls = iter([inprocess.MEMORY_HEADROOM, 64 << 30])
    monkeypatch.setattr(inprocess, "available_memory", lambda: next(calls))
    pool.acquire(configs[3], device="cpu", log_file=None, trace_deadline_s=None)
    assert first[0]._llm is None and first[1]._llm is not None and first[2]._llm is not None
    assert pool.starts == 4


def test_discarding_an_engine_the_pool_does_not_hold_leaves_the_pooled_one(monkeypatch):
    from kvfuzz.harness import inprocess

    monkeypatch.setattr(inprocess.InProcessEngine, "start", lambda self: setattr(self, "_llm", object()) or self)
    monkeypatch.setattr(inprocess.InProcessEngine, "close", lambda self: setattr(self, "_llm", None))
    pool = inprocess.EnginePool(4)
    pooled = pool.acquire(default_engine(), device="cpu", log_file=None, trace_deadline_s=None)
    own = inprocess.InProcessEngine(default_engine(), device="cpu", log_file=None, trace_deadline_s=None).start()
    pool.discard(own)
    pool.release(own)
    assert own._llm is None and pooled._llm is not None
    assert pool.acquire(default_engine(), device="cpu", log_file=None, trace_deadline_s=None) is pooled
