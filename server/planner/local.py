"""Planning a run on the local backend: this machine's cores and memory.

The local backend (docs/DESIGN: the embedded default) runs C worker processes of T
slots each, P assimilators, the work generator and Redis on one machine. Every one of
them is CPU work on the same cores, so the plan uses the planner's resource-sharing
model with all of a unit's client time as shared CPU work: a unit is
``compute_per_example * examples + overhead`` CPU seconds (the calibration's, from a
past run's units.csv: :mod:`.calibrate`), each slot runs one unit at a time on one
thread, a merge is the assimilator's measured CPU seconds and Redis' commit its
measured wait; processor sharing over the machine's cores (exactly, in the simulation)
does the rest, with the other work this machine is doing when it plans (its busy
cores over one second of ``/proc/stat``) sharing the cores too. The dispatch latency is
the run loop's: the generator steps every 50 ms.
The simulation also has each slot's first unit tracing the model, and the generator's
evaluation at each epoch's close but the last (after the last merge), creating no unit
meanwhile (both from the calibration run's records, CPU work on the same cores).

Candidates: C x T slots up to twice the cores (more only queue for them) and what the
memory holds at :data:`SLOT_MEMORY_BYTES` a slot, P up to the slots, the spec's unit
size and one unit per slot.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from boinc_dl.server.planner.calibrate import Calibration
from boinc_dl.server.planner.contention import factor
from boinc_dl.server.planner.model import (
    SHARED_MERGE_RATIO,
    Config,
    HostType,
    Prediction,
    ServerCosts,
    Workload,
    merge_estimate_s,
)
from boinc_dl.server.planner.sim import simulate

#: Resident memory of one slot process with TensorFlow loaded (a digits MLP slot measured
#: 0.35-0.45 GB here); the plan keeps the slots within 80% of the machine's memory.
SLOT_MEMORY_BYTES = 500 << 20
#: The run loop steps the work generator every 50 ms: a unit waits half of that on average.
DISPATCH_S = 0.05
#: MAPE of the local-backend plan on 12 generated configurations it was not calibrated
#: on, calibrated as docs/planner.md says (three 1-slot runs and one of 2 x cores slots
#: pooled; bench/bench_planner.py --generated 12 --cal-runs 3, bench/README.md,
#: 2026-11-26, round 4, the machine at rest): 9.8% on a fresh seed (71), 6.2% on seed 57;
#: round 5, two runs per seed, at rest: 2.4-4.7% on seeds 57, 89 and 101.
#: Other work that starts or stops during the run is not in it: 13-26% was measured with
#: other test suites coming and going on the same 2 cores (rounds 2 and 3).
EXPECTED_ERROR_LOCAL = 0.10
#: MAPE of the fleet model on the planner bench's 14 configurations (synthetic unit
#: times, real merges; bench/README.md): a fleet of separate hosts, not one machine.
EXPECTED_ERROR_FLEET = 0.07


@dataclass(frozen=True)
class Machine:
    """What the local backend runs on."""

    cores: int
    memory_bytes: int | None
    background: float = 0.0  # cores' worth of other work measured when planning

    def max_slots(self) -> int:
        by_cores = max(2, 2 * self.cores)
        if self.memory_bytes is None:
            return by_cores
        return max(1, min(by_cores, int(0.8 * self.memory_bytes // SLOT_MEMORY_BYTES)))


def background_load(sample_s: float = 1.0) -> float:
    """Cores' worth of CPU this machine spends on other work now: its busy share over
    ``sample_s`` seconds of ``/proc/stat`` (Linux; 0 elsewhere), times its cores."""
    def snap() -> tuple[float, float] | None:
        try:
            with open("/proc/stat") as f:
                parts = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)  # idle + iowait
        return idle, sum(parts)
    import time

    a = snap()
    time.sleep(sample_s)
    b = snap()
    if a is None or b is None or b[1] <= a[1]:
        return 0.0
    busy = 1.0 - (b[0] - a[0]) / (b[1] - a[1])
    return max(0.0, busy) * (os.cpu_count() or 1)


def this_machine() -> Machine:
    """This machine's cores (those this process may use) and physical memory."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        mem: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        mem = None
    return Machine(cores, mem)


@dataclass(frozen=True)
class LocalCandidate:
    workers: int  # C
    slots: int  # T per worker
    assimilators: int  # P
    units_per_epoch: int

    def describe(self) -> str:
        return (f"{self.workers} worker{'s' * (self.workers > 1)} x {self.slots} slot{'s' * (self.slots > 1)}, "
                f"P={self.assimilators}, {self.units_per_epoch} units/epoch")


@dataclass(frozen=True)
class LocalPlan:
    cand: LocalCandidate
    pred: Prediction
    bound: str  # "clients" | "clients (cores)" | "servers"


def local_model(cal: Calibration, cand: LocalCandidate, machine: Machine, *, epochs: int, params: int,
                n_train: int, local_epochs: int, window: int | None = None,
                timeout_s: float = 300.0) -> tuple[Config, Workload, ServerCosts]:
    """The planner's inputs for one local-backend configuration."""
    examples = n_train / cand.units_per_epoch * local_epochs
    unit_cpu = cal.unit_compute_s(examples) + cal.overhead_s
    merge = cal.merge_s if cal.merge_s is not None else merge_estimate_s(4 * params)
    costs = ServerCosts(merge_s=merge, stage_s=unit_cpu, dispatch_s=DISPATCH_S, server_cores=machine.cores,
                        cpu_cores=machine.cores, merge_shared_s=merge * SHARED_MERGE_RATIO, colocated=True,
                        commit_s=cal.commit_s or 0.0, background=machine.background,
                        epoch_close_s=cal.eval_s, first_close_extra_s=cal.first_eval_extra_s,
                        first_unit_extra_s=cal.first_unit_extra_s, contention=cal.contention.g)
    # The whole unit is CPU work on the shared cores (stage_s, colocated): nothing of it a delay.
    host = HostType("this machine", unit_s=0.0, cores=1 << 20, bandwidth_mbps=1e15)
    cfg = Config(((host, cand.workers),), cand.slots, cand.assimilators, window=window, timeout_s=timeout_s)
    return cfg, Workload(cand.units_per_epoch, epochs, params), costs


def bound_of(cfg: Config, costs: ServerCosts) -> str:
    """What limits the rate: the slots, the shared cores (mostly the clients' CPU), or the
    parameter servers (P merges, Redis' one commit at a time)."""
    # Every slot busy: each unit's CPU stretched by the contention of all of them.
    stage = costs.stage_s * factor(costs.contention, cfg.total_slots)
    slots = cfg.total_slots / (stage + costs.dispatch_s)
    m = costs.merge_cpu_s(cfg.assimilators)
    cores = max(0.1, (costs.cpu_cores or 1) - costs.background) / (stage + m + costs.commit_s)
    servers = min(cfg.assimilators / (m + costs.commit_s), 1 / costs.commit_s if costs.commit_s > 0 else math.inf)
    if servers < min(slots, cores):
        return "servers"
    return "clients (cores)" if cores < slots else "clients"


def transfer_share(cfg: Config, w: Workload, costs: ServerCosts) -> float:
    """The share of the slowest host type's unit time spent moving weights and data."""
    worst = 0.0
    for h, _ in cfg.hosts:
        total = h.unit_time(cfg.slots, w, costs)
        moved = (2 * w.model_bytes() + w.data_bytes_per_unit()) * 8 / (h.bandwidth_mbps * 1e6)
        worst = max(worst, moved / total if total > 0 else 0.0)
    return worst


def candidates(machine: Machine, units_per_epoch: int, max_workers: int = 4) -> list[LocalCandidate]:
    out = []
    for c in range(1, max_workers + 1):
        for t in range(1, machine.max_slots() + 1):
            s = c * t
            if s > machine.max_slots():
                continue
            for p in range(1, min(s, 4) + 1):
                for u in sorted({units_per_epoch, s}):
                    out.append(LocalCandidate(c, t, p, u))
    return out


def predict(cal: Calibration, cand: LocalCandidate, machine: Machine, *, epochs: int, params: int, n_train: int,
            local_epochs: int, window: int | None = None, timeout_s: float = 300.0, reps: int = 5) -> LocalPlan:
    """Simulated epoch time of one local-backend configuration."""
    cfg, w, costs = local_model(cal, cand, machine, epochs=epochs, params=params, n_train=n_train,
                                local_epochs=local_epochs, window=window, timeout_s=timeout_s)
    # The simulation has each slot's first unit tracing the model, and the generator's
    # evaluation when it closes an epoch (the first also loading the model), creating no
    # unit meanwhile: CPU work on the same cores as the rest.
    pred = simulate(cfg, w, costs, reps=reps)
    return LocalPlan(cand, pred, bound_of(cfg, costs))


def plan_local(cal: Calibration, machine: Machine, *, epochs: int, params: int, n_train: int, local_epochs: int,
               units_per_epoch: int, window: int | None = None, timeout_s: float = 300.0) -> list[LocalPlan]:
    """Every candidate, fastest first."""
    plans = [predict(cal, c, machine, epochs=epochs, params=params, n_train=n_train, local_epochs=local_epochs,
                     window=window, timeout_s=timeout_s, reps=3)
             for c in candidates(machine, units_per_epoch)]
    return sorted(plans, key=lambda p: p.pred.epoch_s)


def fmt_s(x: float) -> str:
    """Seconds with the precision short epochs need: 0.412 s, 12.3 s, 1,234 s."""
    if x < 10:
        return f"{x:.3f} s"
    if x < 1000:
        return f"{x:.1f} s"
    return f"{x:,.0f} s"
