"""A simulated-clock model of BOINC clients fetching work from a boinc-dl project.

It answers "how much of the hosts' time is lost waiting for work?" for a work generator
(MOP with or without the epoch barrier, VC-ASGD with a fixed or host-sized window) and a
project setting (``<next_rpc_delay>``), in a fraction of a second per simulated hour.

The client follows BOINC 7.20's rules (``client/cs_scheduler.cpp``, ``client/work_fetch.cpp``):

* every 5 s (``SCHEDULER_RPC_POLL_PERIOD``) it considers one scheduler RPC, in this order:
  a project-requested RPC once ``next_rpc_time`` passed (``RPC_REASON_PROJECT_REQ``),
  then, checked every 60 s (``WORK_FETCH_PERIOD``) or at once after a task exits:
  results due (``RESULTS_DUE``: at once when the deadline is less than a day away, which
  is always the case for boinc-dl's ``delay_bound``, else an hour after completion) and
  work fetch (``RPC_REASON_NEED_WORK``) when a slot is idle and the project's work fetch
  is not backed off;
* every RPC waits for ``min_rpc_time``: the reply's ``request_delay``, 7 s with
  ``make_project --production``'s ``min_sendwork_interval`` of 6 s, none with the 0 that
  ``boinc-dl boinc install`` sets (:func:`boinc_dl.server.backends.boinc.host_contact.request_delay_s`);
  a finished task waits for it too, ``report_immediately`` or not
  (``find_project_with_overdue_results`` skips a project inside ``min_rpc_time``);
* a task's upload finishing clears the work-fetch backoff (``clear_backoffs`` in
  ``CLIENT_STATE::update_results``); uploads take no time here;
* every RPC reports the finished tasks and piggybacks a work request for the idle slots,
  *also while backed off* (``piggyback_work_request`` accepts ``RSC_REASON_BACKED_OFF``);
  an RPC is held back only by ``min_rpc_time``, which "no tasks" replies do not set;
* a reply without work to a request of reason ``NEED_WORK`` or ``RESULTS_DUE``, while not
  backed off, backs off work fetch for ``(0.5 + U[0,1)) x interval``, the interval
  starting at 600 s and doubling up to 86400 s; a reply with work clears the backoff;
* the reply's ``next_rpc_delay`` sets ``next_rpc_time = now + delay`` (0: none).

The server side: a reported result is validated and assimilated ``assimilate_s`` later;
the work generator runs every ``poll_s`` and, with ``wake_on_merge``, also in the second a
merge lands (boinc-dl's work generator checks its jobs for merges 4 times a second); a
created unit becomes sendable after the feeder's ``feeder_s`` (its ``--sleep_interval``:
5 s by default, 1 s as boinc-dl's install sets it). The client's work buffer is one task per idle slot (BOINC
preferences with no extra buffered work).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from boinc_dl.server.backends.boinc.boincdb import HostRow
from boinc_dl.server.backends.boinc.hosts import active_window
from boinc_dl.server.work_generator.mop.scheduler import Assignment, MOPScheduler

WF_MIN_BACKOFF_INTERVAL = 600.0
WF_MAX_BACKOFF_INTERVAL = 86400.0
SCHEDULER_RPC_POLL_PERIOD = 5.0
WORK_FETCH_PERIOD = 60.0
MAX_REPORT_DELAY = 3600.0

# RPC reasons (client/common_defs.h); only the ones that matter here.
NEED_WORK, RESULTS_DUE, PROJECT_REQ = "need_work", "results_due", "project_req"


class Generator(Protocol):
    """The server's work generator as the simulation sees it."""

    def step(self, now: float) -> list[Any]:
        """One pass at ``now``: the units it creates."""

    def done(self, unit: Any) -> None:
        """``unit`` was assimilated."""

    def work_left(self) -> bool:
        """Units remain to be created."""

    def finished(self) -> bool:
        """Every unit assimilated."""


class MOPGenerator:
    """MOP's generator logic on :class:`MOPScheduler` (pull mode, one unit per model).

    ``pipelined``: a model that finished its epoch goes on at once (grid/random search);
    otherwise every model waits for the epoch to close (the barrier).
    """

    def __init__(self, models: int, partitions: int, epochs: int, pipelined: bool, seed: int = 0):
        self.epochs, self.pipelined = epochs, pipelined
        self.sched = MOPScheduler([f"m{i}" for i in range(models)], partitions, None, seed=seed)
        self.sched.start_epoch()
        self.total = models * partitions * epochs
        self.created = self.merged = 0

    def step(self, now: float) -> list[Assignment]:
        s = self.sched
        if not self.pipelined and s.epoch_done() and s.epoch < self.epochs:
            s.start_epoch()
        new = s.issue(len(s.models) - len(s.in_flight()))
        self.created += len(new)
        return new

    def done(self, unit: Assignment) -> None:
        s = self.sched
        if s.complete(unit.model, unit.partition, unit.attempt, unit.epoch):
            self.merged += 1
            if self.pipelined and s.model_finished(unit.model) and s.model_epoch(unit.model) < self.epochs:
                s.advance_model(unit.model)

    def work_left(self) -> bool:
        return self.created < self.total

    def finished(self) -> bool:
        return self.merged >= self.total


class VCASGDGenerator:
    """VC-ASGD's window: ``window`` units in flight, or sized from the active hosts."""

    def __init__(self, subsets: int, epochs: int, window: int | None, bound: int | None = None):
        self.total = subsets * epochs
        self.window, self.bound = window, bound
        self.project: SimProject | None = None
        self.created = self.merged = 0

    def attach(self, project: SimProject) -> None:
        """The project whose host table sizes the window (``window=None``)."""
        self.project = project

    def current_window(self, now: float) -> int:
        if self.window is not None or self.project is None:
            return self.window or 8
        live = self.project.active_window(now)
        return max(1, min(live, self.bound) if self.bound else live)

    def step(self, now: float) -> list[int]:
        free = self.current_window(now) - (self.created - self.merged)
        n = max(0, min(free, self.total - self.created))
        new = list(range(self.created, self.created + n))
        self.created += n
        return new

    def done(self, unit: int) -> None:
        self.merged += 1

    def work_left(self) -> bool:
        return self.created < self.total

    def finished(self) -> bool:
        return self.merged >= self.total


@dataclass
class SimProject:
    """The server: scheduler queue, validator/assimilator latency, generator passes."""

    gen: Generator
    next_rpc_delay: float = 0.0
    assimilate_s: float = 10.0
    poll_s: float = 5.0
    feeder_s: float = 5.0
    wake_on_merge: bool = False  # the generator also runs in the second a merge lands
    active_s: float = 3600.0
    sendable: deque = field(default_factory=deque)  # (available_at, unit)
    assimilating: list = field(default_factory=list)  # (due, unit)
    rpc_time: dict[int, float] = field(default_factory=dict)
    ncpus: dict[int, int] = field(default_factory=dict)
    rpcs: int = 0
    last_created_at: float = 0.0

    def active_window(self, now: float) -> int:
        rows = [HostRow(id=h, rpc_time=t, p_ncpus=self.ncpus[h], p_fpops=0.0) for h, t in self.rpc_time.items()]
        return active_window(rows, now, self.active_s)

    def tick(self, now: float) -> None:
        due = [u for t, u in self.assimilating if t <= now]
        self.assimilating = [(t, u) for t, u in self.assimilating if t > now]
        for u in due:
            self.gen.done(u)
        if now % self.poll_s == 0 or (self.wake_on_merge and due):
            new = self.gen.step(now)
            if new:
                self.last_created_at = now
            for u in new:
                self.sendable.append((now + self.feeder_s, u))

    def rpc(self, host: int, ncpus: int, now: float, reported: list, n_wanted: int) -> list:
        """A scheduler request: take the reports, send up to ``n_wanted`` units."""
        self.rpcs += 1
        self.rpc_time[host], self.ncpus[host] = now, ncpus
        for u in reported:
            self.assimilating.append((now + self.assimilate_s, u))
        out = []
        while n_wanted > len(out) and self.sendable and self.sendable[0][0] <= now:
            out.append(self.sendable.popleft()[1])
        return out


@dataclass
class Client:
    """One BOINC client (host) with ``slots`` CPU slots; see the module docstring."""

    id: int
    slots: int
    rng: random.Random
    unit_s: float = 60.0
    jitter: float = 0.25
    results_due_at_once: bool = True  # report deadline within REPORT_DEADLINE_CUSHION (a day)
    request_delay: float = 7.0  # min_sendwork_interval 6 s: max(1.01 x 6, 6 + 1)
    # The client's own pace (0: instantaneous). A real 7.20 client advances once a second,
    # so a task starts about 4 s after the reply that sent it (the reply turned into
    # downloads, the downloads, each noticed on a later second) and its upload is done
    # about 6 s after it exits (exit noticed, then a size query and the data for a file
    # of 8 KB or more): docs/boinc.md, "Latency". The slot counts as busy while the
    # task's inputs download and free while its outputs upload.
    fetch_s: float = 0.0
    upload_s: float = 0.0
    min_rpc_time: float = 0.0
    running: list = field(default_factory=list)  # (ends_at, unit)
    uploading: list = field(default_factory=list)  # (upload_done_at, exited_at, unit)
    ready: list = field(default_factory=list)  # (completed_at, unit)
    backoff_time: float = 0.0
    backoff_interval: float = 0.0
    next_rpc_time: float = 0.0
    last_work_fetch: float = -math.inf
    must_check_work_fetch: bool = False
    phase: int = 0  # clients are not synchronised: each polls at its own second
    idle_s: float = 0.0
    busy_s: float = 0.0
    backoffs: int = 0
    report_delays: list = field(default_factory=list)  # completion -> report, seconds

    def _backoff(self, now: float) -> None:
        """``RSC_PROJECT_WORK_FETCH::resource_backoff``."""
        if self.backoff_interval:
            self.backoff_interval = min(self.backoff_interval * 2, WF_MAX_BACKOFF_INTERVAL)
        else:
            self.backoff_interval = WF_MIN_BACKOFF_INTERVAL
        self.backoff_time = now + (0.5 + self.rng.random()) * self.backoff_interval
        self.backoffs += 1

    def _rpc(self, p: SimProject, now: float, reason: str) -> None:
        idle = self.slots - len(self.running)
        reported = [u for _, u in self.ready]
        self.report_delays.extend(now - c for c, _ in self.ready)
        self.ready = []
        got = p.rpc(self.id, self.slots, now, reported, idle)
        for u in got:
            d = self.unit_s * (1 + self.jitter * (2 * self.rng.random() - 1))
            self.running.append((now + self.fetch_s + d, u))
        # handle_scheduler_reply: request_delay, next_rpc_delay, then WORK_FETCH::handle_reply.
        self.min_rpc_time = now + self.request_delay
        self.next_rpc_time = now + p.next_rpc_delay if p.next_rpc_delay else 0.0
        if idle > 0 and not got and self.backoff_time < now and reason in (NEED_WORK, RESULTS_DUE):
            self._backoff(now)
        if got:
            self.backoff_time = self.backoff_interval = 0.0

    def tick(self, p: SimProject, now: float, dt: float, counting: bool) -> None:
        """Advance the client by ``dt`` seconds ending at ``now``."""
        for end, u in [r for r in self.running if r[0] <= now]:
            self.running.remove((end, u))
            self.uploading.append((end + self.upload_s, end, u))
            self.must_check_work_fetch = True  # "application exited"
        for done, end, u in [r for r in self.uploading if r[0] <= now]:
            self.uploading.remove((done, end, u))
            self.ready.append((end, u))
            self.must_check_work_fetch = True  # "project finished uploading"
            self.backoff_time = self.backoff_interval = 0.0  # upload done: clear_backoffs
        if counting:
            idle = self.slots - len(self.running)
            self.idle_s += idle * dt
            self.busy_s += len(self.running) * dt
        if (now + self.phase) % SCHEDULER_RPC_POLL_PERIOD or now < self.min_rpc_time:
            return
        if self.next_rpc_time and self.next_rpc_time < now:
            self._rpc(p, now, PROJECT_REQ)
            return
        if not self.must_check_work_fetch and now - self.last_work_fetch < WORK_FETCH_PERIOD:
            return
        self.must_check_work_fetch, self.last_work_fetch = False, now
        due = [c for c, _ in self.ready if self.results_due_at_once or now > c + MAX_REPORT_DELAY]
        if due:
            self._rpc(p, now, RESULTS_DUE)
        elif len(self.running) < self.slots and now >= self.backoff_time:
            self._rpc(p, now, NEED_WORK)


@dataclass
class SimResult:
    """What one simulated run measured."""

    idle_share: float  # idle slot time / all slot time while the job had units to create
    makespan_s: float
    rpcs_per_host_hour: float
    backoffs: int
    finished: bool
    report_delay_median_s: float = 0.0  # a task's completion -> its report (scheduler RPC)
    report_delay_max_s: float = 0.0


def simulate(gen: Generator, hosts: int, slots: int, next_rpc_delay: float = 0.0, unit_s: float = 60.0,
             seed: int = 0, request_delay: float = 7.0, max_s: float = 86400.0,
             project: SimProject | None = None, fetch_s: float = 0.0, upload_s: float = 0.0,
             **server: float) -> SimResult:
    """Run ``hosts`` clients of ``slots`` slots against ``gen`` until every unit is merged
    (``fetch_s``, ``upload_s``: the client's own pace, see :class:`Client`)."""
    rng = random.Random(seed)
    active_s = max(180.0, 3 * next_rpc_delay) if next_rpc_delay else 3600.0  # as server.backends.boinc.hosts
    p = project or SimProject(gen, next_rpc_delay=next_rpc_delay, active_s=active_s, **server)
    if isinstance(gen, VCASGDGenerator):
        gen.attach(p)
    clients = []
    for i in range(hosts):
        c = Client(i, slots, random.Random(rng.random()), unit_s=unit_s, request_delay=request_delay,
                   fetch_s=fetch_s, upload_s=upload_s)
        # Idle and not backed off when the job arrives, each at its own point of its
        # 60 s work-fetch cycle and 5 s poll cycle.
        c.last_work_fetch, c.phase = -rng.uniform(0, WORK_FETCH_PERIOD), rng.randrange(5)
        clients.append(c)
    now, dt = 0.0, 1.0
    while not gen.finished() and now < max_s:
        now += dt
        p.tick(now)
        counting = gen.work_left() or bool(p.sendable)
        for c in clients:
            c.tick(p, now, dt, counting)
    idle = sum(c.idle_s for c in clients)
    total = idle + sum(c.busy_s for c in clients)
    delays = sorted(d for c in clients for d in c.report_delays)
    return SimResult(idle_share=idle / total if total else 0.0, makespan_s=now,
                     rpcs_per_host_hour=p.rpcs / hosts / (now / 3600.0),
                     backoffs=sum(c.backoffs for c in clients), finished=gen.finished(),
                     report_delay_median_s=delays[len(delays) // 2] if delays else 0.0,
                     report_delay_max_s=delays[-1] if delays else 0.0)
