"""Discrete-event simulation of a VC-ASGD job on a fleet: the queueing the closed form hides.

It replays, unit by unit, what the work generator and the job system do (the local
backend and BOINC alike):

* the generator keeps at most W units in flight (created and not yet merged) and creates
  the next unit when a merge frees a place;
* idle slots take the oldest unsent unit, in host order; a unit holds its slot for the
  dispatch latency plus the host type's unit time (processor sharing over T slots,
  staging, transfer: :meth:`~server.planner.model.HostType.unit_time`);
* each result goes to one of P parameter servers (``wu_id % P``: the unit's hash, so a
  random one) and waits there in FIFO order for ``merge_service_s``;
* preemption: a unit's first instance is lost with its host type's probability, at a
  uniform 10-90% of its run; the slot is out for ``respawn_s`` and the unit is re-issued
  at its deadline (dispatch + t_o), or ``notice_s`` after the loss with notices.

Random parts (server choice, losses) are averaged over ``reps`` seeded runs.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import deque
from dataclasses import dataclass

from server.planner.model import (
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
    unit_s = [h.unit_time(cfg.slots, w, costs) + costs.dispatch_s for h in hosts]
    m = merge_service_s(cfg, costs)
    window = min(cfg.window or cfg.total_slots, cfg.total_slots)
    n_s = w.units
    free = [True] * len(slot_host)
    unsent: deque[int] = deque()
    server_free = [0.0] * cfg.assimilators
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
        while created < n_s and created - merged < window:
            unsent.append(created)
            created += 1

    def dispatch(t: float) -> None:
        for s, ok in enumerate(free):
            if not unsent:
                return
            if not ok:
                continue
            unit = unsent.popleft()
            free[s] = False
            h = hosts[slot_host[s]]
            u = unit_s[slot_host[s]]
            first = attempts[unit] == 0
            attempts[unit] += 1
            if first and h.preempt_p and rng.random() < h.preempt_p:
                kill = t + rng.uniform(0.1, 0.9) * u
                push(kill + respawn_s, "slot_back", unit, s)
                back = kill + cfg.notice_s if cfg.notice_s is not None else t + cfg.timeout_s
                push(max(back, kill), "reissue", unit, s)
            else:
                push(t + u, "done", unit, s)

    create()
    dispatch(0.0)
    while events:
        now, _, kind, unit, slot = heapq.heappop(events)
        if kind == "done":
            free[slot] = True
            srv = server_of[unit]
            start = max(now, server_free[srv])
            server_free[srv] = start + m
            busy += m
            push(start + m, "merged", unit)
        elif kind == "merged":
            merged += 1
            create()
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
