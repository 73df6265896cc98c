"""The planner's performance model of a VC-ASGD job: its inputs and the closed forms.

A configuration is a fleet (hosts of instance types, each with T slots), P parameter
servers (assimilators) and a unit size (units per epoch). The pieces, with the papers
they come from:

* **client unit time** ``u_h`` of a host of type h: the calibrated compute time of one
  unit alone on one slot, stretched by processor sharing when a host runs more slots
  than it has cores (``max(1, T / cores)``), plus staging (reading the input weights and
  writing the result: ``stage_s``) and transfer of the weights both ways and of the data
  subset at the host's bandwidth (the computation / communication split of Yan et al.,
  "Performance Modeling and Scalability Optimization of Distributed Deep Learning
  Systems", eqs. 5-11, with the model size as the message size);
* **assimilation**: one merge takes ``merge_s`` (reading and validating the result file,
  the Redis read-modify-write of the model: calibrated at the model's size), and P
  merges run in parallel with a measured speed-up ``merge_speedup[P]`` (strict merges on
  one key conflict and retry, so P merges are not P times as fast);
* the **work generator's window** W (units in flight, default the slot count);
* **preemption** (Bernoulli, per unit dispatch, probability p; VC-ASGD paper section
  IV-E): a lost unit holds its window place until its deadline t_o (or, with notices,
  for the notice latency) and is then re-issued.

Closed form (this module) — the throughput bound, valid when nothing queues for long:

    R_c = sum_h T_h / u_h                 (client units per second)
    R_s = speedup(P) / merge_s            (parameter-server units per second)
    T_job = n_s / min(R_c, R_s) + n_s * p * t_o / S + fill
    fill  = u_typ + merge_s               (the first unit's way through an empty pipeline;
                                           u_typ: u_h averaged by each type's share of R_c)
    T_job >= max_h u_h + merge_s          (one unit of the slowest type)

with n_s units in the job and S = sum_h T_h slots (the paper's ``n*t_e + n*p*t_o`` with
``n = n_s / S`` when R_c binds; HeterPS's throughput-limited provisioning when R_s
binds). Where arrivals bunch up at few parameter servers — C x T much larger than P, all
units of a wave finishing together — the mean rates hide the queue: the discrete-event
simulation in :mod:`boinc_dl.server.planner.sim` replays the same pieces unit by unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: One merge's CPU time with P > 1 over P = 1 (no cached copy: the shards are read back
#: from Redis), measured by ``bench/bench_planner.py``'s calibration at 4,972,735
#: parameters: 0.173 s / 0.127 s.
SHARED_MERGE_RATIO = 1.36


def merge_estimate_s(model_bytes: int) -> float:
    """One merge by a lone assimilator when nothing was calibrated: 10 ms plus the model
    at ~155 MB/s (reading the result, the Redis write; 0.127 s at the paper's model size
    in the planner bench's calibration)."""
    return 0.01 + model_bytes / 170e6


@dataclass(frozen=True)
class HostType:
    """A simulated or real instance type, as the performance model sees it."""

    name: str
    unit_s: float  # one unit's compute alone on one slot (calibrated for the job's spec)
    cores: int = 4  # slots it runs without slowing each other down
    bandwidth_mbps: float = 1000.0  # to the server (transfer of weights and data)
    preempt_p: float = 0.0  # chance a unit dispatched to it is lost (spot reclaims)

    def unit_time(self, slots: int, w: Workload, costs: ServerCosts) -> float:
        """Seconds one unit holds a slot on a host of this type running ``slots`` slots."""
        share = max(1.0, slots / max(1, self.cores))
        compute = self.unit_s * w.unit_scale() * share
        transfer = (2 * w.model_bytes() + w.data_bytes_per_unit()) * 8 / (self.bandwidth_mbps * 1e6)
        return compute + costs.stage_s + transfer

    def delay_time(self, slots: int, w: Workload, costs: ServerCosts) -> float:
        """The part of :meth:`unit_time` that does not load the server host's cores: all
        of it, except the staging of slots colocated with a resource-sharing server."""
        shared = costs.stage_s if costs.sharing and costs.colocated else 0.0
        return self.unit_time(slots, w, costs) - shared


@dataclass(frozen=True)
class Workload:
    """What the job asks for: units, epochs, model size, data size."""

    units_per_epoch: int
    epochs: int
    params: int
    data_bytes: int = 0  # the whole epoch's training data
    base_units_per_epoch: int | None = None  # the unit size unit_s was calibrated at

    def unit_scale(self) -> float:
        """A unit's compute relative to the calibrated one (fewer units: bigger units)."""
        base = self.base_units_per_epoch or self.units_per_epoch
        return base / self.units_per_epoch

    def model_bytes(self) -> int:
        return 4 * self.params  # float32

    def data_bytes_per_unit(self) -> float:
        return self.data_bytes / self.units_per_epoch

    @property
    def units(self) -> int:
        return self.units_per_epoch * self.epochs


@dataclass(frozen=True)
class ServerCosts:
    """The server side: merge cost and parallel speed-up, staging, dispatch latency, and
    the server host's cores that merges (and colocated slots' staging) share.

    Without ``cpu_cores`` the model is the plain one: a merge takes ``merge_s`` and P
    merges run ``speedup(P)`` times as fast. With ``cpu_cores`` set, the resource-sharing
    model replaces the speed-up table: a merge is ``merge_cpu_s(P)`` seconds of CPU work
    (``merge_s`` for a lone assimilator, which merges from its cached copy of the model;
    ``merge_shared_s`` when P > 1, since each merge reads the shards back from Redis), and
    all CPU work on the server host — the P assimilators' merges with their Redis
    commands, plus each unit's staging when the slots run on the same host
    (``colocated``: the local backend) — is served by processor sharing over
    ``cpu_cores`` cores: k busy activities each progress at min(1, cores / k). The one
    work generator creates units one at a time, ``create_s`` CPU seconds each (it reads
    the current weights from Redis and writes them to the unit's input file).

    ``background`` (resource-sharing model): other work keeping that many of the host's
    threads busy meanwhile (another job, a test run); it shares the cores like one of
    ours: k busy activities each progress at min(1, cores / (k + background)).

    ``commit_s`` (resource-sharing model) is the part of a merge that Redis serves: it
    runs one commit at a time whatever P (one Redis thread appending the model to its
    append-only file), on the same shared cores; the assimilator waits for it. 0 when
    not measured: the whole merge is then ``merge_cpu_s``, parallel across assimilators.
    """

    merge_s: float  # one merge at this model size, one assimilator alone
    merge_speedup: dict[int, float] = field(default_factory=dict)  # P -> measured speed-up
    stage_s: float = 0.0  # per unit on the slot: read inputs, write outputs
    dispatch_s: float = 0.0  # generator + dispatcher latency before a slot starts a unit
    server_cores: int = 2  # caps the speed-up when P was not measured
    cpu_cores: float | None = None  # resource sharing on the server host (None: off)
    merge_shared_s: float | None = None  # CPU seconds of one merge when P > 1
    colocated: bool = False  # slots stage on the server host's cores (local backend)
    create_s: float = 0.0  # CPU seconds the one work generator spends creating a unit
    commit_s: float = 0.0  # seconds of Redis per merge, one commit at a time (sharing model)
    background: float = 0.0  # cores' worth of other work on the server host (sharing model)
    #: Simulation only: the work generator's CPU seconds when it closes an epoch (it
    #: evaluates the server weights, creating no unit meanwhile), and the first close's
    #: extra (it also loads the model). The last epoch closes after the last merge.
    epoch_close_s: float = 0.0
    first_close_extra_s: float = 0.0
    #: Simulation only: CPU seconds a slot's first unit spends on top of the others
    #: (it traces the model).
    first_unit_extra_s: float = 0.0
    #: Simulation only, colocated slots: g of the contention term: while k units run at
    #: once, each needs 1 + g (k - 1) times its CPU seconds (server/planner/contention.py).
    contention: float = 0.0

    def speedup(self, p: int) -> float:
        if self.sharing:
            # Throughput of P merges on the shared cores with nothing else running.
            return min(p, self.cpu_cores or 1) * self.merge_s / max(self.merge_cpu_s(p), 1e-12)
        if p in self.merge_speedup:
            return self.merge_speedup[p]
        known = sorted(self.merge_speedup)
        if known and p > known[-1]:
            return self.merge_speedup[known[-1]]  # no more gain than the largest measured
        return float(min(p, self.server_cores))

    @property
    def sharing(self) -> bool:
        """True when the resource-sharing (processor-sharing) term is on."""
        return self.cpu_cores is not None

    def merge_cpu_s(self, p: int) -> float:
        """CPU seconds of one merge with P assimilators (resource-sharing model)."""
        if p > 1 and self.merge_shared_s is not None:
            return self.merge_shared_s
        return self.merge_s

    def server_cpu_s(self, p: int) -> float:
        """CPU seconds one unit costs the server host: its creation and merge, plus its
        staging when the slots are colocated with the server."""
        return self.create_s + self.merge_cpu_s(p) + self.commit_s + (self.stage_s if self.colocated else 0.0)


@dataclass(frozen=True)
class Config:
    """One candidate: hosts (type, count), T slots per host, P assimilators, window."""

    hosts: tuple[tuple[HostType, int], ...]
    slots: int
    assimilators: int
    window: int | None = None
    timeout_s: float = 300.0
    notice_s: float | None = None  # with preemption notices: loss-to-re-issue latency

    @property
    def n_hosts(self) -> int:
        return sum(c for _, c in self.hosts)

    @property
    def total_slots(self) -> int:
        return self.n_hosts * self.slots

    def host_list(self) -> list[HostType]:
        """One entry per host, in the order the local backend numbers them."""
        return [h for h, c in self.hosts for _ in range(c)]

    def loss_cost_s(self) -> float:
        """Seconds a lost unit keeps its window place: t_o, or the notice latency."""
        return self.timeout_s if self.notice_s is None else self.notice_s


@dataclass(frozen=True)
class Prediction:
    """Predicted times of a configuration (seconds)."""

    job_s: float
    epoch_s: float
    client_rate: float  # units/s the clients can do
    server_rate: float  # units/s the parameter servers can merge
    bound: str  # "clients" or "servers"
    method: str  # "closed-form" or "simulation"


def client_rate(cfg: Config, w: Workload, costs: ServerCosts, stretch: float = 1.0) -> float:
    """R_c: units per second the fleet completes when every slot is busy (staging on
    shared cores stretched by ``stretch``)."""
    return sum(c * cfg.slots / client_hold(h, cfg, w, costs, stretch) for h, c in cfg.hosts)


def server_rate(cfg: Config, costs: ServerCosts, stretch: float = 1.0) -> float:
    """R_s: units per second P parameter servers merge."""
    if costs.sharing:
        # P merges, each stretched by the sharing, and never more CPU than the cores.
        one = max(costs.merge_cpu_s(cfg.assimilators) + costs.commit_s, 1e-12)
        serial = 1.0 / (costs.commit_s * stretch) if costs.commit_s > 0 else math.inf  # one Redis
        return min(cfg.assimilators / (one * stretch), (costs.cpu_cores or 1) / one, serial)
    return costs.speedup(cfg.assimilators) / costs.merge_s


def merge_service_s(cfg: Config, costs: ServerCosts) -> float:
    """Seconds one of P busy parameter servers spends on a merge (P / R_s)."""
    return costs.merge_s * cfg.assimilators / costs.speedup(cfg.assimilators)


def mean_preempt_p(cfg: Config) -> float:
    """The fleet's loss probability per dispatch, weighted by each host's share of units."""
    n = cfg.n_hosts
    return sum(h.preempt_p * c for h, c in cfg.hosts) / n if n else 0.0


def sharing_stretch(rho: float, cores: float) -> float:
    """Mean slow-down of a CPU activity on ``cores`` shared cores at utilisation ``rho``:
    1 + the queueing delay of an M/M/c queue in units of service time (Sakasegawa's
    approximation, rho^sqrt(2(c+1)) / (c (1 - rho))). An approximation of processor
    sharing, which the simulation models exactly; rho is capped below 1."""
    rho = min(max(rho, 0.0), 0.98)
    return 1.0 + rho ** math.sqrt(2 * (cores + 1)) / (cores * (1 - rho))


def closed_form(cfg: Config, w: Workload, costs: ServerCosts) -> Prediction:
    """The throughput bound plus the paper's preemption term (module docstring); with
    resource sharing, the rates are solved together with the cores' utilisation."""
    window = min(cfg.window or cfg.total_slots, cfg.total_slots)
    stretch = 1.0
    rc, rs = client_rate(cfg, w, costs), server_rate(cfg, costs)
    rate = min(rc * window / cfg.total_slots, rs)
    if costs.sharing:
        cores = costs.cpu_cores or 1.0
        demand = max(costs.server_cpu_s(cfg.assimilators), 1e-12)  # CPU seconds per unit on the server host
        for _ in range(60):  # fixed point: rate -> utilisation -> stretch -> rate (damped)
            stretch = sharing_stretch((rate * demand + costs.background) / cores, cores)
            rc, rs = client_rate(cfg, w, costs, stretch), server_rate(cfg, costs, stretch)
            gen = 1.0 / (costs.create_s * stretch) if costs.create_s > 0 else math.inf  # one generator
            rate = 0.5 * rate + 0.5 * min(rc * window / cfg.total_slots, rs, cores / demand, gen)
    rc_w = rc * window / cfg.total_slots  # a window below the slot count idles the rest
    n_s = w.units
    p = mean_preempt_p(cfg)
    lost = n_s * p * cfg.loss_cost_s() / max(1, window)
    merge_one = (costs.merge_cpu_s(cfg.assimilators) + costs.commit_s) * stretch if costs.sharing \
        else merge_service_s(cfg, costs)
    # The first unit's way through the empty pipeline: on a mixed fleet most units go to
    # the fast hosts, so the typical unit's hold (weighted by each type's share of the
    # rate), not the slowest's — though no job ends before one unit of its slowest type.
    holds = [(c * cfg.slots / client_hold(h, cfg, w, costs, stretch), client_hold(h, cfg, w, costs, stretch))
             for h, c in cfg.hosts]
    fill = sum(r * t for r, t in holds) / sum(r for r, _ in holds) + merge_one \
        + (costs.create_s * stretch if costs.sharing else 0.0)
    job = n_s / rate + lost + fill - 1.0 / rate  # n_s units need n_s - 1 inter-completion gaps after fill
    job = max(job, max(t for _, t in holds) + merge_one)
    return Prediction(job, job / w.epochs, rc_w, rs, "clients" if rc_w <= rs else "servers", "closed-form")


def client_hold(h: HostType, cfg: Config, w: Workload, costs: ServerCosts, stretch: float = 1.0) -> float:
    """Seconds one unit holds a slot of a host of type ``h``, dispatch included."""
    d = h.delay_time(cfg.slots, w, costs)
    return d + (h.unit_time(cfg.slots, w, costs) - d) * stretch + costs.dispatch_s


def waves(cfg: Config, w: Workload, costs: ServerCosts) -> float:
    """Exact job time of the pure wave regime: one host type, no preemption, a window of
    S slots and at least S parameter servers that merge one unit each per wave, so each
    of the ceil(n_s / S) waves takes dispatch + unit + merge (the next unit is created
    when a merge frees its window place). Checks the simulation against arithmetic."""
    (h, _), = cfg.hosts
    u = h.unit_time(cfg.slots, w, costs) + costs.dispatch_s
    return math.ceil(w.units / cfg.total_slots) * (u + merge_service_s(cfg, costs))
