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
  unit times under control, for the expected-time benchmark.

No scheduler protocol, accounts or web server: it is not a second BOINC.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from server.backends.base import JobSystem, RetryLimits
from server.common.workunit import (
    DATA,
    METRICS,
    OUTPUT_NAMES,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    WU_JSON,
    Workunit,
)

log = logging.getLogger(__name__)

PREEMPT_MODES = ("vanish", "notice", "restart")
REISSUE_POLICIES = ("same", "fresh")
#: Slot metrics worth adding up across units (restarts within a unit, work redone).
_EXTRA_KEYS = ("batches", "redone_batches", "restarts", "resumed_at_batch")
# Results sent to one assimilator but not yet acknowledged, at most: bounds what a
# slow assimilator can hold in its pipe, so the dispatcher never blocks on a send.
_MAX_IN_PIPE = 32
# A process that dies this soon after its start, before it said "ready", is failing to
# start: after _FAST_DEATHS_FREE such deaths in a row its respawns back off.
_FAST_DEATH_S = 10.0
_FAST_DEATHS_FREE = 3


def _respawn_delay(fast_deaths: int) -> float:
    return 0.0 if fast_deaths < _FAST_DEATHS_FREE else min(30.0, 0.5 * 2 ** (fast_deaths - _FAST_DEATHS_FREE))


# ---- processes ----------------------------------------------------------------------------

def _slot_paths(base: Path, host: int, slot: int) -> tuple[Path, Path]:
    """(slot directory, notice file) of a simulated host slot."""
    h = base / "hosts" / f"h{host:02d}"
    return h / f"slot{slot}", h / f"notice-s{slot}"


def _synthetic_unit(slot_dir: Path, seconds: float, should_stop: Callable[[], bool]) -> tuple[str, dict]:
    """Sleep ``seconds`` (polling ``should_stop``), then write a valid result.

    The result is the input weights plus a small step seeded by the unit, so merges
    change the server weights as real ones do; everything but TensorFlow runs.
    """
    import numpy as np

    from server.common.weights import WeightsFile, read_weights, write_weights

    t0 = time.monotonic()
    wu = Workunit.load(slot_dir / WU_JSON)
    wf = read_weights(slot_dir / WEIGHTS_IN)
    end = t0 + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        if should_stop():
            return "interrupted", {}
        time.sleep(min(0.01, left))
    step = np.random.default_rng(wu.seed).standard_normal(wf.flat.size).astype(np.float32)
    flat = wf.flat + np.float32(1e-3) * step
    metrics = {"job": wu.job, "unit": wu.unit, "model": wu.model, "epoch": wu.epoch, "shard": wu.shard,
               "base_version": wu.weights_version, "synthetic": True, "train_s": seconds,
               "wall_s": time.monotonic() - t0}
    write_weights(slot_dir / WEIGHTS_OUT, WeightsFile(flat, wf.fingerprint, job=wu.job, model=wu.model,
                                                      unit=wu.unit, base_version=wu.weights_version,
                                                      metrics=metrics))
    (slot_dir / METRICS).write_text(json.dumps(metrics))
    return "ok", {}


def _inbox(conn: Any) -> Iterator[Any]:
    """Messages from the parent until it sends None or the pipe closes (parent gone)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        yield msg


def _slot_main(host: int, slot: int, conn: Any, base: str, threads: int, synthetic_s: float | None) -> None:
    """A simulated host slot: run units in-process, one at a time, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the run, not each slot
    os.environ["BDL_THREADS"] = str(threads)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from client_app.preemption import start_watcher

    cache: Any = None
    if synthetic_s is None:
        from client_app.train import ModelCache, run_unit

        cache = ModelCache(max_models=64)  # MOP models hop across slots: keep their traced steps
    slot_dir, notice_file = _slot_paths(Path(base), host, slot)
    marker = slot_dir / ".bdl-instance"
    upload = Path(base) / "upload"
    conn.send(("ready", os.getpid()))
    for msg in _inbox(conn):
        _, result_name, files = msg
        t0 = time.time()
        # The same instance sent again after a restart in place keeps its directory
        # (and its checkpoint), as a BOINC client keeps a task's slot across reboots.
        if not (marker.exists() and marker.read_text() == result_name):
            shutil.rmtree(slot_dir, ignore_errors=True)
            slot_dir.mkdir(parents=True)
            for logical, physical in files.items():
                os.symlink(physical, slot_dir / logical)
            marker.write_text(result_name)
        stop = threading.Event()
        watcher = start_watcher(lambda _reason, stop=stop: stop.set(), provider="none",
                                notice_file=notice_file, interval=0.02)
        err, extras = "", {}
        try:
            if synthetic_s is not None:
                status, extras = _synthetic_unit(slot_dir, synthetic_s, stop.is_set)
            else:
                res = run_unit(slot_dir, cache=cache, threads=threads, should_stop=stop.is_set)
                status = "ok" if res.status == "done" else "interrupted" if res.interrupted else str(res.status)
                extras = {k: res.metrics[k] for k in _EXTRA_KEYS if k in res.metrics}
        except Exception as e:  # noqa: BLE001 - a failing unit is a client error, not a crash
            status, err = "error", f"{type(e).__name__}: {e}"
        finally:
            if watcher is not None:
                watcher.stop()
        paths: list[str] = []
        if status == "ok":
            dest = upload / result_name
            dest.mkdir(parents=True, exist_ok=True)
            for name in OUTPUT_NAMES:
                src = slot_dir / name
                if src.exists():
                    shutil.move(str(src), dest / name)
                    paths.append(str(dest / name))
        conn.send(("done", result_name, status, err, paths, time.time() - t0, extras))


def assimilate_guarded(store: Any, spec: Any, kind: str, result: str, unit: str, payload: Any) -> Any:
    """The parameter server's handling of one message; raises only ``StoreUnavailable``.

    ``kind`` is ``result`` (``payload``: the result's file paths), ``error`` (the unit
    failed for good; ``payload``: the reason) or ``quarantine`` (a result that killed
    assimilators before; ``payload``: the reason). Anything unexpected a result
    provokes — a bug, a reader error no check foresaw — becomes a rejection with its
    reason recorded, never a dead daemon.
    """
    from server.assimilator.core import AssimilationOutcome, assimilate_error, assimilate_files
    from server.common.errors import StoreUnavailable

    try:
        if kind == "quarantine":
            store.record_rejection(unit, result, payload)
            return AssimilationOutcome("rejected", unit, reason=payload)
        if kind == "error":
            return assimilate_error(store, unit, payload)
        if unit and store.is_assimilated(unit):
            # A re-sent or late result of a merged unit: a duplicate, without re-reading it.
            return AssimilationOutcome("duplicate", unit)
        # The unit is the backend's own record of what the slot ran, never the file's.
        return assimilate_files(store, payload, spec, result, unit=unit)
    except StoreUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - no input may kill the parameter server
        log.exception("assimilator: unexpected error on %s", result or unit)
        reason = f"assimilator error: {type(e).__name__}: {e}"
        try:
            store.record_rejection(unit, result, reason)
        except Exception:  # noqa: BLE001 - recording is best effort here
            pass
        return AssimilationOutcome("rejected", unit, reason=reason)


def _assimilator_main(index: int, conn: Any, redis_url: str, job: str) -> None:
    """One parameter-server process: validate + merge each result it is handed, then ack."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from server.common.errors import StoreUnavailable
    from server.common.spec import spec_from_json
    from server.common.store import JobStore, connect

    store: JobStore | None = None
    spec = None
    crash_after: int | None = None
    poison: set[str] = set()  # fault injection: units whose results kill this process
    conn.send(("ready", os.getpid()))
    for msg in _inbox(conn):
        if msg[0] == "arm":
            crash_after = int(msg[1])
            continue
        if msg[0] == "poison":
            poison.add(msg[1])
            continue
        kind, seq, result, unit, payload = msg
        if unit in poison and kind == "result":
            os.kill(os.getpid(), signal.SIGKILL)  # as a reader crashing on a malformed file would
        delay = 0.2
        while True:
            try:
                if store is None:
                    store = JobStore(connect(redis_url, timeout=2.0), job)
                if spec is None:
                    try:
                        spec = spec_from_json(store.spec_json())
                    except StoreUnavailable:
                        raise
                    except Exception:  # noqa: BLE001 - job gone or spec unreadable: each
                        spec = None    # result is then rejected with that reason below
                out = assimilate_guarded(store, spec, kind, result, unit, payload)
                break
            except StoreUnavailable as e:
                # Transient: BOINC would re-run the assimilator later. Keep the result, retry.
                log.warning("assimilator %d: %s; retrying", index, e)
                store = None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if out.status == "merged" and crash_after is not None:
            crash_after -= 1
            if crash_after <= 0:
                # Fault injection: the merge is committed, the acknowledgement never sent.
                os.kill(os.getpid(), signal.SIGKILL)
        conn.send(("ack", seq, result, unit or out.unit, out.status, out.reason))


# ---- bookkeeping --------------------------------------------------------------------------

@dataclass
class _Instance:
    name: str
    unit: str
    state: str = "unsent"  # unsent | in_progress | over
    slot: tuple[int, int] | None = None
    sent_at: float = 0.0
    deadline: float = 0.0
    outcome: str = ""  # success | no_reply | client_error | invalid | lost | cancelled
    lost_at: float | None = None  # when its host was reclaimed (kill or notice), if known


@dataclass
class _Unit:
    wu: Workunit
    limits: RetryLimits
    name: str = ""  # the current workunit name: the unit, or <unit>_r<n> once regenerated
    attempt: int = 0
    instances: list[str] = field(default_factory=list)
    errors: int = 0
    done: bool = False
    cancelled: bool = False
    regen_since: float | None = None  # waiting for the generator to regenerate it
    lost_at: float | None = None  # loss not yet followed by a dispatch (latency metric)
    lost_via: str = ""


@dataclass
class _Slot:
    host: int
    index: int
    proc: Any = None
    conn: Any = None
    ready: bool = False
    busy: str | None = None  # instance name
    busy_since: float = 0.0
    kill_at: float | None = None
    spawned_at: float = 0.0
    notice_at: float | None = None  # notice written, client not yet reported
    resume: str | None = None  # instance to re-send after a restart in place
    fast_deaths: int = 0
    respawn_at: float = 0.0
    started: bool = False  # said "ready" since its last spawn (a death is not a failed start)
    down_since: float | None = None  # host lost (kill or notice) until its replacement is ready


@dataclass
class _Assimilator:
    index: int
    proc: Any = None
    conn: Any = None
    pending: dict[int, tuple] = field(default_factory=dict)  # seq -> message, until acknowledged
    queue: deque[int] = field(default_factory=deque)  # seqs not yet written to the pipe
    in_pipe: int = 0
    ready: bool = False
    spawned_at: float = 0.0
    fast_deaths: int = 0
    respawn_at: float = 0.0
    head_deaths: dict[int, int] = field(default_factory=dict)  # seq -> deaths while it was first


class LocalJobSystem(JobSystem):
    """N hosts x T slots and P assimilators on this machine (see module docstring)."""

    def __init__(self, base_dir: Path, redis_url: str, job: str, workers: int = 4, slots: int = 2,
                 assimilators: int = 2, threads_per_slot: int = 1, preempt_prob: float = 0.0,
                 notice: bool = False, seed: int = 0, *, preempt_mode: str | None = None,
                 preempt_reissued: bool = True, notice_grace_s: float = 10.0, regen_grace_s: float = 5.0,
                 reissue: str = "same", synthetic_unit_s: float | None = None, poison_after: int = 3):
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
        self.synthetic_unit_s = synthetic_unit_s
        self.poison_after = poison_after
        self.capacity = workers * slots
        self.rng = random.Random(seed)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["client_app.train", "tensorflow", "h5py", "numpy"])
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
            "quarantined")}
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
        self.unit_times: list[float] = []
        self.host_data: dict[int, set[str]] = {h: set() for h in range(workers)}
        self.slot_busy_s = 0.0
        self.started_at = 0.0
        self.log_file = self.base / "local-backend.log"

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        (self.base / "upload").mkdir(parents=True, exist_ok=True)
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

    def _spawn(self, slot: _Slot) -> None:
        _, notice_file = _slot_paths(self.base, slot.host, slot.index)
        notice_file.unlink(missing_ok=True)  # a new host has had no notice
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_slot_main,
                             args=(slot.host, slot.index, child, str(self.base), self.threads,
                                   self.synthetic_unit_s),
                             name=f"bdl-host{slot.host}-slot{slot.index}", daemon=True)
        p.start()
        child.close()
        slot.proc, slot.conn, slot.ready, slot.kill_at, slot.notice_at = p, parent, False, None, None
        slot.started = False
        if slot.resume is None:
            slot.busy = None
        slot.spawned_at = time.time()

    def _spawn_assimilator(self, a: _Assimilator) -> None:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_assimilator_main, args=(a.index, child, self.redis_url, self.job),
                             name=f"bdl-assimilator-{a.index}", daemon=True)
        p.start()
        child.close()
        a.proc, a.conn, a.in_pipe, a.ready, a.spawned_at = p, parent, 0, False, time.time()
        for unit in sorted(self.poisoned):
            parent.send(("poison", unit))

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

    # ---- re-issue policy ------------------------------------------------------------------
    def set_reissue_policy(self, policy: str) -> None:
        """``same`` (BOINC's: re-issue the inputs) or ``fresh`` (regenerate, see module doc)."""
        if policy not in REISSUE_POLICIES:
            raise ValueError(f"re-issue policy must be one of {REISSUE_POLICIES}, got {policy!r}")
        self.reissue_policy = policy

    def regeneration_requests(self, job: str | None = None) -> list[tuple[str, int]]:
        """Units waiting to be regenerated with fresh weights: (unit, attempts so far).

        The local job system runs one job, so ``job`` (asked for by multi-job
        systems such as BOINC's) changes nothing."""
        with self.lock:
            return [(n, self.units[n].attempt) for n in sorted(self.regen_pending)]

    def resubmit_regenerated(self, unit: str, wu: Workunit, name: str) -> bool:
        """Issue the regenerated ``wu`` (named ``name``) for ``unit``.

        False if the unit no longer waits for it (merged by a late result, given up,
        cancelled, or already re-issued with its old inputs after ``regen_grace_s``).
        """
        with self.lock:
            u = self.units.get(unit)
            if u is None or unit not in self.regen_pending or u.done or u.cancelled:
                return False
            self.regen_pending.discard(unit)
            u.wu, u.name, u.regen_since = wu, name, None
            u.attempt += 1
            self.counters["regenerated"] += 1
            self._reissue(u, time.time())
        self._wake()
        return True

    # ---- fault injection (tests and benchmarks) ---------------------------------------------
    def assimilator_pids(self) -> list[int | None]:
        with self.lock:
            return [a.proc.pid if a.proc is not None else None for a in self.assims]

    def kill_assimilator(self, index: int) -> int | None:
        """SIGKILL assimilator ``index`` (it is restarted and its pending results re-sent)."""
        with self.lock:
            a = self.assims[index]
            pid = a.proc.pid if a.proc is not None and a.proc.is_alive() else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return pid

    def arm_assimilator_crash(self, index: int, after_merges: int = 1) -> None:
        """Make assimilator ``index`` SIGKILL itself right after its next ``after_merges``-th
        committed merge, before acknowledging it (the crash window of at-least-once)."""
        with self.lock:
            a = self.assims[index]
            if a.conn is None:
                raise RuntimeError(f"assimilator {index} is not running")
            a.conn.send(("arm", after_merges))

    def poison_unit(self, unit: str) -> None:
        """Make every result of ``unit`` SIGKILL the assimilator handed it, in every
        incarnation (a result that crashes a native reader): it must end quarantined."""
        with self.lock:
            self.poisoned.add(unit)
            for a in self.assims:
                if a.conn is not None:
                    a.conn.send(("poison", unit))

    def busy_slots(self) -> list[tuple[int, int, str]]:
        """(host, slot, instance) of every slot running an instance."""
        with self.lock:
            return [(s.host, s.index, s.busy) for s in self.slots if s.busy and s.ready]

    def slot_dir(self, host: int, slot: int) -> Path:
        return _slot_paths(self.base, host, slot)[0]

    def crash_slot(self, host: int, slot: int, restart: bool = False) -> None:
        """SIGKILL a slot process; with ``restart`` it comes back in place and resumes its unit."""
        with self.lock:
            s = self._slot(host, slot)
            if restart and s.busy:
                s.resume = s.busy
                self.counters["restarted_in_slot"] += 1
            elif s.busy:
                self._mark_lost(s.busy, time.time())
            self._kill_slot(s)

    def notify_preemption(self, host: int, slot: int) -> None:
        """Give host ``host``'s slot a preemption notice now (the notice path)."""
        with self.lock:
            self._notice(self._slot(host, slot), time.time())

    # ---- internals ------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or stopping

    def _new_instance(self, unit: str) -> None:
        u = self.units[unit]
        name = f"{u.name}_{len(u.instances)}"
        u.instances.append(name)
        self.instances[name] = _Instance(name, unit)
        self.unsent.append(name)

    def _drop_unsent(self, u: _Unit) -> None:
        for name in u.instances:
            inst = self.instances[name]
            if inst.state == "unsent":
                inst.state, inst.outcome = "over", "cancelled"
                try:
                    self.unsent.remove(name)
                except ValueError:
                    pass

    def _assimilator_for(self, u: _Unit) -> _Assimilator:
        return self.assims[u.wu.wu_id % self.n_assim]

    def _deliver(self, a: _Assimilator, kind: str, result: str, unit: str, payload: Any) -> None:
        """Queue a message for an assimilator; it stays pending until acknowledged."""
        self.seq += 1
        a.pending[self.seq] = (kind, self.seq, result, unit, payload)
        a.queue.append(self.seq)
        self._pump(a)

    def _pump(self, a: _Assimilator) -> None:
        while a.conn is not None and a.queue and a.in_pipe < _MAX_IN_PIPE:
            seq = a.queue[0]
            msg = a.pending.get(seq)
            if msg is not None:
                try:
                    a.conn.send(msg)
                except (OSError, ValueError):
                    return  # dead: _check_assimilators restarts it and re-sends
                a.in_pipe += 1
            a.queue.popleft()

    def _give_up(self, u: _Unit, reason: str) -> None:
        u.done = True
        self.regen_pending.discard(u.wu.unit)
        self.counters["given_up"] += 1
        self._deliver(self._assimilator_for(u), "error", "", u.wu.unit, reason)

    def _instance_failed(self, inst: _Instance, outcome: str) -> None:
        """An instance ended without a usable result: re-issue within the unit's limits."""
        inst.state, inst.outcome = "over", outcome
        u = self.units[inst.unit]
        if u.done or u.cancelled:
            return
        if outcome in ("client_error", "invalid"):
            u.errors += 1  # BOINC: no_reply and aborted-by-user are not errors
        if inst.lost_at is not None and u.lost_at is None:
            u.lost_at, u.lost_via = inst.lost_at, outcome
        live = [n for n in u.instances if self.instances[n].state != "over"]
        if live or u.regen_since is not None:
            return  # another instance is still running or queued
        if u.errors >= u.limits.max_error_results:
            self._give_up(u, f"too many errors ({u.errors}; last: {outcome})")
        elif len(u.instances) >= u.limits.max_total_results:
            self._give_up(u, f"too many total results ({len(u.instances)})")
        elif self.reissue_policy == "fresh" and outcome in ("no_reply", "lost"):
            u.regen_since = time.time()
            self.regen_pending.add(inst.unit)
            self.counters["regen_requested"] += 1
        else:
            self._reissue(u, time.time())

    def _reissue(self, u: _Unit, now: float) -> None:
        self.counters["reissued"] += 1
        if u.lost_at is not None:
            self.reissue_delays.append({"unit": u.wu.unit, "via": u.lost_via, "reissue_s": now - u.lost_at})
        self._new_instance(u.wu.unit)

    def _mark_lost(self, name: str, now: float) -> None:
        inst = self.instances.get(name)
        if inst is not None and inst.lost_at is None:
            inst.lost_at = now

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

    def _slot(self, host: int, index: int) -> _Slot:
        return self.slots[host * self.n_slots + index]

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

    def _drain_slot(self, slot: _Slot) -> None:
        self._drain(slot, lambda msg: self._on_slot_message(slot, msg))

    def _drain_assimilator(self, a: _Assimilator) -> None:
        self._drain(a, lambda msg: self._on_assimilator_message(a, msg))

    def _on_assimilator_message(self, a: _Assimilator, msg: tuple) -> None:
        if msg[0] == "ready":
            a.ready, a.fast_deaths = True, 0
            return
        _, seq, result, unit, status, reason = msg
        a.head_deaths.pop(seq, None)
        sent = a.pending.pop(seq, None)
        a.in_pipe = max(0, a.in_pipe - 1)
        self._on_outcome(result, unit, status, reason, sent)
        self._pump(a)

    def _on_slot_message(self, slot: _Slot, msg: tuple) -> None:
        if msg[0] == "ready":
            if slot.proc is not None and msg[1] == slot.proc.pid:
                slot.ready, slot.started, slot.fast_deaths = True, True, 0
                if slot.down_since is not None:
                    self.slot_downtimes.append(time.time() - slot.down_since)
                    slot.down_since = None
                if slot.resume:
                    self._send_resume(slot)
            return
        _, result, status, err, paths, wall, extras = msg
        inst = self.instances.get(result)
        now = time.time()
        noticed = slot.notice_at is not None
        if slot.busy == result:
            self.slot_busy_s += now - slot.busy_since
            slot.busy, slot.kill_at, slot.resume = None, None, None
        if noticed and status != "interrupted":
            # Finished before it noticed: the result is good, but the host goes all the same.
            slot.notice_at = None
            self._kill_slot(slot)
        if inst is None:
            return
        u = self.units[inst.unit]
        if status == "interrupted" and noticed:
            # The client checkpointed and reported the unit lost (BOINC: task aborted,
            # scheduler contacted): re-issue now, then the host goes away for good.
            self.counters["lost_reported"] += 1
            if inst.state == "in_progress":
                self._instance_failed(inst, "lost")
            slot.notice_at = None
            self._kill_slot(slot)
            return
        self.counters["returned"] += 1
        for k in ("redone_batches",):
            self.counters[k] += int(extras.get(k) or 0)
        self.counters["batches_done"] += int(extras.get("batches") or 0)
        if extras.get("restarts"):
            self.restart_log.append({"result": result, "status": status, "wall_s": wall, **extras})
        else:
            self.unit_times.append(wall)
        late = inst.outcome == "no_reply"
        if late:
            self.counters["late_results"] += 1
        if status != "ok" or not paths:
            self.counters["client_errors"] += 1
            log.warning("result %s: client error %s", result, err or status)
            if not late and inst.state == "in_progress":
                self._instance_failed(inst, "client_error")
            return
        if u.cancelled:
            inst.state, inst.outcome = "over", "cancelled"
            shutil.rmtree(Path(paths[0]).parent, ignore_errors=True)
            return
        if inst.state != "over":
            inst.state, inst.outcome = "over", "success"
        # Late results go to the assimilator too (BOINC accepts them): it must not double-merge.
        self._deliver(self._assimilator_for(u), "result", result, inst.unit, paths)

    def _on_outcome(self, result: str, unit: str, status: str, reason: str, sent: tuple | None) -> None:
        if status == "merged":
            self.counters["merged"] += 1
        elif status == "duplicate":
            self.counters["duplicates"] += 1
        if status in ("merged", "duplicate") and sent is not None and sent[0] == "result" and sent[4]:
            # The file deleter's job, after the acknowledgement: never before it, or a
            # re-sent result would find its files gone.
            shutil.rmtree(Path(sent[4][0]).parent, ignore_errors=True)
        u = self.units.get(unit)
        if u is None:
            return
        if status in ("merged", "duplicate", "failed"):
            u.done = True
            self.regen_pending.discard(unit)
            self._drop_unsent(u)
        elif status == "rejected" and result:
            self.counters["rejected"] += 1
            inst = self.instances.get(result)
            if inst is not None and not u.done:
                inst.state = "in_progress"  # let _instance_failed account it
                self._instance_failed(inst, "invalid")

    def _check_assimilators(self) -> None:
        now = time.time()
        for a in self.assims:
            if a.proc is not None and a.conn is not None and a.proc.is_alive():
                continue
            if a.proc is not None:
                self._assimilator_died(a, now)
            if now >= a.respawn_at:
                self._spawn_assimilator(a)
                a.queue = deque(sorted(a.pending))
                self._pump(a)

    def _assimilator_died(self, a: _Assimilator, now: float) -> None:
        if a.conn is not None:  # read whatever it acknowledged before dying
            self._drain_assimilator(a)
            if a.conn is not None:
                a.conn.close()
        if a.proc.is_alive():  # its pipe broke: it cannot be trusted to carry on
            a.proc.kill()
        a.proc.join(timeout=1)
        exitcode = a.proc.exitcode
        early = not a.ready and now - a.spawned_at < _FAST_DEATH_S
        a.fast_deaths = a.fast_deaths + 1 if early else 0
        a.proc, a.conn, a.ready = None, None, False
        a.respawn_at = now + _respawn_delay(a.fast_deaths)
        self.counters["assimilator_restarts"] += 1
        self.counters["redelivered"] += len(a.pending)
        log.warning("assimilator %d died (exit %s): restarting it, re-sending %d result(s)",
                    a.index, exitcode, len(a.pending))
        if a.fast_deaths >= _FAST_DEATHS_FREE:
            log.error("assimilator %d keeps dying at start (%d times): next start in %.1f s",
                      a.index, a.fast_deaths, a.respawn_at - now)
        if a.pending:
            # The first pending result is the one it was working on: one that keeps
            # killing assimilators is a poison result, to be rejected, not re-sent forever.
            head = next(iter(a.pending))
            a.head_deaths[head] = a.head_deaths.get(head, 0) + 1
            # Only a result file can be poison; a give-up (--error) must get through.
            if a.head_deaths[head] >= self.poison_after and a.pending[head][0] == "result":
                kind, seq, result, unit, _payload = a.pending[head]
                reason = f"result killed the assimilator {a.head_deaths[head]} times in a row"
                a.pending[head] = ("quarantine", seq, result, unit, reason)
                self.counters["quarantined"] += 1
                log.error("result %s of unit %s quarantined: %s", result, unit, reason)

    def _notice(self, slot: _Slot, now: float) -> None:
        if not slot.busy or slot.notice_at is not None:
            return
        _, notice_file = _slot_paths(self.base, slot.host, slot.index)
        notice_file.parent.mkdir(parents=True, exist_ok=True)
        notice_file.write_text("local backend: host reclaimed\n")
        slot.notice_at, slot.kill_at = now, None
        self.counters["notices"] += 1
        self._mark_lost(slot.busy, now)

    def _check_slots(self, now: float) -> None:
        for slot in self.slots:
            if slot.kill_at is not None and now >= slot.kill_at and slot.busy and slot.proc is not None:
                # The spot VM is reclaimed mid-unit, for real.
                self.counters["preempted"] += 1
                self.kill_offsets.append(now - slot.busy_since)
                slot.kill_at, slot.down_since = None, now
                if self.preempt_mode == "notice":
                    self._notice(slot, now)
                elif self.preempt_mode == "restart":
                    slot.resume = slot.busy
                    self.counters["restarted_in_slot"] += 1
                    self._kill_slot(slot)
                else:
                    self._mark_lost(slot.busy, now)
                    self._kill_slot(slot)
            if slot.notice_at is not None and now - slot.notice_at > self.notice_grace_s and slot.proc:
                # The client never reported: the host goes anyway; the deadline will tell.
                self.counters["notice_unreported"] += 1
                slot.notice_at = None
                self._kill_slot(slot)
            if slot.proc is not None and slot.conn is not None and slot.proc.is_alive():
                continue
            if slot.proc is not None:
                self._slot_died(slot, now)
            if now >= slot.respawn_at:
                self._spawn(slot)

    def _kill_slot(self, slot: _Slot) -> None:
        """SIGKILL a slot's process; it takes no new work until its respawn is ready."""
        slot.ready = False
        if slot.proc is not None:
            slot.proc.kill()

    def _slot_died(self, slot: _Slot, now: float) -> None:
        if slot.conn is not None:
            self._drain_slot(slot)
        lost = slot.busy
        if lost and slot.resume != lost:
            self.slot_busy_s += now - slot.busy_since
            self._mark_lost(lost, now)
            slot.busy = None
        if slot.proc.is_alive():
            self._kill_slot(slot)
        slot.proc.join(timeout=1)
        early = not slot.started and now - slot.spawned_at < _FAST_DEATH_S
        slot.fast_deaths = slot.fast_deaths + 1 if early else 0
        if slot.fast_deaths >= _FAST_DEATHS_FREE:
            log.error("slot h%d/s%d keeps dying at start (exit %s, %d times): next start in %.1f s",
                      slot.host, slot.index, slot.proc.exitcode, slot.fast_deaths,
                      _respawn_delay(slot.fast_deaths))
        slot.proc, slot.conn, slot.ready = None, None, False
        slot.respawn_at = now + _respawn_delay(slot.fast_deaths)
        self.counters["slot_restarts"] += 1

    def _send_resume(self, slot: _Slot) -> None:
        name = slot.resume
        inst = self.instances.get(name) if name else None
        if inst is None:
            slot.resume, slot.busy = None, None
            return
        try:
            slot.conn.send(("run", name, self.units[inst.unit].wu.files))
        except (OSError, ValueError):
            return
        slot.busy = name

    def _check_deadlines(self, now: float) -> None:
        for inst in list(self.instances.values()):
            if inst.state == "in_progress" and now > inst.deadline:
                self.counters["timed_out"] += 1
                self._instance_failed(inst, "no_reply")

    def _check_regen(self, now: float) -> None:
        for unit in list(self.regen_pending):
            u = self.units[unit]
            if u.regen_since is not None and now - u.regen_since > self.regen_grace_s:
                # The generator could not regenerate it in time: re-issue the old inputs.
                self.regen_pending.discard(unit)
                u.regen_since = None
                self.counters["regen_fallback"] += 1
                self._reissue(u, now)

    def _dispatch(self, now: float) -> None:
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
