"""The many-worker campaign driver (fuzzer/distributed.py) without Ray or vLLM: an in-process
executor that finishes tasks in a seeded random order, kills workers, and a fake oracle whose
coverage buckets depend on the trace (so feedback, mutation and the corpus are exercised).
The real cluster runs in tests/test_ray_engine.py."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest

from kvfuzz.fuzzer import CampaignOptions, GenOptions, default_engine
from kvfuzz.fuzzer.distributed import Driver, Lost, Result


class FakeCluster:
    """``workers`` workers; each wait() finishes one random running task. ``kill`` lists the
    (nth finished task) at which that task's worker dies instead of answering."""

    def __init__(self, workers: int, order_seed: int, kill: tuple[int, ...] = (), stop_after: int | None = None):
        self.workers = [f"w{k}" for k in range(workers)]
        self.running: dict[str, object] = {}
        self.rng = random.Random(order_seed)
        self.kill = set(kill)
        self.finished = 0
        self.stop_after = stop_after
        self.spawned = workers

    def idle(self):
        return [w for w in self.workers if w not in self.running]

    def busy(self):
        return len(self.running)

    def alive(self):
        return bool(self.workers)

    def submit(self, worker, task):
        self.running[worker] = task

    def crash_finding(self, trace, arms, deaths):
        from kvfuzz.scale.cluster import worker_died_finding

        return worker_died_finding(trace, arms, deaths)

    def wait(self, timeout_s):
        if self.stop_after is not None and self.finished >= self.stop_after:
            raise KeyboardInterrupt  # the driver is stopped mid-campaign
        w = self.rng.choice(sorted(self.running))
        task = self.running.pop(w)
        self.finished += 1
        if self.finished in self.kill:
            self.workers.remove(w)  # dead, replaced by a fresh worker
            self.workers.append(f"w{self.spawned}")
            self.spawned += 1
            return [Lost(task.index, w, "ActorDiedError: killed")]
        return [Result(task.index, w, buckets=fake_buckets(task.trace))]


def fake_buckets(trace) -> list[str]:
    """Coverage that depends on the trace's shape: new shapes are novel, so the corpus grows."""
    sends = len(trace.sends)
    longest = max((s.max_tokens for s in trace.sends), default=0)
    return [f"sends:{sends}", f"cancels:{len(trace.cancels)}", f"tokens:{longest.bit_length()}", f"adapters:{len({s.adapter for s in trace.sends})}"]


def opts(out, n, *, resume=False):
    return CampaignOptions(seed=7, budget_s=None, max_traces=n, runs=1, out=out, engine=default_engine(),
                           gen=GenOptions(min_requests=2, max_requests=4), resume=resume)


def campaign(out, n, workers, order_seed, *, window=3, kill=(), resume=False, stop_after=None):
    seen = {}

    def outcome(o, _state):
        seen[o.index] = (o.trace.trace_id(), o.source)

    drv = Driver(opts(out, n, resume=resume), FakeCluster(workers, order_seed, kill, stop_after), window=window,
                 on_outcome=outcome)
    try:
        state = drv.run()
    except KeyboardInterrupt:
        state = None
    return seen, state


def test_the_trace_sequence_does_not_depend_on_worker_count_completion_order_or_deaths(tmp_path):
    one, s1 = campaign(tmp_path / "a", 24, 1, 0)
    many, s2 = campaign(tmp_path / "b", 24, 4, 1)
    dying, s3 = campaign(tmp_path / "c", 24, 3, 2, kill=(3, 9, 10))
    assert one == many == dying
    assert sorted(one) == list(range(24))
    assert "mutant" in {src for _t, src in one.values()}, "feedback never produced a mutant: the test is blind"
    for s in (s1, s2, s3):
        assert s.traces == s.next_index == 24 and sum(s.by_worker.values()) == 24 and s.complete
    assert s3.requeued == 3 and len(s3.worker_deaths) == 3 and s3.findings == 0
    # At most `window` traces are in flight: with 4 workers and a window of 3, one stays idle.
    assert len(s2.by_worker) == 3
    # The next window is drawn, logged and not run: a later --resume with more traces needs it.
    from kvfuzz.fuzzer.distributed import read_pending

    assert sorted(read_pending(tmp_path / "c")) == [24, 25, 26]


def test_a_campaign_stopped_by_its_trace_count_resumes_the_same_sequence(tmp_path):
    """--traces 10, then --resume --traces 20, draws what one --traces 20 campaign draws: the
    traces past the first budget come from the pending log, not from the state at its end."""
    whole, _ = campaign(tmp_path / "whole", 20, 3, 5)
    first, s1 = campaign(tmp_path / "cut", 10, 2, 6)
    assert s1.complete and s1.traces == 10
    rest, s2 = campaign(tmp_path / "cut", 20, 3, 7, resume=True)
    assert {**first, **rest} == whole and set(first) & set(rest) == set()
    assert s2.traces == 20


def test_window_one_is_the_serial_campaign(tmp_path, monkeypatch):
    import kvfuzz.fuzzer.campaign as cmod
    from kvfuzz.fuzzer import run_campaign

    serial = {}
    monkeypatch.setattr(cmod, "trace_signature", lambda _h, trace: frozenset(fake_buckets(trace)))
    checked = type("Checked", (), {"finding": None, "histories": []})()
    run_campaign(opts(tmp_path / "s", 12), lambda _t: checked,
                 on_outcome=lambda o, _s: serial.__setitem__(o.index, (o.trace.trace_id(), o.source)))
    dist, _ = campaign(tmp_path / "d", 12, 1, 0, window=1)
    assert dist == serial
    assert "mutant" in {src for _t, src in dist.values()}


def test_a_killed_driver_resumes_the_same_sequence(tmp_path):
    whole, _ = campaign(tmp_path / "whole", 20, 3, 5)
    out = tmp_path / "cut"
    first, none = campaign(out, 20, 3, 6, stop_after=11)
    assert none is None
    state = json.loads((out / "campaign.json").read_text())
    assert 0 < state["traces"] < 20 and not state["complete"]
    from kvfuzz.fuzzer.distributed import read_pending

    # The window in flight is in the pending log (with committed ones until it is compacted).
    assert set(range(state["next_index"], state["next_index"] + 3)) <= set(read_pending(out))
    rest, final = campaign(out, 20, 2, 7, resume=True)
    assert {**first, **rest} == whole
    assert set(first) & set(rest) == set()
    assert final.traces == 20 and sum(final.by_worker.values()) == 20


def test_resume_keeps_the_campaigns_window(tmp_path):
    campaign(tmp_path, 6, 2, 0, window=3)
    _, state = campaign(tmp_path, 9, 2, 0, window=5, resume=True)
    assert state.window == 3 and state.traces == 9


def test_a_trace_that_kills_its_worker_twice_is_an_engine_crash_finding(tmp_path):
    seen, state = campaign(tmp_path, 6, 2, 3, window=1, kill=(2, 3))
    assert state.traces == 6 and state.findings == 1 and state.by_class == {"engine-crash": 1}
    from kvfuzz.traces import load_finding

    f = load_finding(tmp_path / state.finding_files[0])
    assert f.crash.kind == "worker-died" and f.provenance.campaign.index == 1
    # The file on disk names the worker it came from (set before the file is written).
    assert f.provenance.worker in {d["worker"] for d in state.worker_deaths}


def test_bare_ray_means_a_local_instance():
    from kvfuzz.cli import bare_ray

    assert bare_ray(["run", "--ray"]) == ["run", "--ray", "local"]
    assert bare_ray(["run", "--ray", "--workers", "2"]) == ["run", "--ray", "local", "--workers", "2"]
    assert bare_ray(["gate", "--ray", "corpus/"]) == ["gate", "--ray", "local", "corpus/"]
    for addr in ("auto", "ray://head:10001", "10.0.0.5:6379", "[::1]:6379"):
        assert bare_ray(["run", "--ray", addr]) == ["run", "--ray", addr]


@pytest.mark.parametrize("args,field", [
    (["run", "--workers", "2"], "--workers"),
    (["run", "--window", "2"], "--window"),
    (["gate", "--workers", "2"], "--workers"),
    (["run", "--ray", "nohost:99999"], "--ray"),
    (["run", "--ray", "--reference-engines", "2"], "--reference-engines"),
    (["run", "--ray", "--engine", "server", "--reference-engines", "1"], "--reference-engines"),
])
def test_ray_options_bad_input(kvfuzz_cli, tmp_path, args, field):
    r = kvfuzz_cli(*args, "--out", tmp_path / "o")
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unreachable_cluster_is_exit_3_in_one_line_and_fast(tmp_path):
    # A closed port: the TCP pre-check answers before Ray is even imported.
    code = ("import sys\nfrom kvfuzz import cli\nsys.argv = ['kvfuzz', 'run', '--ray', '127.0.0.1:1', '--traces', '1',"
            f" '--out', {str(tmp_path / 'o')!r}]\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print('ray' in sys.modules, e.code)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "3"], r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvfuzz: error: ") and "127.0.0.1:1" in lines[0], r.stderr


def test_kvfuzz_run_without_ray_does_not_import_ray(tmp_path):
    # Every command module and the many-worker driver load, and `kvfuzz run` gets as far as its
    # input checks; Ray stays out (vLLM itself imports ray when it is installed: docs/scale.md).
    code = ("import sys\nfrom kvfuzz import cli\nimport kvfuzz.cli.commands, kvfuzz.fuzzer.distributed, kvfuzz.scale.cluster\n"
            f"sys.argv = ['kvfuzz', 'run', '--traces', '1', '--with', 'no-such-toggle', '--out', {str(tmp_path)!r}]\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    print(e.code, 'ray' in sys.modules, 'vllm' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr


def test_one_spec_builds_the_session_and_triage_of_run_and_of_each_ray_worker(tmp_path):
    """`kvfuzz run` without --ray and every Ray worker build their session and triage from a
    WorkerSpec (kvfuzz/scale/cluster.py): the spec's settings must all arrive (no engine starts)."""
    import pickle

    from kvfuzz.scale.cluster import WorkerSpec
    from kvfuzz.driver.settings import CampaignSettings, SessionSettings, TriageSettings

    settings = CampaignSettings(
        session=SessionSettings(kind="server", device="cpu", runs=2, bound_overrides={"near_tie": 0.5},
                                server_flags=["--max-num-seqs", "4"], trace_timeout=42.0, port=8123),
        arms={"vanilla": []},
        triage=TriageSettings(runs_fixed=True, minimize=False, controls=False, ablate=False, minimize_seconds=17.0,
                              budget_s=300.0))
    spec = pickle.loads(pickle.dumps(WorkerSpec(settings)))  # as Ray sends it
    s = spec.build_session(tmp_path)
    assert (s.engine_kind, s.device, s.runs, s.bound_overrides) == ("server", "cpu", 2, {"near_tie": 0.5})
    assert s.log_file == tmp_path / "engine.log" and s.trace_deadline_s == 42.0
    o = s.server_options
    assert (o.port, o.log_dir, o.extra_flags, o.request_timeout_s) == (8123, tmp_path, ["--max-num-seqs", "4"], 42.0)
    seen = []
    t = spec.build_triage(s, None, tmp_path, status=seen.append)
    assert (t.arms, t.settings) == ({"vanilla": []}, settings.triage)
    assert t.budget.end_after == 300.0  # nothing past the campaign's budget
    t.status("x")
    assert seen == ["x"]
    assert not spec.pooled and WorkerSpec().pooled
    assert WorkerSpec().build_session(tmp_path).server_options is None


class BuggyCluster(FakeCluster):
    """Every task finds the same unexplained bug and keys it equally; a worker that does not see
    its bucket committed below its task opens it, with its own witness (``Result.cases``)."""

    def wait(self, timeout_s):
        from test_report import finding

        from kvfuzz.traces.buckets import BucketKey, BucketMembership

        w = self.rng.choice(sorted(self.running))
        task = self.running.pop(w)
        f = finding()
        f.divergences[0].explained_by = None
        f.id = f"{task.index:012d}"  # one finding file each
        key = BucketKey(cls="corruption", verdicts={"prefix-caching": "disappears"})
        opened = key.digest() not in task.known
        m = BucketMembership(bucket=key.digest(), key=key, status="opened" if opened else "triaged")
        f.buckets = [m]
        witness = f.model_copy(update={"notes": {"witness of": str(task.index)}})
        return [Result(task.index, w, finding=f, buckets=fake_buckets(task.trace), memberships=[m],
                       cases={key.digest(): witness} if opened else {})]


def test_two_workers_that_open_one_key_at_once_open_one_bucket_and_every_finding_has_it(tmp_path):
    from kvfuzz.traces import load_finding

    out = tmp_path / "out"
    st = Driver(opts(out, 8), BuggyCluster(2, 5), window=4, arms={}).run()
    (b,) = st.live_buckets()
    assert b.count == st.findings == 8 and not st.untriaged and b.first_index == 0
    assert load_finding(out / b.case).notes["witness of"] == "0"  # the first committed opened it
    assert [load_finding(out / r).buckets[0].status for r in st.finding_files].count("opened") == 1
    from kvfuzz.fuzzer.campaign import CampaignState

    again = CampaignState(**json.loads((out / "campaign.json").read_text()))
    assert again.bug_buckets == st.bug_buckets


class TickingCluster(FakeCluster):
    """A FakeCluster whose every answer takes ``tick`` seconds of the fake ``clock``, answering
    the lowest running index first (the commit point never waits on a higher one)."""

    def __init__(self, *a, clock, tick=1.0, **kw):
        super().__init__(*a, **kw)
        self.clock, self.tick = clock, tick

    def wait(self, timeout_s):
        w = min(self.running, key=lambda k: self.running[k].index)
        task = self.running.pop(w)
        self.clock[0] += self.tick
        return [Result(task.index, w, buckets=fake_buckets(task.trace))]


@pytest.mark.parametrize("window, idle_s", [(3, 0.0), (1, 10.0)])
def test_workers_idle_on_a_full_window_are_counted(tmp_path, monkeypatch, window, idle_s):
    """The window rule's cost, in campaign.json: worker-seconds a worker had nothing to run only
    because the window was full. Three workers and a window of 3, answered in order: none. A
    window of 1: two workers idle through each of the 1 s answers, until the last index is
    drawn (five answers of six): 10 s. The drain at the campaign's end is not counted."""
    from kvfuzz.fuzzer import distributed

    clock = [0.0]
    monkeypatch.setattr(distributed, "time", type("T", (), {"monotonic": staticmethod(lambda: clock[0])}))
    st = Driver(opts(tmp_path / "out", 6), TickingCluster(3, 0, clock=clock), window=window).run()
    assert st.traces == 6 and st.window_wait_s == idle_s
    assert json.loads((tmp_path / "out" / "campaign.json").read_text())["window_wait_s"] == idle_s


def _spec(device="cpu", reference_engines=0):
    from kvfuzz.driver.settings import CampaignSettings, SessionSettings
    from kvfuzz.scale.cluster import WorkerSpec

    return WorkerSpec(CampaignSettings(session=SessionSettings(device=device, reference_engines=reference_engines)))


def test_a_worker_with_a_reference_engine_asks_ray_for_its_childs_cpu_or_gpu():
    """The child runs beside its worker on the worker's node, on resources Ray counts as the
    worker's: no other worker is placed on the core (or device) it uses."""
    from kvfuzz.scale.cluster import describe_resources, local_cpus, ray_worker_class, worker_resources

    class FakeRay:
        def remote(self, **kw):
            self.kw = kw
            return lambda cls: cls

    assert worker_resources(_spec()) == {"num_cpus": 1}
    assert worker_resources(_spec(reference_engines=1)) == {"num_cpus": 2}
    assert worker_resources(_spec("cuda")) == {"num_gpus": 1, "num_cpus": 1}
    assert worker_resources(_spec("cuda", 1)) == {"num_gpus": 2, "num_cpus": 2}
    ray = FakeRay()
    ray_worker_class(ray, _spec(reference_engines=1))
    assert ray.kw == {"num_cpus": 2, "max_restarts": 0}
    assert describe_resources(_spec("cuda", 1)) == "2 GPU(s) and 2 CPU(s)"
    # A local instance counts every worker's CPUs, its child's included.
    assert local_cpus(3, _spec(reference_engines=1).cpus) >= 6 and local_cpus(3, _spec().cpus) >= 3


def test_reference_engines_with_ray_reach_every_worker_on_a_local_instance_sized_for_them(kvfuzz_cli, tmp_path,
                                                                                          monkeypatch):
    """No longer bad input: the workers' spec carries the setting (each worker's session starts
    its child), and a local Ray instance counts two CPUs a worker. Ray itself is not started."""
    from kvfuzz.cli.commands import run as run_cmd
    from kvfuzz.scale import cluster
    from kvfuzz.traces.errors import InfraError

    seen = {}

    def ray_path(address, opts, spec, **kw):
        seen["spec"], seen["workers"] = spec, kw["workers"]

    monkeypatch.setattr(run_cmd, "_run_on_ray", ray_path)
    r = kvfuzz_cli("run", "--ray", "--workers", "3", "--reference-engines", "1", "--traces", "1", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert seen["spec"].settings.session.reference_engines == 1 and seen["spec"].cpus == 2 and seen["workers"] == 3
    monkeypatch.undo()

    def connect(address, *, num_cpus=None, env=None):
        seen["connect"] = (address, num_cpus)
        raise InfraError("stopped before Ray")

    monkeypatch.setattr(cluster, "connect", connect)
    r = kvfuzz_cli("run", "--ray", "--workers", "3", "--reference-engines", "1", "--traces", "1", "--out", tmp_path / "o")
    assert r.returncode == 3 and "stopped before Ray" in r.stderr, r.stderr
    assert seen["connect"] == (None, cluster.local_cpus(3, 2))
