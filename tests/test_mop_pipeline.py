"""Pipelined MOP epochs: a model goes on to its next epoch as soon as it finished one,
with every invariant kept per model-epoch, and across a restart."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from boinc_dl.server.backends.base import JobSystem
from boinc_dl.server.work_generator.mop import MOPScheduler, SchedulerError, make_search

from .conftest import REPO


def _drive(s: MOPScheduler, epochs: int, seed: int, restart_every: int = 0) -> list:
    """Pull mode with random completion order; returns every completed assignment."""
    rng = random.Random(seed)
    flight, done, n = [], [], 0
    total = len(s.models) * s.n_partitions * epochs
    while len(done) < total:
        flight += s.issue(rng.randint(1, 3))
        assert len({a.model for a in flight}) == len(flight)  # model isolation
        assert len(flight) == len(s.in_flight())
        a = flight.pop(rng.randrange(len(flight)))
        assert s.complete(a.model, a.partition, a.attempt, a.epoch)
        assert not s.complete(a.model, a.partition, a.attempt, a.epoch)  # duplicate: stale
        done.append(a)
        if s.model_finished(a.model) and s.model_epoch(a.model) < epochs:
            assert s.advance_model(a.model) == a.epoch + 1
        n += 1
        if restart_every and n % restart_every == 0:
            s = MOPScheduler.from_state(s.to_state())
            flight = list(s.in_flight())
    assert s.in_flight() == [] and s.pending() == []
    return done


@pytest.mark.parametrize("restart_every", [0, 5])
def test_pipelined_epochs_keep_invariants(restart_every: int) -> None:
    models = [f"m{i}" for i in range(5)]
    s = MOPScheduler(models, 3, None, seed=1)
    s.start_epoch()
    done = _drive(s, epochs=3, seed=2, restart_every=restart_every)
    per = defaultdict(list)
    for a in done:
        per[(a.model, a.epoch)].append(a.partition)
    assert set(per) == {(m, e) for m in models for e in (1, 2, 3)}
    assert all(sorted(v) == [0, 1, 2] for v in per.values())  # completeness per model-epoch
    # A model's epochs follow each other: no unit of e+1 before all of e completed.
    for m in models:
        eps = [a.epoch for a in done if a.model == m]
        assert eps == sorted(eps)


def test_models_overlap_epochs_and_behind_models_go_first() -> None:
    s = MOPScheduler(["a", "b", "c"], 2, None, seed=0)
    s.start_epoch()
    first = {a.model: a for a in s.issue()}
    a1 = first["a"]
    s.complete("a", a1.partition, a1.attempt, 1)
    a2 = s.issue(1)[0]
    assert a2.model == "a" and a2.epoch == 1
    s.complete("a", a2.partition, a2.attempt, 1)
    assert s.model_finished("a") and s.advance_model("a") == 2
    assert s.model_epoch("a") == 2 and s.model_epoch("b") == 1
    nxt = s.issue(1)[0]
    assert (nxt.model, nxt.epoch) == ("a", 2)  # only runnable model: b and c are in flight
    for m in ("b", "c"):
        s.complete(m, first[m].partition, first[m].attempt, 1)
    order = s.issue()
    assert [a.model for a in order] == sorted(a.model for a in order)  # b, c (epoch 1): behind first
    assert s.visit_order("a", 1) == [a1.partition, a2.partition]
    st = MOPScheduler.from_state(s.to_state())
    assert st.model_epoch("a") == 2 and st.model_epoch("b") == 1


def test_advance_refuses_unfinished_or_unknown_models() -> None:
    s = MOPScheduler(["a"], 2, None, seed=0)
    s.start_epoch()
    with pytest.raises(SchedulerError, match="not finished"):
        s.advance_model("a")
    with pytest.raises(SchedulerError, match="unknown"):
        s.advance_model("zz")


def test_only_grid_and_random_skip_the_barrier() -> None:
    space = {"lr": {"loguniform": [1e-3, 1e-1]}, "units": [8, 16]}
    assert not make_search("grid", {"lr": [0.1, 0.01]}, epochs=2).epoch_barrier
    assert not make_search("random", space, epochs=2, budget=3).epoch_barrier
    for name in ("sha", "hyperband", "pbt"):
        assert make_search(name, space, epochs=4, budget=4).epoch_barrier


@pytest.mark.slow
def test_grid_job_pipelines_epochs_on_the_local_backend(tmp_path, redis_server) -> None:
    """The real generator: epoch-2 units exist before epoch 1 closes; per-model epoch
    results, visits and the leaderboard are complete."""
    import json

    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.run import run_job
    from boinc_dl.server.run.mop import leaderboard
    from tests.test_mop_run import _spec

    spec = _spec("pipe")
    res = run_job(spec, tmp_path / "run", redis_url=redis_server.url, live=False, search_path=REPO / "examples")
    assert res.status == "done", res.reason
    store = JobStore(connect(redis_server.url), "pipe")
    results = {int(k): json.loads(v) for k, v in store.r.hgetall(store.k("mop_results")).items()}
    assert sorted(results) == [1, 2] and all(len(r) == 4 for r in results.values())
    assert all(sorted(r["visits"]) == [0, 1] for res_e in results.values() for r in res_e.values())
    closed_1 = store.epochs()[1]["ended_at"]
    created_2 = [json.loads(v)["created_at"] for v in store.r.hvals(store.k("units")) if json.loads(v)["epoch"] == 2]
    assert len(created_2) == 8 and min(created_2) < closed_1  # no barrier
    rows = leaderboard(store)
    assert len(rows) == 4 and all(len(r["curve"]) == 2 and r["status"] == "finished" for r in rows)


class _Recorder(JobSystem):
    """A job system that only records what the generator submits (no hosts here)."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, wu, limits) -> None:
        self.submitted.append(wu.unit)

    def cancel(self, unit: str) -> None:
        raise AssertionError(f"nothing should be cancelled, got {unit}")


@pytest.mark.slow
def test_restart_from_a_barrier_state_catches_up(tmp_path, redis_server, monkeypatch) -> None:
    """A grid job saved by a generator that kept the barrier: on restart, models that
    finished their epoch are evaluated and go on at once instead of waiting forever."""
    import json

    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.work_generator.mop.procedures import GridSearch
    from boinc_dl.server.work_generator.mop_generator import MOPWorkGenerator
    from boinc_dl.server.work_generator.prepare import prepare_job
    from tests.test_mop_run import _spec

    spec = _spec("catchup")
    store = JobStore(connect(redis_server.url), "catchup")
    prepare_job(spec, store, tmp_path, search_path=REPO / "examples")
    done = store.k("assimilated")

    def finish(gen: MOPWorkGenerator, model: str) -> None:
        for a in gen.sched.in_flight():
            if a.model == model:
                store.r.hset(done, gen._unit(a), json.dumps({"val_acc": 0.5}))

    with monkeypatch.context() as m:
        m.setattr(GridSearch, "epoch_barrier", True)
        old = MOPWorkGenerator(store, spec, tmp_path, _Recorder(), None, search_path=REPO / "examples")
        assert not old.pipelined
        old.step()
        target = old.sched.models[0]
        for _ in range(2):  # both partitions of one model, the others stay in flight
            finish(old, target)
            old.step()
        assert old.sched.model_finished(target) and old.sched.model_epoch(target) == 1
    backend = _Recorder()
    new = MOPWorkGenerator(store, spec, tmp_path, backend, None, search_path=REPO / "examples")
    assert new.pipelined and new.sched.model_epoch(target) == 2
    assert store.r.hexists(store.k("mop_model_results"), f"1:{target}")
    new.step()
    assert [u for u in backend.submitted if "_e0002_" in u] and all(target in u for u in backend.submitted)


def test_a_finished_assignment_is_logged_once_across_a_restart(redis_client) -> None:
    """The generator logs a finished assignment before it saves the scheduler state that
    says so; killed in between, its restart sees the same completion again. The log (the
    run's ``history.json`` schedule) must still hold it once."""
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.work_generator.mop.state import MopState

    st = MopState(JobStore(redis_client, "sel"))
    rec = {"model": "m0", "partition": 1, "attempt": 0, "epoch": 2}
    assert st.log_assignment("sel__m0_e0002_p1", rec) is True
    assert st.log_assignment("sel__m0_e0002_p1", rec) is False  # the restart's second sight
    assert st.log_assignment("sel__m1_e0002_p1", {**rec, "model": "m1"}) is True
    assert [r["model"] for r in st.schedule_log()] == ["m0", "m1"]


def test_a_job_cancelled_from_outside_leaves_nothing_open(tmp_path, redis_server) -> None:
    """``boinc-dl cancel`` sets the status from another process: the generator's next step
    cancels the units in flight (in the job system and in Redis) and ends the
    configurations still training, so status and the leaderboard say the job is over."""
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.work_generator.mop_generator import MOPWorkGenerator
    from boinc_dl.server.work_generator.prepare import prepare_job
    from tests.test_mop_run import _spec

    class Cancelling(_Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.cancelled: list[str] = []

        def cancel(self, unit: str) -> None:
            self.cancelled.append(unit)

    spec = _spec("cancelme")
    store = JobStore(connect(redis_server.url), "cancelme")
    prepare_job(spec, store, tmp_path, search_path=REPO / "examples")
    backend = Cancelling()
    gen = MOPWorkGenerator(store, spec, tmp_path, backend, None, search_path=REPO / "examples")
    assert gen.step() and backend.submitted
    assert store.cancel() is None  # what `boinc-dl cancel` does
    assert gen.step() is False
    assert sorted(backend.cancelled) == sorted(backend.submitted)
    assert set(store.unit_states().values()) == {"cancelled"}
    configs = gen.state.configs().values()
    assert {c["status"] for c in configs} == {"stopped"} and {c["reason"] for c in configs} == {"job cancelled"}
    assert store.cancel() == "cancelled"  # a second cancel changes nothing


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs (not an Exception: no handler sees it)."""


@pytest.mark.slow
def test_a_kill_inside_an_epoch_close_is_finished_by_the_restart_not_decided_again(tmp_path, redis_server) -> None:
    """PBT keeps the epoch barrier: the close records the epoch's results, the search decides
    (stop the worst, clone the best), then the scheduler is saved. Killed in between, the
    restart's replay had already fed those results to the search, and closing the epoch
    again asked it to decide epoch 1 twice: "expected results of epoch 2, got epoch 1", a
    crash on every --resume. Found by SIGKILLing `boinc-dl run` of a PBT job at random."""
    import json

    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.work_generator.mop.scheduler import MOPScheduler
    from boinc_dl.server.work_generator.mop_generator import MOPWorkGenerator
    from boinc_dl.server.work_generator.prepare import prepare_job
    from tests.test_mop_run import _spec

    spec = _spec("pbtkill", mop={"partitions": 2, "search": "pbt", "budget": 4,
                                 "param_grid": {"hidden": [8, 16], "learning_rate": {"loguniform": [0.001, 0.1]}},
                                 "search_options": {"quantile": 0.5}})
    store = JobStore(connect(redis_server.url), "pbtkill")
    prepare_job(spec, store, tmp_path, search_path=REPO / "examples")

    def finish_flight(gen: MOPWorkGenerator) -> None:
        for a in gen.sched.in_flight():
            store.r.hset(store.k("assimilated"), gen._unit(a), json.dumps({"val_acc": 0.5}))

    gen = MOPWorkGenerator(store, spec, tmp_path, _Recorder(), None, search_path=REPO / "examples")
    assert not gen.pipelined
    for _ in range(2):  # epoch 1: each model on both partitions
        gen.step()
        finish_flight(gen)
    gen._poll_results()
    assert gen.sched.epoch_done()
    killed = MOPScheduler.start_epoch

    def kill(self, *a, **k):
        raise _Killed

    MOPScheduler.start_epoch = kill
    try:
        with pytest.raises(_Killed):
            gen.step()  # closes epoch 1: results recorded, decision taken, killed before the save
    finally:
        MOPScheduler.start_epoch = killed
    decided = store.epochs()[1]
    assert decided["stopped"] and decided["added"]  # PBT did stop and clone at epoch 1

    backend = _Recorder()
    again = MOPWorkGenerator(store, spec, tmp_path, backend, None, search_path=REPO / "examples")
    assert again.step()  # it crashed here
    assert store.epochs()[1] == decided and int(store.meta()["epoch"]) == 2  # closed once, same decision
    live = set(again.sched.models)
    assert live == (set(gen.sched.models) - set(decided["stopped"])) | set(decided["added"])
    assert backend.submitted and all("_e0002_" in u and any(m in u for m in live) for u in backend.submitted)
    configs = again.state.configs()
    assert all(configs[m]["status"] == "stopped" for m in decided["stopped"])
    assert all(configs[m]["status"] == "running" for m in live)
