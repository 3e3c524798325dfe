"""Corpus, scheduler and campaign loop logic, driven by a fake checker (pure logic: the real
engine's coverage is tested in test_feedback_engine.py)."""

import json
import random
from io import StringIO

import pytest
from rich.console import Console

from kvfuzz.fuzzer import CampaignOptions, Corpus, CorpusEntry, default_engine, generate, run_campaign
from kvfuzz.fuzzer.generate import GENERATOR
from kvfuzz.fuzzer.corpus import Item, Scheduler
from kvfuzz.fuzzer.feedback import Coverage
from kvfuzz.traces import (
    GraftInto,
    LineageLink,
    Divergence,
    Environment,
    Finding,
    History,
    RequestRecord,
    StepRecord,
    Trace,
    load_finding,
    save,
)
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.result import Checked, Recording

ENG = default_engine(lora=True)


def fake_history(t: Trace) -> History:
    """A deterministic stand-in for a replay: one step per distinct send step, everything sent
    at that step scheduled together."""
    steps: dict[int, dict[str, int]] = {}
    for s in t.sends:
        steps.setdefault(s.at.step, {})[s.request_id] = s.prompt.length
    recs = {s.request_id: RequestRecord(request_id=s.request_id, adapter=s.adapter, sent_step=s.at.step,
                                        token_ids=[1] * s.max_tokens, finish_reason="length") for s in t.sends}
    for c in t.cancels:
        r = recs[c.request_id]
        r.cancelled, r.cancel_step = True, (c.at.step or 0) + 1
        r.token_ids = r.token_ids[: c.at.after_tokens or 0]
    return History(trace_id=t.trace_id(), engine="inprocess", requests=recs,
                   steps=[StepRecord(step=k, running=len(v), scheduled=v, kv_usage=min(1.0, sum(v.values()) / 20000))
                          for k, v in sorted(steps.items())])


class FakeChecker:
    def __init__(self, crash_at=None, finding_if=None):
        self.seen: list[str] = []
        self.crash_at = crash_at
        self.finding_if = finding_if

    def __call__(self, t: Trace):
        if self.crash_at is not None and len(self.seen) == self.crash_at:
            raise KeyboardInterrupt
        self.seen.append(t.trace_id())
        finding = None
        if self.finding_if and self.finding_if(t):
            finding = Finding(trace=t, environment=Environment(kvfuzz_version="test"),
                              divergences=[Divergence(request_id=t.sends[0].request_id, **{"class": "corruption"})])
            finding.id = finding.compute_id()
        env = Environment(kvfuzz_version="test")
        return Checked(Recording(trace=t, histories=[fake_history(t)], references={}, environment=env), [], finding)


def opts(tmp_path, n, **kw):
    return CampaignOptions(seed=3, budget_s=None, max_traces=n, runs=1, out=tmp_path / "out", engine=ENG, **kw)


def test_feedback_campaign_grows_an_on_disk_corpus_of_novel_traces(tmp_path):
    st = run_campaign(opts(tmp_path, 25), FakeChecker())
    files = sorted((tmp_path / "out" / "corpus").glob("*.json"))
    assert len(files) == len(st.corpus) >= 3
    entries = [CorpusEntry.model_validate_json(p.read_text()) for p in files]
    assert all(e.novel and e.id == e.trace.trace_id() and set(e.novel) <= set(e.buckets) for e in entries)
    assert st.sources.get("mutant", 0) >= 5 and st.sources.get("fresh", 0) >= 1
    assert st.buckets == len(st.coverage) >= 10
    # Coverage log is monotone and ends at the final figure.
    assert [r[2] for r in st.coverage_log] == sorted(r[2] for r in st.coverage_log)
    assert st.coverage_log[-1][2] == st.buckets
    # Mutants descend from corpus entries, with the operators named.
    mutants = [e for e in entries if e.trace.lineage.parent]
    assert mutants and all(m.trace.lineage.parent in st.corpus and m.trace.lineage.operators for m in mutants)


def test_random_mode_generates_only_and_writes_no_corpus(tmp_path):
    st = run_campaign(opts(tmp_path, 8, mode="random"), FakeChecker())
    assert st.sources == {"fresh": 8} and st.corpus == []
    assert not list((tmp_path / "out" / "corpus").glob("*.json"))
    assert st.buckets > 0  # coverage is still measured (the baseline of the benchmark)
    # Plain random mode is the old generator sequence.
    seen = FakeChecker()
    run_campaign(opts(tmp_path / "again", 3, mode="random"), seen)
    from kvfuzz.fuzzer import trace_seed
    assert seen.seen == [generate(trace_seed(3, i), ENG).trace_id() for i in range(3)]


@pytest.mark.parametrize("crash_at", [0, 7])
def test_resume_after_an_interruption_continues_the_exact_sequence(tmp_path, crash_at):
    # Both campaigns start from the same corpus (a copy each: campaigns write into it).
    import shutil

    run_campaign(opts(tmp_path / "pre", 6), FakeChecker())
    for name in ("a", "b"):
        shutil.copytree(tmp_path / "pre" / "out" / "corpus", tmp_path / name / "corpus")
    straight = FakeChecker()
    a = run_campaign(opts(tmp_path / "a", 20, corpus=tmp_path / "a" / "corpus"), straight)
    first = FakeChecker(crash_at=crash_at)
    with pytest.raises(KeyboardInterrupt):
        run_campaign(opts(tmp_path / "b", 20, corpus=tmp_path / "b" / "corpus"), first)
    state = json.loads((tmp_path / "b" / "out" / "campaign.json").read_text())
    assert state["next_index"] == crash_at and state["complete"] is False
    second = FakeChecker()
    b = run_campaign(opts(tmp_path / "b", 20, resume=True, corpus=tmp_path / "b" / "corpus"), second)
    assert first.seen + second.seen == straight.seen
    assert (b.corpus, b.chosen, b.coverage, b.next_index) == (a.corpus, a.chosen, a.coverage, 20)


def test_resume_sweeps_what_a_killed_atomic_write_left(tmp_path):
    """SIGKILL between an atomic write's temporary file and its rename leaves the temporary file
    (the target is intact). The resumed campaign removes such leftovers, and nothing else."""
    run_campaign(opts(tmp_path, 2), FakeChecker())
    out = tmp_path / "out"
    left = [out / ".campaign.json.k3j_x.tmp", out / "corpus" / ".abc.json.q1w2.tmp"]
    for p in left:
        p.write_text('{"half": ')
    keep = [out / ".notes", out / "corpus" / "notes.tmp"]  # not the atomic writer's pattern
    for p in keep:
        p.write_text("mine")
    run_campaign(opts(tmp_path, 3, resume=True), FakeChecker())
    assert not any(p.exists() for p in left) and all(p.read_text() == "mine" for p in keep)
    assert json.loads((out / "campaign.json").read_text())["next_index"] == 3


def test_resume_refuses_another_seed(tmp_path):
    run_campaign(opts(tmp_path, 2), FakeChecker())
    o = opts(tmp_path, 4, resume=True)
    o.seed = 4
    with pytest.raises(BadInput, match="seed"):
        run_campaign(o, FakeChecker())


def test_corpus_directory_seeds_the_campaign(tmp_path):
    corpus = tmp_path / "corpus"
    t1, t2 = generate(101, ENG), generate(102, ENG)
    save(t1, corpus / "a-trace.json")
    f = Finding(trace=t2, environment=Environment(kvfuzz_version="x"))
    save(f, corpus / "b-finding.json")
    checker = FakeChecker()
    st = run_campaign(opts(tmp_path / "one", 6, corpus=corpus), checker)
    assert checker.seen[:2] == [t1.trace_id(), t2.trace_id()] and st.sources["seed"] == 2
    assert st.seeds == [t1.trace_id(), t2.trace_id()]
    assert {t1.trace_id(), t2.trace_id()} <= set(st.corpus)
    # A second campaign on the same engine trusts the measured entries: no replay needed.
    again = FakeChecker()
    st2 = run_campaign(opts(tmp_path / "two", 3, corpus=corpus), again)
    assert st2.seeds == [] and "seed" not in st2.sources and set(st.corpus) <= set(st2.corpus)
    assert not {t1.trace_id(), t2.trace_id()} & set(again.seen)
    assert set(st.coverage) <= set(st2.coverage)


def test_seeds_from_another_engine_are_rebased_or_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    other = default_engine(lora=True, kv_cache_bytes=16 * 2**20)
    save(generate(7, other), corpus / "other.json")
    c = Corpus(corpus)
    seeds, skipped = c.seeds(ENG)
    # The scheduling policy and prompt embeddings are drawn per trace: they stay the trace's own.
    drawn = generate(7, other).engine
    own = ENG.model_copy(update={"scheduling_policy": drawn.scheduling_policy,
                                 "enable_prompt_embeds": drawn.enable_prompt_embeds})
    assert len(seeds) == 1 and seeds[0].trace.engine == own and not skipped
    lora_trace = generate(8, ENG)
    assert any(s.adapter for s in lora_trace.sends)
    save(lora_trace, corpus / "lora.json")
    seeds, skipped = Corpus(corpus).seeds(default_engine())  # no LoRA on this engine
    assert "lora.json: does not fit the campaign engine" in skipped
    assert all(not x.adapter for sd in seeds for x in sd.trace.sends)


def test_a_bad_corpus_file_is_bad_input_naming_it(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "broken.json").write_text("{not json")
    with pytest.raises(BadInput, match="broken.json"):
        run_campaign(opts(tmp_path, 2, corpus=corpus), FakeChecker())


def test_findings_record_lineage(tmp_path):
    checker = FakeChecker(finding_if=lambda t: bool(t.lineage.operators) and len(t.sends) >= 4)
    st = run_campaign(opts(tmp_path, 25), checker)
    assert st.findings >= 1
    f = load_finding(tmp_path / "out" / st.finding_files[0])
    assert f.trace.lineage.parent and f.trace.lineage.operators
    chain = f.provenance.lineage
    # A feedback mutant is grafted into that iteration's fresh trace: the link names both.
    assert f.trace.lineage.operators[-1] == "graft"
    assert chain[0] == LineageLink(parent=f.trace.lineage.parent, operators=f.trace.lineage.operators,
                                   into=GraftInto(generator=GENERATOR, seed=f.trace.lineage.seed))
    assert chain[-1].root and chain[-1].generator == GENERATOR
    assert f.provenance.campaign.source == "mutant"


def test_scheduler_prefers_novel_rare_entries():
    cov = Coverage()
    for _ in range(50):
        cov.add({"common"})
    cov.add({"common", "rare1", "rare2"})
    s = Scheduler([Item("plain", generate(0), frozenset({"common"}), 0),
                   Item("novel", generate(1), frozenset({"common", "rare1", "rare2"}), 2)])
    rng = random.Random(0)
    picks = [s.choose(rng, cov).id for _ in range(100)]
    assert picks.count("novel") > 70
    # Picking decays the weight: a fresh entry with the same merit outweighs a worn one.
    worn, fresh = Item("w", generate(0), frozenset(), 1, chosen=50), Item("f", generate(0), frozenset(), 1)
    assert s.weight(fresh, cov) > 4 * s.weight(worn, cov)
    # Same merit, 20x the tokens to prefill: picked less often.
    from kvfuzz.fuzzer.mutate import apply
    heavy_trace = apply(generate(0, ENG), ["long_pressure"], random.Random(0))
    heavy, light = Item("h", heavy_trace, frozenset(), 1), Item("l", generate(0, ENG), frozenset(), 1)
    assert heavy.cost > 10 * light.cost and s.weight(light, cov) > 1.5 * s.weight(heavy, cov)


def test_live_panel_shows_rate_corpus_coverage_and_findings(tmp_path):
    from kvfuzz.cli.display import CampaignDisplay

    buf = StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    disp = CampaignDisplay(console, budget_s=60, max_traces=None)
    outcomes = []
    st = run_campaign(opts(tmp_path, 6), FakeChecker(finding_if=lambda t: len(t.sends) >= 3),
                      lambda o, s: outcomes.append((o, s)))
    disp.update(*outcomes[-1])
    console.print(disp._render())
    text = buf.getvalue()
    assert f"{st.traces}  (" in text and "/s)" in text
    assert f"{len(st.corpus)} entries" in text and f"{st.buckets} buckets" in text
    assert st.by_class and f"corruption: {st.by_class['corruption']}" in text


def test_early_exploration_share_while_the_corpus_is_small(tmp_path):
    eager = run_campaign(opts(tmp_path / "e", 10, sources="fixed", explore_until=1000, p_fresh_early=1.0),
                         FakeChecker())
    assert eager.sources == {"fresh": 10}
    fixed = run_campaign(opts(tmp_path / "d", 10, sources="fixed"), FakeChecker())
    assert fixed.sources.get("mutant", 0) >= 5


def test_graft_mutants_carry_the_fresh_trace_of_their_iteration(tmp_path):
    """A feedback mutant is a corpus entry's mutant grafted into the fresh trace random mode
    would run at the same index: every event of that fresh trace is kept and the graft's
    events are added under ``x.`` ids; ``mutants="plain"`` is the mutant alone."""
    from kvfuzz.fuzzer import trace_seed

    seen: dict[str, Trace] = {}

    class Keep(FakeChecker):
        def __call__(self, t):
            seen[t.trace_id()] = t
            return super().__call__(t)

    checker = Keep()
    st = run_campaign(opts(tmp_path, 20), checker)
    traces = [seen[tid] for tid in checker.seen]
    grafts = [(i, t) for i, t in enumerate(traces) if t.lineage.operators and t.lineage.operators[-1] == "graft"]
    assert len(grafts) == st.sources["mutant"] >= 5
    for i, t in grafts:
        base = generate(trace_seed(3, i), ENG)
        assert t.lineage.seed == trace_seed(3, i) and t.lineage.parent in st.corpus
        kept = [e for e in t.events if not getattr(e, "request_id", "").startswith("x.")]
        # Every event of the fresh trace, in order; besides them only the donor's prefix-cache
        # resets (which have no request id) that lay within the grafted window.
        rest = list(kept)
        for e in base.events:
            k = rest.index(e)
            assert all(x.kind == "reset-prefix-cache" for x in rest[:k]), (i, rest[:k])
            rest = rest[k + 1:]
        assert all(x.kind == "reset-prefix-cache" for x in rest)
        assert any(getattr(e, "request_id", "").startswith("x.") for e in t.events)

    plain = Keep()
    run_campaign(opts(tmp_path / "plain", 20, mutants="plain"), plain)
    mutants = [seen[tid] for tid in plain.seen if seen[tid].lineage.parent]
    assert mutants and not any("graft" in m.lineage.operators for m in mutants)


def test_resume_refuses_other_mutants(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_campaign(opts(tmp_path, 10), FakeChecker(crash_at=4))
    with pytest.raises(BadInput, match="mutants"):
        run_campaign(opts(tmp_path, 10, resume=True, mutants="plain"), FakeChecker())
