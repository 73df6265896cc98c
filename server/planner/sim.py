"""Discrete-event simulation of a VC-ASGD job on a fleet: the queueing the closed form hides.

It replays, unit by unit, what the work generator and the job system do (the local
backend and BOINC alike):

* the generator keeps at most W units in flight (created and not yet merged) and creates
  the next unit when a merge frees a place;
* idle slots take the oldest unsent unit, in host order; a unit holds its slot for the
  dispatch latency plus the host type's unit time (processor sharing over T slots,
  staging, transfer: :meth:`~boinc_dl.server.planner.model.HostType.unit_time`);
* each result goes to one of P parameter servers (``wu_id % P``: the unit's hash, so a
  random one) and waits there in FIFO order for ``merge_service_s``;
* with resource sharing on (``ServerCosts.cpu_cores``), a merge is instead
  ``merge_cpu_s(P)`` seconds of CPU work, and so is each unit's staging on slots
  colocated with the server; all of it is served by processor sharing over the server
  host's cores (k busy activities each advance at min(1, cores / k)), so many slots
  staging at once slow the merges down and vice versa; the one work generator's
  creation of each unit (``create_s``) is CPU work there too, one unit at a time;
* preemption: a unit's first instance is lost with its host type's probability, at a
  uniform 10-90% of its run; the slot is out for ``respawn_s`` and the unit is re-issued
  at its deadline (dispatch + t_o), or ``notice_s`` after the loss with notices;
* contention (``ServerCosts.contention``, colocated slots): while k units run at once
  each needs ``1 + g (k - 1)`` times its CPU seconds (:mod:`.contention`).

Random parts (server choice, losses) are averaged over ``reps`` seeded runs.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass

from boinc_dl.server.planner.contention import factor
from boinc_dl.server.planner.model import (
    Config,
    Prediction,
    ServerCosts,
    Workload,
    client_rate,
    merge_service_s,
    server_rate,
)


@dataclass
class SimResult:
    """One simulated run: job time and per-resource busy times."""

    job_s: float
    merges: int
    lost: int
    server_busy_s: float


def simulate_once(cfg: Config, w: Workload, costs: ServerCosts, seed: int = 0, respawn_s: float = 0.5,
                  assign: str = "hash") -> SimResult:
    """One seeded run of the whole job; ``assign`` is ``hash`` (random) or ``round_robin``."""
    rng = random.Random(seed)
    hosts = cfg.host_list()
    slot_host = [i for i, _ in enumerate(hosts) for _ in range(cfg.slots)]
    sharing = costs.sharing
    # Without sharing a unit holds its slot for a fixed time; with it, for a fixed delay
    # and then its staging as CPU work on the shared cores (colocated slots only).
    delay_s = [h.delay_time(cfg.slots, w, costs) + costs.dispatch_s for h in hosts]
    stage_cpu = [h.unit_time(cfg.slots, w, costs) - h.delay_time(cfg.slots, w, costs) for h in hosts]
    m = costs.merge_cpu_s(cfg.assimilators) if sharing else merge_service_s(cfg, costs)
    cores = float(costs.cpu_cores or 1.0)
    background = costs.background if sharing else 0.0  # other work's busy threads on the cores
    contention = costs.contention if sharing and costs.colocated else 0.0
    window = min(cfg.window or cfg.total_slots, cfg.total_slots)
    n_s = w.units
    free = [True] * len(slot_host)
    unsent: deque[int] = deque()
    server_free = [0.0] * cfg.assimilators  # without sharing: when each server is next free
    server_queue: list[deque[int]] = [deque() for _ in range(cfg.assimilators)]  # with sharing
    server_busy = [False] * cfg.assimilators
    cpu: list[list] = []  # with sharing: [remaining CPU seconds, kind, unit, slot or server]
    gen_cpu = costs.create_s if sharing else 0.0
    commit_s = costs.commit_s if sharing else 0.0
    commits: deque[tuple[int, int]] = deque()  # (unit, server) waiting for the one Redis
    redis_busy = False
    gen_queue: deque[int] = deque()
    gen_busy = False
    # Epoch closes: the generator evaluates when an epoch's last unit merges (creating no
    # unit meanwhile); the last epoch's close comes after the last merge, outside the job.
    per_epoch = w.units_per_epoch
    merged_in = [0] * w.epochs
    closed = 0
    closing = False
    first_done = [False] * len(slot_host)  # each slot's first unit traces the model
    server_of = [rng.randrange(cfg.assimilators) if assign == "hash" else u % cfg.assimilators
                 for u in range(n_s)]
    attempts = [0] * n_s
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, unit, slot)
    seq = 0
    created = merged = lost = 0
    busy = 0.0
    now = 0.0

    def push(t: float, kind: str, unit: int, slot: int = -1) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, unit, slot))

    def create() -> None:
        nonlocal created
        if closing:
            return  # the generator is evaluating: the next step creates
        while created < n_s and created - merged < window:
            if gen_cpu > 0:
                gen_queue.append(created)  # the one generator writes its input file first
            else:
                unsent.append(created)
            created += 1
        start_create()

    def start_create() -> None:
        nonlocal gen_busy
        if gen_queue and not gen_busy:
            gen_busy = True
            cpu.append([gen_cpu, "create", gen_queue.popleft(), -1])

    def dispatch(t: float) -> None:
        for s, ok in enumerate(free):
            if not unsent:
                return
            if not ok:
                continue
            unit = unsent.popleft()
            free[s] = False
            h = hosts[slot_host[s]]
            u = delay_s[slot_host[s]]
            first = attempts[unit] == 0
            attempts[unit] += 1
            if first and h.preempt_p and rng.random() < h.preempt_p:
                kill = t + rng.uniform(0.1, 0.9) * u
                push(kill + respawn_s, "slot_back", unit, s)
                back = kill + cfg.notice_s if cfg.notice_s is not None else t + cfg.timeout_s
                push(max(back, kill), "reissue", unit, s)
            else:
                # Without sharing a slot's first unit traces the model as a delay.
                extra = 0.0 if sharing or first_done[s] else costs.first_unit_extra_s
                push(t + u + extra, "computed", unit, s)

    def start_merge(srv: int) -> None:
        nonlocal busy
        if not server_busy[srv] and server_queue[srv]:
            server_busy[srv] = True
            cpu.append([m, "merge", server_queue[srv].popleft(), srv])
            busy += m

    def result_in(t: float, unit: int) -> None:
        nonlocal busy
        srv = server_of[unit]
        if sharing:
            server_queue[srv].append(unit)
            start_merge(srv)
        else:
            start = max(t, server_free[srv])
            server_free[srv] = start + m
            busy += m
            push(start + m, "merged", unit)

    def start_commit() -> None:
        nonlocal redis_busy, busy
        if commits and not redis_busy:
            redis_busy = True
            unit, srv = commits.popleft()
            cpu.append([commit_s, "commit", unit, srv])
            busy += commit_s

    def cpu_done(job: list) -> None:
        nonlocal gen_busy, redis_busy
        _, kind, unit, where = job
        if kind == "create":
            gen_busy = False
            unsent.append(unit)
            start_create()
        elif kind == "close":
            end_close()
        elif kind == "stage":
            free[where] = True
            result_in(now, unit)
        elif kind == "merge" and commit_s > 0:
            commits.append((unit, where))  # the assimilator waits for Redis' reply
            start_commit()
        else:
            if kind == "commit":
                redis_busy = False
                start_commit()
            server_busy[where] = False
            on_merged(unit)
            start_merge(where)

    def on_merged(unit: int) -> None:
        nonlocal merged
        merged += 1
        merged_in[unit // per_epoch] += 1
        if not closing:
            gen_step()

    def gen_step() -> None:
        """The generator's step: close the epochs whose units all merged (the evaluation,
        CPU work on the shared cores), then fill the window."""
        nonlocal closed, closing
        while closed < w.epochs - 1 and merged_in[closed] == per_epoch:
            close_s = costs.epoch_close_s + (costs.first_close_extra_s if closed == 0 else 0.0)
            closed += 1
            if close_s > 0:
                closing = True
                if sharing:
                    cpu.append([close_s, "close", -1, -1])
                else:
                    push(now + close_s, "closed", -1)
                return
        create()

    def end_close() -> None:
        nonlocal closing
        closing = False
        gen_step()

    create()
    dispatch(0.0)
    while events or cpu:
        rate = min(1.0, cores / (len(cpu) + background)) if cpu else 1.0
        # Contention: k units running at once each need f(k) = 1 + g (k - 1) times their
        # CPU seconds alone, so their work advances 1 / f(k) as fast as the rest.
        running = sum(j[1] == "stage" for j in cpu) if contention > 0 else 0
        unit_rate = rate / factor(contention, running)
        t_cpu = now + min(j[0] / (unit_rate if j[1] == "stage" else rate) for j in cpu) if cpu else float("inf")
        if events and events[0][0] <= t_cpu:
            t_next, _, kind, unit, slot = heapq.heappop(events)
        else:
            t_next, kind, unit, slot = t_cpu, "cpu", -1, -1
        for j in cpu:  # processor sharing: every CPU activity advanced at the same rate
            j[0] -= (t_next - now) * (unit_rate if j[1] == "stage" else rate)
        now = t_next
        if kind == "cpu":
            for j in [j for j in cpu if j[0] <= 1e-12]:
                cpu.remove(j)
                cpu_done(j)
        elif kind == "computed":
            extra = 0.0 if first_done[slot] or not sharing else costs.first_unit_extra_s
            first_done[slot] = True
            if sharing and stage_cpu[slot_host[slot]] + extra > 0:
                cpu.append([stage_cpu[slot_host[slot]] + extra, "stage", unit, slot])
            else:
                free[slot] = True
                result_in(now, unit)
        elif kind == "merged":
            on_merged(unit)
        elif kind == "closed":
            end_close()
        elif kind == "slot_back":
            free[slot] = True
        elif kind == "reissue":
            lost += 1
            unsent.append(unit)
        dispatch(now)
    return SimResult(now, merged, lost, busy)


def simulate(cfg: Config, w: Workload, costs: ServerCosts, reps: int = 5, seed: int = 0,
             respawn_s: float = 0.5) -> Prediction:
    """Mean job time over ``reps`` seeded runs, as a :class:`Prediction`."""
    runs = [simulate_once(cfg, w, costs, seed=seed + i, respawn_s=respawn_s) for i in range(reps)]
    job = statistics.fmean(r.job_s for r in runs)
    rc, rs = client_rate(cfg, w, costs), server_rate(cfg, costs)
    return Prediction(job, job / w.epochs, rc, rs, "clients" if rc <= rs else "servers", "simulation")
