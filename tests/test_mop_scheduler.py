"""MOP scheduler: invariants on simulated runs (hypothesis), restarts, replicas, pull mode, MILP."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from boinc_dl.server.work_generator.mop import (
    POLICIES,
    MOPScheduler,
    SchedulerError,
    round_robin_availability,
)
from tests.support.mop_milp import (
    exhaustive_makespan,
    schedule_makespan,
    solve_milp,
)
from tests.support.mop_simulate import (
    Failure,
    Instance,
    InvariantViolation,
    Stalled,
    UnitRun,
    check_trace,
    generate_instance,
    lower_bound,
    simulate,
)

# ----------------------------------------------------------------------------- strategies


@st.composite
def instances(draw, max_models=7, max_workers=5):
    n_models = draw(st.integers(1, max_models))
    n_workers = draw(st.integers(1, max_workers))
    n_parts = draw(st.integers(1, 6))
    replication = draw(st.integers(1, n_workers))
    work = draw(
        st.lists(
            st.floats(0.1, 10.0, allow_nan=False),
            min_size=n_models * n_parts,
            max_size=n_models * n_parts,
        )
    )
    speed = draw(
        st.lists(st.sampled_from([5.6, 11.3, 12.1, 18.7]), min_size=n_workers, max_size=n_workers)
    )
    workers = [f"w{k}" for k in range(n_workers)]
    avail = {
        w: sorted(p) for w, p in round_robin_availability(workers, n_parts, replication).items()
    }
    return Instance(
        np.array(work).reshape(n_models, n_parts), np.array(speed), avail, workers=workers
    )


@st.composite
def failures(draw, inst: Instance):
    horizon = float(inst.work.sum() / inst.speed.min())
    out = []
    for _ in range(draw(st.integers(0, 4))):
        w = draw(st.sampled_from(inst.workers))
        at = horizon * draw(st.floats(0.0, 0.5))
        down = horizon * draw(st.floats(0.001, 0.25))
        out.append(Failure(w, at, at + down))
    return out


# ----------------------------------------------------------------------------- invariants


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**31),
    epochs=st.integers(1, 2),
)
def test_invariants_hold_on_simulated_runs_with_failures(data, policy, seed, epochs):
    inst = data.draw(instances())
    fails = data.draw(failures(inst))
    r = simulate(inst, seed=seed, policy=policy, epochs=epochs, failures=fails)
    check_trace(r.trace, inst)  # completeness, isolation, exclusivity, placement, no preemption
    assert sorted({u.epoch for u in r.trace}) == list(range(1, epochs + 1))
    if not fails:
        lb = lower_bound(inst)
        assert r.epoch_makespans[0] >= lb * (1 - 1e-9)
    sched = r.scheduler
    for m in inst.models:
        assert sorted(sched.visit_order(m)) == list(range(inst.n_partitions))
    # The visit order is the order the simulated model actually trained in.
    last = [u for u in r.trace if u.ok and u.epoch == epochs]
    for m in inst.models:
        runs = sorted((u for u in last if u.model == m), key=lambda u: u.start)
        assert [u.partition for u in runs] == sched.visit_order(m)


def test_check_trace_catches_violations():
    inst = Instance(np.ones((2, 2)), np.ones(2), {"w0": [0], "w1": [1]})
    good = [
        UnitRun("m0", 0, "w0", 0, 1, True, 1, 1),
        UnitRun("m1", 1, "w1", 0, 1, True, 1, 1),
        UnitRun("m0", 1, "w1", 1, 2, True, 1, 1),
        UnitRun("m1", 0, "w0", 1, 2, True, 1, 1),
    ]
    check_trace(good, inst)
    with pytest.raises(InvariantViolation, match="completed 0 times"):
        check_trace(good[:3], inst)
    with pytest.raises(InvariantViolation, match="model isolation"):
        check_trace([*good[:2], UnitRun("m0", 1, "w1", 0.5, 1.5, False, 1, 1), *good[2:]], inst)
    with pytest.raises(InvariantViolation, match="worker exclusivity"):
        bad = [
            UnitRun("m0", 0, "w0", 0, 1, True, 1, 1),
            UnitRun("m1", 0, "w0", 0.5, 1.5, True, 1, 1),
            UnitRun("m0", 1, "w1", 1, 2, True, 1, 1),
            UnitRun("m1", 1, "w1", 2, 3, True, 1, 1),
        ]
        check_trace(bad, inst)
    with pytest.raises(InvariantViolation, match="does not hold"):
        check_trace([UnitRun("m0", 1, "w0", 0, 1, True, 1, 1)], inst)
    with pytest.raises(InvariantViolation, match="preempted"):
        check_trace([UnitRun("m0", 0, "w0", 0, 0.5, True, 1, 1)], inst)


class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of every operation, with JSON restarts in between."""

    def __init__(self):
        super().__init__()
        self.p = 4
        self.models = [f"m{i}" for i in range(5)]
        self.s = MOPScheduler(
            self.models, self.p, round_robin_availability(["a", "b", "c"], self.p, 2), seed=3
        )
        self.s.start_epoch()
        self.done: dict[tuple[str, int], int] = {}
        self.spare = ["d", "e"]

    @rule(data=st.data())
    def assign(self, data):
        idle = [w for w in self.s.workers if w not in self.s.busy_workers()]
        ws = data.draw(st.lists(st.sampled_from(idle), unique=True)) if idle else []
        for a in self.s.assign(ws):
            assert a.partition in self.s.workers[a.worker]

    @rule(data=st.data(), n=st.integers(0, 3))
    def issue(self, data, n):
        for a in self.s.issue(n):
            assert a.worker is None

    @precondition(lambda self: self.s.in_flight())
    @rule(data=st.data(), ok=st.booleans(), stale=st.booleans())
    def finish(self, data, ok, stale):
        a = data.draw(st.sampled_from(self.s.in_flight()))
        if stale and a.attempt > 1:  # a late result of an earlier attempt is refused
            assert not self.s.complete(a.model, a.partition, attempt=a.attempt - 1)
        if ok:
            assert self.s.complete(a.model, a.partition, attempt=a.attempt)
            key = (a.model, a.partition)
            self.done[key] = self.done.get(key, 0) + 1
            assert not self.s.complete(a.model, a.partition, attempt=a.attempt)  # duplicate
        else:
            assert self.s.fail(a.model, a.partition, attempt=a.attempt)

    @precondition(lambda self: len(self.s.workers) > 1)
    @rule(data=st.data())
    def lose_worker(self, data):
        w = data.draw(st.sampled_from(sorted(self.s.workers)))
        busy = self.s.busy_workers().get(w)
        lost = self.s.remove_worker(w)
        assert [a.model for a in lost] == ([busy] if busy else [])
        self.spare.append(w)

    @precondition(lambda self: self.spare)
    @rule(data=st.data())
    def add_worker(self, data):
        w = self.spare.pop()
        parts = data.draw(st.lists(st.integers(0, self.p - 1), min_size=1, unique=True))
        self.s.add_worker(w, parts)

    @rule()
    def restart(self):
        self.s = MOPScheduler.from_state(json.loads(json.dumps(self.s.to_state())))

    @rule()
    def drain(self):
        """Run the epoch to its end (so epoch boundaries are reached within a short run)."""
        if self.s.unservable():
            w = self.spare.pop() if self.spare else "z"
            self.s.add_worker(w, range(self.p))
        while not self.s.epoch_done():
            idle = [w for w in self.s.workers if w not in self.s.busy_workers()]
            self.s.assign(idle)
            self.s.issue(1)
            for a in self.s.in_flight():
                assert self.s.complete(a.model, a.partition, attempt=a.attempt)
                self.done[(a.model, a.partition)] = self.done.get((a.model, a.partition), 0) + 1

    @precondition(lambda self: self.s.epoch_done())
    @rule()
    def next_epoch(self):
        assert self.done == {(m, j): 1 for m in self.models for j in range(self.p)}
        self.done = {}
        self.s.start_epoch()

    @invariant()
    def consistent(self):
        fl = self.s.in_flight()
        assert len({a.model for a in fl}) == len(fl)  # model isolation
        busy = [a.worker for a in fl if a.worker is not None]
        assert len(set(busy)) == len(busy)  # one unit per worker slot
        pend = self.s.pending()
        units = set(pend) | {(a.model, a.partition) for a in fl} | set(self.done)
        assert len(pend) + len(fl) + len(self.done) == len(units) == len(self.models) * self.p
        assert all(n == 1 for n in self.done.values())
        for m in self.models:
            assert len(self.s.visit_order(m)) == sum(1 for (mm, _) in self.done if mm == m)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ----------------------------------------------------------------------------- restarts


@settings(max_examples=40, deadline=None)
@given(
    inst=instances(),
    seed=st.integers(0, 1000),
    k=st.integers(1, 5),
    policy=st.sampled_from(POLICIES),
)
def test_restart_from_json_state_continues_identically(inst, seed, k, policy):
    plain = simulate(inst, seed=seed, policy=policy, epochs=2)
    restarted = simulate(inst, seed=seed, policy=policy, epochs=2, restart_every=k)
    assert restarted.trace == plain.trace  # no unit duplicated, skipped or reordered
    check_trace(restarted.trace, inst)


def test_state_round_trip_mid_epoch_accepts_in_flight_results():
    s = MOPScheduler(
        [f"m{i}" for i in range(6)], 3, round_robin_availability(["a", "b", "c"], 3), seed=1
    )
    s.start_epoch()
    first = s.assign(["a", "b", "c"])
    s.complete(first[0].model, first[0].partition)
    state = json.loads(json.dumps(s.to_state()))
    t = MOPScheduler.from_state(state)
    assert t.to_state() == s.to_state()
    assert t.in_flight() == s.in_flight()
    # Results of units in flight before the restart are accepted once after it.
    for a in first[1:]:
        assert t.complete(a.model, a.partition, attempt=a.attempt)
        assert not t.complete(a.model, a.partition, attempt=a.attempt)
    assert t.assign([first[0].worker]) == s.assign([first[0].worker])


def test_state_rejects_unknown_format():
    s = MOPScheduler(["m"], 1, {"w": [0]})
    st_ = s.to_state()
    st_["format"] = 99
    with pytest.raises(SchedulerError, match="format"):
        MOPScheduler.from_state(st_)


# ----------------------------------------------------------------------------- behaviour


def test_same_seed_same_schedule_and_visit_orders():
    inst = generate_instance(16, 4, True, seed=0)
    a = simulate(inst, seed=5)
    b = simulate(inst, seed=5)
    c = simulate(inst, seed=6, policy="random")
    d = simulate(inst, seed=7, policy="random")
    assert a.trace == b.trace
    assert a.scheduler.visit_orders() == b.scheduler.visit_orders()
    assert c.scheduler.visit_orders() != d.scheduler.visit_orders()


def test_lost_worker_with_replica_finishes_epoch_without_it():
    inst = generate_instance(8, 4, False, seed=0, replication=2)
    r = simulate(inst, seed=0, failures=[Failure("w1", 0.1)])  # never comes back
    check_trace(r.trace, inst)
    lost = [u for u in r.trace if not u.ok]
    assert len(lost) == 1 and lost[0].worker == "w1"
    assert all(u.start < 0.1 for u in r.trace if u.worker == "w1")
    retried = [
        u for u in r.trace if u.ok and (u.model, u.partition) == (lost[0].model, lost[0].partition)
    ]
    assert retried and retried[0].attempt == 2 and retried[0].worker != "w1"


def test_lost_worker_without_replica_stalls_with_clear_message():
    inst = generate_instance(4, 2, False, seed=0)
    with pytest.raises(Stalled, match=r"partitions \[1\]"):
        simulate(inst, seed=0, failures=[Failure("w1", 0.1)])


def test_worker_comes_back_and_epoch_completes():
    inst = generate_instance(6, 3, True, seed=2)
    r = simulate(inst, seed=0, failures=[Failure("w0", 100.0, 5000.0), Failure("w2", 300.0, 400.0)])
    check_trace(r.trace, inst)
    assert r.scheduler.epoch_done()


def test_drop_model_mid_epoch():
    s = MOPScheduler(["a", "b", "c"], 2, {"w0": [0], "w1": [1]}, seed=0)
    s.start_epoch()
    got = {a.model: a for a in s.assign(["w0", "w1"])}
    victim = next(iter(got))
    assert s.drop_model(victim) == got[victim]
    assert not s.complete(victim, got[victim].partition)  # its late result is stale
    assert victim not in s.models and all(m != victim for m, _ in s.pending())
    while not s.epoch_done():
        for a in s.in_flight():
            s.complete(a.model, a.partition)
        s.assign([w for w in ("w0", "w1") if w not in s.busy_workers()])
    assert s.start_epoch() == 2 and victim not in s.models


def test_pull_mode_one_unit_per_model_and_partition_capacity():
    models = [f"m{i}" for i in range(10)]
    s = MOPScheduler(models, 4, None, seed=0, partition_capacity={0: 1, 1: 1, 2: 1, 3: 1})
    s.start_epoch()
    assert set(s.runnable()) == set(models)
    first = s.issue()
    assert len(first) == 4  # one per partition: capacity 1 each
    assert sorted(a.partition for a in first) == [0, 1, 2, 3]
    assert len({a.model for a in first}) == 4
    assert all(a.model not in s.runnable() for a in first)
    assert s.issue() == []
    s.fail(first[0].model, first[0].partition)
    again = s.issue(1)
    assert len(again) == 1 and again[0].partition == first[0].partition
    with pytest.raises(SchedulerError, match="availability"):
        s.assign(["w0"])


def test_pull_mode_capacity_defaults_to_holders_and_completes_epoch():
    avail = round_robin_availability(["h0", "h1", "h2"], 3, replication=2)
    s = MOPScheduler([f"m{i}" for i in range(7)], 3, avail, seed=4)
    assert [s.capacity(j) for j in range(3)] == [2, 2, 2]
    s.start_epoch()
    seen = []
    while not s.epoch_done():
        batch = s.issue(5)
        load = {}
        for a in s.in_flight():
            load[a.partition] = load.get(a.partition, 0) + 1
        assert all(n <= 2 for n in load.values())
        for a in batch:
            s.complete(a.model, a.partition, attempt=a.attempt)
            seen.append((a.model, a.partition))
    assert sorted(seen) == sorted((f"m{i}", j) for i in range(7) for j in range(3))


def test_errors_are_clear():
    with pytest.raises(SchedulerError, match="duplicate"):
        MOPScheduler(["a", "a"], 2, None)
    with pytest.raises(SchedulerError, match="outside"):
        MOPScheduler(["a"], 2, {"w": [2]})
    with pytest.raises(SchedulerError, match="policy"):
        MOPScheduler(["a"], 2, None, policy="lifo")
    with pytest.raises(SchedulerError, match="replication"):
        round_robin_availability(["w"], 2, replication=2)
    s = MOPScheduler(["a", "b"], 1, {"w": [0], "v": [0]}, seed=0)
    s.start_epoch()
    with pytest.raises(SchedulerError, match="unknown worker"):
        s.assign(["x"])
    s.assign(["w"])
    with pytest.raises(SchedulerError, match="already running"):
        s.assign(["w"])
    with pytest.raises(SchedulerError, match="not finished"):
        s.start_epoch()
    assert not s.complete("zz", 0)  # e.g. a late result of a model the search stopped
    with pytest.raises(SchedulerError, match="outside"):
        s.complete("a", 5)
    with pytest.raises(SchedulerError, match="no models"):
        MOPScheduler([], 1, None).start_epoch()


def test_decision_time_under_1ms_at_256_models_16_partitions():
    inst = generate_instance(256, 16, True, seed=0)
    r = simulate(inst, seed=0)
    assert r.decision_us < 1000, r.decision_us
    s = MOPScheduler(inst.models, 16, inst.availability, seed=0)
    s.start_epoch()
    s.assign(inst.workers)
    t0 = time.perf_counter()
    n = 0
    for _ in range(200):  # one idle worker at a time, the common case
        a = s.in_flight()[0]
        s.complete(a.model, a.partition)
        got = s.assign([a.worker])
        n += len(got)
    assert n == 200
    assert (time.perf_counter() - t0) / n < 1e-3


# ----------------------------------------------------------------------------- MILP and bounds


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(1, 3), (2, 2), (2, 3), (3, 2), (4, 1)]),
    data=st.data(),
)
def test_milp_equals_brute_force_on_tiny_instances(shape, data):
    S, p = shape
    T = np.array(
        data.draw(st.lists(st.integers(1, 9), min_size=S * p, max_size=S * p)), float
    ).reshape(S, p)
    exact = exhaustive_makespan(T)
    r = solve_milp(T, time_limit=20)
    assert r.optimal
    assert r.makespan == pytest.approx(exact, rel=1e-6)
    assert schedule_makespan(T, r.start) == pytest.approx(exact, rel=1e-6)
    lb = max(T.sum(0).max(), T.sum(1).max())
    assert lb <= exact + 1e-9


@pytest.mark.slow
def test_milp_equals_brute_force_3x3():
    rng = np.random.default_rng(0)
    for _ in range(2):
        T = rng.integers(1, 10, (3, 3)).astype(float)
        assert solve_milp(T).makespan == pytest.approx(exhaustive_makespan(T), rel=1e-6)


def test_milp_warm_start_and_randomized_not_better_than_optimum():
    inst = generate_instance(5, 3, True, seed=3)
    T = inst.times()
    sim = simulate(inst, seed=0, policy="random")
    X0 = np.zeros(T.shape)
    for u in sim.trace:
        X0[inst.models.index(u.model), u.partition] = u.start
    assert schedule_makespan(T, X0) == pytest.approx(sim.makespan)
    r = solve_milp(T, warm_start=X0)
    assert r.optimal
    assert lower_bound(inst) <= r.makespan * (1 + 1e-9)
    assert r.makespan <= sim.makespan * (1 + 1e-9)


def test_lower_bound_with_replicas_uses_partition_groups():
    # Partition 0 is on w0 only, partition 1 on w0 and w1: the group {0, 1} is served by
    # {w0, w1}, but partition 0 alone by w0 -- the singleton bound is the binding one.
    inst = Instance(np.ones((4, 2)), np.ones(2), {"w0": [0, 1], "w1": [1]})
    assert lower_bound(inst) == pytest.approx(4.0)
    r = simulate(inst, seed=0)
    check_trace(r.trace, inst)
    assert r.makespan >= 4.0


def test_default_policy_uses_replicas_well():
    """With replicas, critical-partition priority keeps the default near the bound."""
    ratios = {"random-matching": [], "random": []}
    for seed in range(3):
        inst = generate_instance(64, 8, True, seed=seed, replication=2)
        lb = lower_bound(inst)
        for pol in ratios:
            r = simulate(inst, seed=seed, policy=pol)
            check_trace(r.trace, inst)
            ratios[pol].append(r.makespan / lb)
    assert np.mean(ratios["random-matching"]) < 1.15
    assert np.mean(ratios["random-matching"]) < np.mean(ratios["random"])


def test_result_of_an_earlier_epoch_is_stale():
    s = MOPScheduler(["m"], 1, {"w": [0]}, seed=0)
    s.start_epoch()
    (a1,) = s.assign(["w"])
    assert s.complete(a1.model, a1.partition, a1.attempt, a1.epoch)
    s.start_epoch()
    (a2,) = s.assign(["w"])
    assert (a2.model, a2.partition, a2.attempt) == (a1.model, a1.partition, a1.attempt)
    assert not s.complete(a1.model, a1.partition, a1.attempt, a1.epoch)  # duplicate of epoch 1
    assert s.in_flight() == [a2]
    assert s.complete(a2.model, a2.partition, a2.attempt, a2.epoch)
