"""The embedded job system: N simulated hosts x T slots on one machine.

It stands in for BOINC so that ``boinc-dl run`` trains on a laptop and every test of
scheduling, merging and fault handling runs for real:

* **slots** are long-lived worker processes (TensorFlow imported once, through a
  fork server) that run the client app in-process on one unit at a time, in their
  own slot directory whose input files are links to the job's files, and "upload"
  outputs into ``upload/<result>/``. Each talks to the dispatcher over its own pipe,
  never a shared queue: a process SIGKILLed mid-message cannot leave a lock held;
* **instances** ("results" in BOINC's words) of a workunit are dispatched to idle
  slots; an instance not returned by its deadline (``delay_bound``) is replaced by a
  new one while the late one may still come back. As in BOINC's transitioner,
  invalid results and client errors count against ``max_error_results``; a missed
  deadline or a unit reported lost counts only against ``max_total_results``; when a
  limit is hit the unit is given up (the assimilator's ``--error`` path);
* **re-issue policy** (``set_reissue_policy``): ``same`` re-issues the unit's inputs
  (BOINC's behaviour); ``fresh`` asks the work generator, through
  :meth:`LocalJobSystem.regeneration_requests` / :meth:`LocalJobSystem.resubmit_regenerated`,
  to rebuild a timed-out or lost unit from the freshest weights under a new name
  ``<unit>_r<n>``. The result identity stays the subset's unit, so the first result
  merged for the subset wins and any other (a late original) is a duplicate. If the
  generator does not answer within ``regen_grace_s`` (say Redis is down), the unit's
  inputs are re-issued as they are;
* **P assimilator processes** run the same validator + assimilator entry point that
  BOINC's ``script_assimilator`` calls, each owning units with ``wu_id % P == i``
  (BOINC's ``--mod P i``). Delivery is at least once: a result stays pending until
  its assimilator acknowledges it, a dead assimilator is restarted and its pending
  results re-sent, and result files are deleted only after the acknowledgement (the
  file deleter runs after the database update in BOINC too). The merge is idempotent,
  so a re-sent, late or duplicate result is never merged twice. A result that kills
  its assimilator ``poison_after`` times in a row is quarantined: rejected with that
  reason instead of being re-sent forever;
* a process that keeps dying right after it starts is respawned with an exponential
  backoff (and an error in the log), not in a tight loop;
* **preemption** can be simulated: with probability ``preempt_prob`` a unit's host is
  reclaimed mid-unit, in one of three ways (``preempt_mode``):

  - ``vanish``: the slot process is SIGKILLed; the server learns of it only at the
    deadline (t_o);
  - ``notice``: a preemption notice arrives first (a notice file, read by the same
    watcher the client app runs on a spot VM); the client checkpoints and reports
    the unit lost, the server re-issues it at once, then the host goes. A client that
    does not report within ``notice_grace_s`` is killed and falls back to the deadline;
  - ``restart``: the slot process is SIGKILLed and restarted in the same slot (a
    host reboot or a client restart); it resumes the unit from its checkpoint. The
    work redone is reported by the client (``redone_batches``).

  :attr:`LocalJobSystem.reissue_delays` records, for every lost unit, the time from
  the loss (kill or notice) to its re-issue and to the re-issued unit's dispatch;
* a **synthetic unit mode** (``synthetic_unit_s``) replaces training with a sleep of
  that length that copies the input weights (plus a small seeded step) to a valid
  result: the whole pipeline (files, validation, merges, deadlines, kills) runs, with
  unit times under control, for the expected-time and planner benchmarks. A list
  gives one time per host (hosts of different simulated instance types).

No scheduler protocol, accounts or web server: it is not a second BOINC.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from boinc_dl.server.backends.base import JobSystem, RetryLimits
from boinc_dl.server.backends.local.assimilators import AssimilatorPool, _Assimilator
from boinc_dl.server.backends.local.preemption import SimulatedPreemption
from boinc_dl.server.backends.local.slots import SlotPool, _Slot
from boinc_dl.server.backends.local.units import UnitBook, _Instance, _Unit
from boinc_dl.server.common.diskfaults import ServerResourceError
from boinc_dl.server.common.workunit import DATA, Workunit

log = logging.getLogger(__name__)

PREEMPT_MODES = ("vanish", "notice", "restart")

#: The backend's log under its directory: its fork server's and its children's output.
LOG_NAME = "local-backend.log"

#: What the slots' fork server imports before it forks a slot or an assimilator:
#: TensorFlow first, lean (server.common.tf_preload), then the client's training code.
FORKSERVER_PRELOAD = ("boinc_dl.server.common.tf_preload", "boinc_dl.client_app.train", "h5py", "numpy")


def process_context() -> Any:
    """The multiprocessing context the local backend starts its slots and assimilators
    with: a fork server that has :data:`FORKSERVER_PRELOAD` in memory (TensorFlow is
    imported once per run, not once per slot)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def backend_log(base_dir: Path) -> Path:
    """The backend's log under its directory ``base_dir`` (the run directory)."""
    return Path(base_dir).resolve() / LOG_NAME


def start_fork_server(base_dir: Path) -> None:
    """Start this process's fork server (if it has none yet) with its stdout and stderr on
    the backend's log under ``base_dir`` (:func:`backend_log`): TensorFlow's start-up lines
    in every slot, and any child's traceback, go there instead of the run's console. It returns at once; the server imports
    :data:`FORKSERVER_PRELOAD` in the background, so a run that starts it before preparing
    its job (which imports TensorFlow too) pays for both imports once, side by side."""
    from multiprocessing import forkserver

    from boinc_dl.server.common.tf_env import quiet_env, stdio_to

    process_context()
    quiet_env()
    log_file = backend_log(base_dir)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with stdio_to(log_file):
        forkserver.ensure_running()


def stop_fork_server() -> None:
    """Stop this process's fork server, if it has one: for a run that ends before its
    backend started (a job that fails to prepare), whose fork server may still be
    importing TensorFlow and would outlive the run by seconds. multiprocessing has no
    public call for it; without its private fields this does nothing and the server ends
    by itself once its imports finish (it exits when the process that started it is gone)."""
    import signal
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGTERM)  # it may be in its preload: the alive pipe is read only after
    except ProcessLookupError:
        pass
    try:
        server._stop()  # closes its pipe and reaps it
    except (OSError, ChildProcessError):
        pass



class LocalJobSystem(UnitBook, SlotPool, SimulatedPreemption, AssimilatorPool, JobSystem):
    """N hosts x T slots and P assimilators on this machine (see module docstring)."""

    def __init__(self, base_dir: Path, redis_url: str, job: str, workers: int = 4, slots: int = 2,
                 assimilators: int = 2, threads_per_slot: int = 1, preempt_prob: float = 0.0,
                 notice: bool = False, seed: int = 0, *, preempt_mode: str | None = None,
                 preempt_reissued: bool = True, notice_grace_s: float = 10.0, regen_grace_s: float = 5.0,
                 reissue: str = "same", synthetic_unit_s: float | list[float] | None = None,
                 poison_after: int = 3):
        self.base = Path(base_dir).resolve()
        self.redis_url = redis_url
        self.job = job
        self.n_hosts, self.n_slots, self.n_assim = workers, slots, assimilators
        self.threads = threads_per_slot
        self.preempt_prob = preempt_prob
        self.preempt_mode = preempt_mode or ("notice" if notice else "vanish")
        if self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_mode must be one of {PREEMPT_MODES}, got {self.preempt_mode!r}")
        self.notice = self.preempt_mode == "notice"
        self.preempt_reissued = preempt_reissued
        self.notice_grace_s = notice_grace_s
        self.regen_grace_s = regen_grace_s
        self.set_reissue_policy(reissue)
        if isinstance(synthetic_unit_s, (list, tuple)) and len(synthetic_unit_s) != workers:
            raise ValueError(f"synthetic_unit_s: one time per host ({workers}), got {len(synthetic_unit_s)}")
        self.synthetic_unit_s = synthetic_unit_s
        self.poison_after = poison_after
        self.capacity = workers * slots
        self.rng = random.Random(seed)
        self.ctx = process_context()
        self.assims: list[_Assimilator] = []
        self.slots: list[_Slot] = []
        self.units: dict[str, _Unit] = {}
        self.instances: dict[str, _Instance] = {}
        self.unsent: deque[str] = deque()
        self.regen_pending: set[str] = set()
        self.seq = 0
        self.lock = threading.RLock()
        # Wakes the dispatcher at once when work arrives (instead of at its next poll).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.counters: dict[str, int] = {k: 0 for k in (
            "sent", "returned", "timed_out", "reissued", "preempted", "client_errors", "rejected",
            "merged", "duplicates", "given_up", "late_results", "slot_restarts", "lost_reported",
            "notices", "notice_unreported", "restarted_in_slot", "redone_batches", "batches_done",
            "regen_requested", "regenerated", "regen_fallback", "assimilator_restarts", "redelivered",
            "quarantined", "server_faults", "app_restarts")}
        #: The first server-side I/O fault (a full disk under the run directory), if any:
        #: dispatching stops, nothing is charged to a unit, and the run pauses.
        self.server_fault: ServerResourceError | None = None
        #: One entry per lost unit: how it was lost and the time to its re-issue and dispatch.
        self.reissue_delays: list[dict[str, Any]] = []
        #: Client metrics of units that were restarted in their slot (work redone, resume point).
        self.restart_log: list[dict[str, Any]] = []
        #: Seconds from dispatch to each simulated preemption (the work a kill destroys).
        self.kill_offsets: list[float] = []
        #: Seconds each preempted slot was out of service: from the kill or notice until its
        #: replacement (a new slot process, standing in for a new VM) said "ready".
        self.slot_downtimes: list[float] = []
        self.poisoned: set[str] = set()
        #: (unit, reason) of every failed instance: client errors and rejected results, in
        #: order (the first ones are what a failing job reports; bounded).
        self.failure_log: list[tuple[str, str]] = []
        self.unit_times: list[float] = []
        self.host_data: dict[int, set[str]] = {h: set() for h in range(workers)}
        self.slot_busy_s = 0.0
        self.started_at = 0.0
        self.log_file = backend_log(self.base)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        (self.base / "upload").mkdir(parents=True, exist_ok=True)
        start_fork_server(self.base)
        for i in range(self.n_assim):
            a = _Assimilator(i)
            self._spawn_assimilator(a)
            self.assims.append(a)
        for h in range(self.n_hosts):
            for s in range(self.n_slots):
                slot = _Slot(h, s)
                self._spawn(slot)
                self.slots.append(slot)
        self.started_at = time.time()
        self.thread = threading.Thread(target=self._loop, name="bdl-local-dispatcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self._wake()
        if self.thread is not None:
            self.thread.join(timeout=10)
        for conn in [s.conn for s in self.slots] + [a.conn for a in self.assims]:
            try:
                if conn is not None:
                    conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.time() + 5
        for p in [s.proc for s in self.slots] + [a.proc for a in self.assims]:
            if p is None:
                continue
            p.join(timeout=max(0.1, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2)

    # ---- JobSystem ------------------------------------------------------------------------
    def submit(self, wu: Workunit, limits: RetryLimits) -> None:
        with self.lock:
            u = self.units.get(wu.unit)
            if u is not None and not (u.done or u.cancelled):
                return  # already queued or running: submitting twice must not double it
            self.units[wu.unit] = _Unit(wu, limits, name=wu.unit)
            self._new_instance(wu.unit)
        self._wake()

    def cancel(self, unit: str) -> None:
        with self.lock:
            u = self.units.get(unit)
            if u is None:
                return
            u.cancelled = True
            self.regen_pending.discard(unit)
            self._drop_unsent(u)

    # ---- internals ------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or stopping

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the dispatcher must survive anything
                log.exception("local backend dispatcher error")
                time.sleep(0.2)

    def _tick(self) -> None:
        with self.lock:
            conns: list[Any] = [s.conn for s in self.slots if s.conn is not None]
            conns += [a.conn for a in self.assims if a.conn is not None]
        ready = wait_conns([*conns, self._wake_r], timeout=0.05)
        if self._wake_r in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        with self.lock:
            for s in self.slots:
                if s.conn in ready:
                    self._drain_slot(s)
            for a in self.assims:
                if a.conn in ready:
                    self._drain_assimilator(a)
            now = time.time()
            self._check_assimilators()
            self._check_slots(now)
            self._check_deadlines(now)
            self._check_regen(now)
            self._dispatch(now)

    def _drain(self, child: _Slot | _Assimilator, handle: Callable[[tuple], None]) -> None:
        """Handle every message waiting on a child's pipe. A broken pipe clears
        ``child.conn``: the child is dead and the supervisor respawns it."""
        conn = child.conn
        while conn is not None and child.conn is conn:
            try:
                if not conn.poll():
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                conn.close()
                child.conn = None
                return
            handle(msg)

    def _dispatch(self, now: float) -> None:
        if self.server_fault is not None:
            return  # paused: the disk under the run directory failed
        for slot in self.slots:
            if not self.unsent:
                return
            if not slot.ready or slot.busy is not None or slot.resume is not None or slot.conn is None:
                continue
            name = self._next_for(slot.host)
            if name is None:
                continue
            inst = self.instances[name]
            u = self.units[inst.unit]
            self.host_data[slot.host].add(u.wu.files.get(DATA, ""))
            try:
                slot.conn.send(("run", name, u.wu.files))
            except (OSError, ValueError):
                self.unsent.appendleft(name)
                continue
            inst.state, inst.slot, inst.sent_at = "in_progress", (slot.host, slot.index), now
            inst.deadline = now + u.limits.delay_bound_s
            slot.busy, slot.busy_since = name, now
            self.counters["sent"] += 1
            if u.lost_at is not None:
                for d in reversed(self.reissue_delays):
                    if d["unit"] == u.wu.unit and "dispatch_s" not in d:
                        d["dispatch_s"] = now - u.lost_at
                        break
                u.lost_at = None
            first = len(u.instances) == 1
            if self.preempt_prob and (first or self.preempt_reissued) and self.rng.random() < self.preempt_prob:
                # Kill mid-unit: at 10-90% of a short unit's time (the 10th percentile of
                # recent ones), so that the kill lands before almost every unit ends.
                recent = sorted(self.unit_times[-50:])
                est = recent[len(recent) // 10] if recent else 1.0
                slot.kill_at = now + self.rng.uniform(0.1, 0.9) * est

    def _next_for(self, host: int) -> str | None:
        """The oldest unsent instance this host may run (units with a host hint only go to
        hosts that cache their data, as MOP's partition placement requires)."""
        for name in self.unsent:
            hosts = self.units[self.instances[name].unit].wu.hosts
            if hosts is None or host in hosts:
                self.unsent.remove(name)
                return name
        return None

    def data_bytes_per_host(self) -> dict[int, int]:
        """Bytes of distinct training-data files each host has been sent (its cache)."""
        return {h: sum(Path(f).stat().st_size for f in files if f and Path(f).exists())
                for h, files in self.host_data.items()}

    # ---- reporting ------------------------------------------------------------------------
    def reissue_summary(self) -> dict[str, Any]:
        """Median/mean time from loss to re-issue and to dispatch, per way of losing a unit."""
        with self.lock:
            out: dict[str, Any] = {}
            for via in sorted({d["via"] for d in self.reissue_delays}):
                rows = [d for d in self.reissue_delays if d["via"] == via]
                for key in ("reissue_s", "dispatch_s"):
                    xs = [d[key] for d in rows if key in d]
                    if xs:
                        out[f"{via}_{key}_median"] = statistics.median(xs)
                        out[f"{via}_{key}_mean"] = statistics.fmean(xs)
                out[f"{via}_n"] = len(rows)
            return out

    def snapshot(self) -> dict[str, Any]:
        """Counters and current queue state, for progress displays and benchmarks."""
        with self.lock:
            running = sum(1 for s in self.slots if s.busy)
            return {**self.counters, "unsent": len(self.unsent), "running": running,
                    "slots": len(self.slots), "slot_busy_s": self.slot_busy_s
                    + sum(time.time() - s.busy_since for s in self.slots if s.busy),
                    "elapsed_s": time.time() - self.started_at if self.started_at else 0.0,
                    "pending_assimilation": sum(len(a.pending) for a in self.assims),
                    "kill_offset_mean_s": statistics.fmean(self.kill_offsets) if self.kill_offsets else None,
                    "slot_downtime_median_s": statistics.median(self.slot_downtimes) if self.slot_downtimes
                    else None,
                    **self.reissue_summary()}
