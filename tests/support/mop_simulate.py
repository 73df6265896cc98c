"""Discrete-event simulation of MOP schedules (Cerebro, PVLDB 2020, section 5.4).

An :class:`Instance` describes one epoch of a model selection workload on a cluster in the
"related machines" model of the paper's simulation: unit ``(i, j)`` carries ``work[i, j]``
(the config's compute cost times the partition's relative size) and takes
``work[i, j] / speed[w]`` on worker ``w``. :func:`generate_instance` draws the paper's
settings (homogeneous, or heterogeneous config costs in 360-21000 MFLOPs and worker speeds
from {12.1, 5.6, 11.3, 18.7} TFLOPS). :func:`simulate` runs a :class:`MOPScheduler` in
simulated time, optionally with workers lost mid-unit and coming back, and returns the
makespan and a trace of every unit run; :func:`check_trace` verifies MOP's invariants on
that trace; :func:`lower_bound` gives a makespan lower bound to normalise by.
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from boinc_dl.server.work_generator.mop.assignment import round_robin_availability
from boinc_dl.server.work_generator.mop.scheduler import MOPScheduler

#: Worker speeds of the paper's simulation (TFLOPS): Titan Xp, K80, GTX 1080, P100.
GPU_TFLOPS = (12.1, 5.6, 11.3, 18.7)
#: Range of the paper's config compute costs (MFLOPs, 35 popular CNNs).
COST_RANGE_MFLOPS = (360.0, 21000.0)
#: Makespans are compared with a relative tolerance (float sums of unit times).
EPS = 1e-9


class InvariantViolation(AssertionError):
    """A simulated schedule broke one of MOP's invariants."""


@dataclass
class Instance:
    """One epoch of work: ``work`` (|S| x p), worker ``speed`` and the availability map."""

    work: np.ndarray
    speed: np.ndarray
    availability: dict[str, list[int]]
    models: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work = np.asarray(self.work, dtype=float)
        self.speed = np.asarray(self.speed, dtype=float)
        if self.work.ndim != 2 or self.work.size == 0:
            raise ValueError("work must be a non-empty |S| x p matrix")
        if np.any(self.work <= 0) or np.any(self.speed <= 0):
            raise ValueError("work and speeds must be positive")
        if not self.models:
            self.models = [f"m{i}" for i in range(self.work.shape[0])]
        if not self.workers:
            self.workers = list(self.availability)
        if len(self.models) != self.work.shape[0] or len(self.workers) != len(self.speed):
            raise ValueError("models/workers do not match work/speed shapes")
        self._widx = {w: k for k, w in enumerate(self.workers)}
        self._midx = {m: i for i, m in enumerate(self.models)}

    @property
    def n_models(self) -> int:
        return self.work.shape[0]

    @property
    def n_partitions(self) -> int:
        return self.work.shape[1]

    def unit_time(self, model: str, partition: int, worker: str) -> float:
        return float(self.work[self._midx[model], partition] / self.speed[self._widx[worker]])

    def times(self) -> np.ndarray:
        """Unit-time matrix T[i, j] when each partition has exactly one worker (no replicas)."""
        holder = {}
        for w, ps in self.availability.items():
            for j in ps:
                if j in holder:
                    raise ValueError("times() needs one holder per partition (no replicas)")
                holder[j] = self._widx[w]
        if len(holder) != self.n_partitions:
            raise ValueError("some partition has no worker")
        s = np.array([self.speed[holder[j]] for j in range(self.n_partitions)])
        return self.work / s[None, :]


def generate_instance(
    n_models: int,
    n_workers: int,
    heterogeneous: bool,
    seed: int,
    n_partitions: int | None = None,
    replication: int = 1,
) -> Instance:
    """Draw an instance of the paper's simulation (section 5.4).

    Homogeneous: all configs cost the same and all workers have the same speed. Heterogeneous:
    config costs are log-uniform in 360-21000 MFLOPs and worker speeds are drawn with
    replacement from :data:`GPU_TFLOPS`. The paper samples the costs of 35 real CNNs listed
    in its technical report, which we do not have; the log-uniform stand-in has the same range
    and a similar spread (mean ~5100, sd ~5300 vs. the paper's 5939 and 5671).
    """
    rng = np.random.default_rng(seed)
    p = n_workers if n_partitions is None else n_partitions
    if heterogeneous:
        lo, hi = np.log(COST_RANGE_MFLOPS[0]), np.log(COST_RANGE_MFLOPS[1])
        cost = np.exp(rng.uniform(lo, hi, size=n_models))
        speed = rng.choice(np.array(GPU_TFLOPS), size=n_workers)
    else:
        cost = np.full(n_models, 5939.0)
        speed = np.full(n_workers, 12.1)
    workers = [f"w{k}" for k in range(n_workers)]
    avail = {w: sorted(ps) for w, ps in round_robin_availability(workers, p, replication).items()}
    work = np.repeat(cost[:, None], p, axis=1)  # equal-size partitions
    return Instance(work, speed, avail, workers=workers)


def lower_bound(inst: Instance) -> float:
    """A lower bound on the makespan of one epoch of ``inst``.

    Two families of constraints any schedule obeys:

    * **model bound** -- a model's units run one after another (model isolation), each at
      best on the fastest worker holding its partition: ``C >= sum_j work[i,j] / max_{w
      holds j} speed[w]`` for every model ``i``;
    * **partition-group bound** -- the units of a set P of partitions can only run on the
      workers ``W(P)`` holding some partition of P, and in time C those process at most
      ``C * sum_{w in W(P)} speed[w]`` work: ``C >= sum_{i, j in P} work[i,j] / speed(W(P))``.

    Without replicas each worker holds its own partitions and the group bound reduces to the
    familiar "max over workers of their load" (a union of disjoint groups never beats its
    worst member); with replicas groups matter, so all 2^p subsets are enumerated when
    ``p <= 16`` (singletons and the full set otherwise, still a valid bound).
    For homogeneous units this is the open-shop bound ``max(max row sum, max column sum)``.
    """
    p = inst.n_partitions
    widx = {w: k for k, w in enumerate(inst.workers)}
    holders = [[widx[w] for w, ps in inst.availability.items() if j in ps] for j in range(p)]
    if any(not h for h in holders):
        return float("inf")
    best = np.array([inst.speed[h].max() for h in holders])
    model_lb = float((inst.work / best[None, :]).sum(axis=1).max())
    pwork = inst.work.sum(axis=0)
    nw = len(inst.workers)
    if p <= 16 and nw <= 62:
        hmask = np.array([sum(1 << k for k in h) for h in holders], dtype=np.int64)
        n = 1 << p
        work_of = np.zeros(n)
        mask_of = np.zeros(n, dtype=np.int64)
        for b in range(p):  # subset DP: subsets containing bit b = subsets below it + b
            lo, hi = 1 << b, 1 << (b + 1)
            work_of[lo:hi] = work_of[:lo] + pwork[b]
            mask_of[lo:hi] = mask_of[:lo] | hmask[b]
        speed_of = np.zeros(n)
        for k in range(nw):
            speed_of += ((mask_of >> k) & 1) * inst.speed[k]
        group_lb = float((work_of[1:] / speed_of[1:]).max())
    else:
        sp = [inst.speed[h].sum() for h in holders]
        group_lb = max(float(pwork[j] / sp[j]) for j in range(p))
        group_lb = max(group_lb, float(pwork.sum() / inst.speed.sum()))
    return max(model_lb, group_lb)


@dataclass(frozen=True)
class Failure:
    """Worker ``worker`` is lost at ``at`` (mid-unit if busy) and rejoins at ``back`` (or never)."""

    worker: str
    at: float
    back: float | None = None


@dataclass(frozen=True)
class UnitRun:
    """One unit run in the simulation: ``ok`` False if its worker was lost before the end."""

    model: str
    partition: int
    worker: str
    start: float
    end: float
    ok: bool
    attempt: int
    epoch: int


@dataclass
class SimResult:
    """Makespan per epoch (and in total), trace, and the scheduler's decision cost."""

    makespan: float
    epoch_makespans: list[float]
    trace: list[UnitRun]
    decisions: int
    decision_seconds: float
    scheduler: MOPScheduler

    @property
    def decision_us(self) -> float:
        """Mean wall time per handed-out unit, in microseconds."""
        return 1e6 * self.decision_seconds / max(self.decisions, 1)


class Stalled(RuntimeError):
    """No unit can run and none is running: some partition has no live holder."""


def simulate(
    inst: Instance,
    seed: int = 0,
    policy: str = "random-matching",
    epochs: int = 1,
    failures: Iterable[Failure] = (),
    make_scheduler: Callable[[Instance, int], MOPScheduler] | None = None,
    restart_every: int | None = None,
) -> SimResult:
    """Run ``epochs`` epochs of ``inst`` under a scheduler in simulated time.

    Events at the same instant are applied together before the scheduler is asked for
    assignments (so simultaneous completions compete fairly for models). An epoch ends when
    its last unit completes; the next starts then (an epoch boundary is a barrier, as in
    Cerebro's AutoML template). A :class:`Failure` removes the worker from the scheduler
    (its unit goes back to Q) and re-adds it with the same partitions at ``back``.
    ``restart_every=k`` simulates a work generator restarted after every k-th scheduling
    round: the scheduler is rebuilt from a JSON round trip of its state (units in flight
    stay in flight and complete after the restart).
    """
    sched = (
        make_scheduler(inst, seed)
        if make_scheduler is not None
        else MOPScheduler(
            inst.models, inst.n_partitions, inst.availability, seed=seed, policy=policy
        )
    )
    # (time, order, kind, payload); order breaks ties: fail < join < done.
    events: list[tuple[float, int, int, tuple]] = []
    seq = 0
    for f in failures:
        events.append((f.at, 0, seq, ("fail", f.worker)))
        seq += 1
        if f.back is not None:
            events.append((f.back, 1, seq, ("join", f.worker)))
            seq += 1
    heapq.heapify(events)
    alive = set(inst.workers)
    running: dict[str, tuple] = {}  # worker -> (assignment, start)
    trace: list[UnitRun] = []
    now = 0.0
    decisions = 0
    dsec = 0.0
    ends: list[float] = []
    epoch_start = 0.0
    rounds = 0
    for _ in range(epochs):
        sched.start_epoch()
        while not sched.epoch_done():
            rounds += 1
            if restart_every and rounds % restart_every == 0:
                sched = MOPScheduler.from_state(json.loads(json.dumps(sched.to_state())))
            idle = [w for w in inst.workers if w in alive and w not in running]
            if idle:
                t0 = time.perf_counter()
                got = sched.assign(idle)
                dsec += time.perf_counter() - t0
                decisions += len(got)
                for a in got:
                    d = inst.unit_time(a.model, a.partition, a.worker)
                    running[a.worker] = (a, now)
                    heapq.heappush(events, (now + d, 2, seq, ("done", a.worker, a)))
                    seq += 1
            if not events:
                raise Stalled(
                    f"epoch {sched.epoch} stalled at t={now}: partitions {sched.unservable()} "
                    "have no live worker"
                )
            now = events[0][0]
            while events and events[0][0] <= now:
                _, _, _, ev = heapq.heappop(events)
                kind, w = ev[0], ev[1]
                if kind == "done":
                    a = ev[2]
                    cur = running.get(w)
                    if cur is None or cur[0] is not a:
                        continue  # the unit was lost with its worker; this event is void
                    del running[w]
                    trace.append(
                        UnitRun(a.model, a.partition, w, cur[1], now, True, a.attempt, a.epoch)
                    )
                    sched.complete(a.model, a.partition, attempt=a.attempt)
                elif kind == "fail" and w in alive:
                    alive.discard(w)
                    cur = running.pop(w, None)
                    if cur is not None:
                        a = cur[0]
                        trace.append(
                            UnitRun(a.model, a.partition, w, cur[1], now, False, a.attempt, a.epoch)
                        )
                    sched.remove_worker(w)
                elif kind == "join" and w not in alive:
                    alive.add(w)
                    sched.add_worker(w, inst.availability[w])
        ends.append(now - epoch_start)
        epoch_start = now
    return SimResult(now, ends, trace, decisions, dsec, sched)


def check_trace(
    trace: list[UnitRun],
    inst: Instance,
    models_per_epoch: Mapping[int, Iterable[str]] | None = None,
) -> None:
    """Raise :class:`InvariantViolation` unless ``trace`` keeps MOP's invariants.

    Checks, per epoch: completeness (each (model, partition) completed exactly once),
    model isolation (a model's runs never overlap, failed runs included), worker exclusivity
    (a worker's runs never overlap), placement (a worker only runs units of partitions it
    holds) and non-preemption (a completed run lasts exactly its unit time).
    """

    def overlaps(runs: list[UnitRun], what: str) -> None:
        runs = sorted(runs, key=lambda r: (r.start, r.end))
        for a, b in zip(runs, runs[1:], strict=False):
            if b.start < a.end - EPS * max(1.0, a.end):
                raise InvariantViolation(f"{what}: {a} overlaps {b}")

    by_epoch: dict[int, list[UnitRun]] = {}
    for r in trace:
        by_epoch.setdefault(r.epoch, []).append(r)
        if r.partition not in inst.availability.get(r.worker, ()):
            raise InvariantViolation(
                f"worker {r.worker} ran partition {r.partition} it does not hold"
            )
        if r.ok:
            d = inst.unit_time(r.model, r.partition, r.worker)
            if abs((r.end - r.start) - d) > 1e-6 * max(1.0, d):
                raise InvariantViolation(f"unit preempted or stretched: {r} (unit time {d})")
    for e, runs in by_epoch.items():
        models = list(models_per_epoch[e]) if models_per_epoch else inst.models
        done: dict[tuple[str, int], int] = {}
        for r in runs:
            if r.ok:
                done[(r.model, r.partition)] = done.get((r.model, r.partition), 0) + 1
        for m in models:
            for j in range(inst.n_partitions):
                n = done.get((m, j), 0)
                if n != 1:
                    raise InvariantViolation(f"epoch {e}: unit ({m}, {j}) completed {n} times")
        extra = set(done) - {(m, j) for m in models for j in range(inst.n_partitions)}
        if extra:
            raise InvariantViolation(
                f"epoch {e}: units of unknown models completed: {sorted(extra)}"
            )
        for key, what in (
            (lambda r: r.model, "model isolation"),
            (lambda r: r.worker, "worker exclusivity"),
        ):
            groups: dict[str, list[UnitRun]] = {}
            for r in runs:
                groups.setdefault(key(r), []).append(r)
            for g in groups.values():
                overlaps(g, what)
