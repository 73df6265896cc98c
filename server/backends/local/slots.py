"""Slot processes of the local backend: one child per (host, slot), running units for real."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.workunit import (
    METRICS,
    OUTPUT_NAMES,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    WU_JSON,
    Workunit,
)

log = logging.getLogger(__name__)

#: Slot metrics worth adding up across units (restarts within a unit, work redone).
_EXTRA_KEYS = ("batches", "redone_batches", "restarts", "resumed_at_batch")
# A process that dies this soon after its start, before it said "ready", is failing to
# start: after _FAST_DEATHS_FREE such deaths in a row its respawns back off.
_FAST_DEATH_S = 10.0
_FAST_DEATHS_FREE = 3
#: Signals by which BOINC's client takes an app as killed from outside (a user, an
#: out-of-memory killer, a shutdown), not as failed: it restarts the task from its
#: checkpoint (client/app_control.cpp). Any other death is a computation error,
#: reported at once, and the server issues another instance.
_EXTERNAL_KILLS = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGKILL, signal.SIGTERM,
                             signal.SIGSTOP})
#: Restarts in place of one instance before its deaths count as an error (BOINC's client
#: never stops restarting one killed so; a slot killed over and over by the kernel's
#: out-of-memory killer would then hold its unit for ever).
_APP_RESTARTS = 3



def _respawn_delay(fast_deaths: int) -> float:
    return 0.0 if fast_deaths < _FAST_DEATHS_FREE else min(30.0, 0.5 * 2 ** (fast_deaths - _FAST_DEATHS_FREE))


# ---- processes ----------------------------------------------------------------------------

def settled_exit(proc: Any) -> int | None:
    """The exit code of a child the job system sees as dead, once it is really gone.

    A fork server that dies first reports every child of its own as exited with 255 (it
    can no longer tell), while the child may go on running, orphaned: such a child is
    SIGKILLed here, and its exit given as that kill (a death from outside)."""
    code = proc.exitcode
    if code != 255 or proc.pid is None:
        return code
    try:  # still a fork-server child (its command line), not a pid reused by another program
        alive = b"multiprocessing.forkserver" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    except OSError:
        alive = False
    if not alive:
        return code  # it did exit with 255
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except OSError:
        return code
    return -signal.SIGKILL


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

    from boinc_dl.server.common.weights import WeightsFile, read_weights, write_weights

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


def _exit_with(owner: int) -> None:
    """Exit this child as soon as process ``owner`` (the job system's) is gone.

    A slot or assimilator notices a dead parent on its pipe only between units; when
    the run is SIGKILLed mid-unit it would go on training (and keep the fork server
    alive) for the rest of the unit. A watchdog thread waits on the owner's pidfd
    (Linux), else polls it, and ends the process at once: nobody is left to report to.
    """
    def watch() -> None:
        try:
            fd = os.pidfd_open(owner)
        except (AttributeError, OSError):
            fd = None
        while True:
            if fd is not None:
                if wait_conns([fd], timeout=None):
                    os._exit(0)
            else:
                try:
                    os.kill(owner, 0)
                except ProcessLookupError:
                    os._exit(0)
                except PermissionError:
                    pass
                time.sleep(0.5)

    threading.Thread(target=watch, name="bdl-owner-watch", daemon=True).start()


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


def _slot_main(host: int, slot: int, conn: Any, base: str, threads: int, synthetic_s: float | None,
               owner: int) -> None:
    """A simulated host slot: run units in-process, one at a time, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the run, not each slot
    _exit_with(owner)
    os.environ["BDL_THREADS"] = str(threads)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cache: Any = None
    if synthetic_s is None:
        from boinc_dl.client_app.train import ModelCache

        cache = ModelCache(max_models=64)  # MOP models hop across slots: keep their traced steps
    slot_dir, notice_file = _slot_paths(Path(base), host, slot)
    marker = slot_dir / ".bdl-instance"
    upload = Path(base) / "upload"
    conn.send(("ready", os.getpid()))
    for msg in _inbox(conn):
        _, result_name, files = msg
        t0 = time.time()
        try:
            status, err, paths, extras = _run_one(slot_dir, marker, upload, result_name, files, notice_file,
                                                  cache, threads, synthetic_s)
        except OSError as e:
            # The slot's directory and the upload area are the server's disk (this stands
            # in for a host, but writes where the server does): a full disk is not the unit's.
            fault = diskfaults.server_fault(e)
            if fault is None:
                raise
            status, err, paths = "server_fault", fault[0], []
            extras = {"fault_path": diskfaults.fault_path(e, slot_dir), "fault_errno": fault[1]}
        conn.send(("done", result_name, status, err, paths, time.time() - t0, extras))


def _run_one(slot_dir: Path, marker: Path, upload: Path, result_name: str, files: dict[str, str],
             notice_file: Path, cache: Any, threads: int, synthetic_s: float | None
             ) -> tuple[str, str, list[str], dict[str, Any]]:
    """Run one instance in the slot: (status, error, uploaded paths, extras).

    ``status`` is ``ok``, ``interrupted``, ``error`` (a client error) or
    ``server_fault`` (the disk under the run directory failed: not the unit's fault)."""
    from boinc_dl.client_app.preemption import start_watcher

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
            from boinc_dl.client_app.train import run_unit

            res = run_unit(slot_dir, cache=cache, threads=threads, should_stop=stop.is_set)
            status = "ok" if res.status == "done" else "interrupted" if res.interrupted else str(res.status)
            extras = {k: res.metrics[k] for k in _EXTRA_KEYS if k in res.metrics}
    except Exception as e:  # noqa: BLE001 - a failing unit is a client error, not a crash
        fault = diskfaults.server_fault(e)
        if fault is not None:
            return "server_fault", fault[0], [], {"fault_path": diskfaults.fault_path(e, slot_dir),
                                                   "fault_errno": fault[1]}
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
    return status, err, paths, extras




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
    last_exit: int | None = None  # exit code of its last death
    respawn_at: float = 0.0
    started: bool = False  # said "ready" since its last spawn (a death is not a failed start)
    down_since: float | None = None  # host lost (kill or notice) until its replacement is ready



class SlotPool:
    """LocalJobSystem's slot side: spawn, drain and restart the slot processes.

    A mixin of :class:`~boinc_dl.server.backends.local.jobsystem.LocalJobSystem`, whose
    ``__init__`` sets the state it uses."""

    def start_failure(self) -> str | None:
        """Why no slot can start, when every slot has died at start (before saying it was
        ready) ``_FAST_DEATHS_FREE`` times in a row; None while any slot starts or may.
        Respawning keeps them coming back from a passing fault (memory, a busy disk);
        a run whose every slot dies so before anything merged cannot train at all."""
        slots: list[_Slot] = self.slots  # type: ignore[attr-defined]
        if not slots or any(s.started or s.fast_deaths < _FAST_DEATHS_FREE for s in slots):
            return None
        codes = sorted({str(s.last_exit) for s in slots})
        return (f"every slot died at start, {min(s.fast_deaths for s in slots)} times in a row or more "
                f"(exit {', '.join(codes)})")

    def _spawn(self, slot: _Slot) -> None:
        _, notice_file = _slot_paths(self.base, slot.host, slot.index)
        notice_file.unlink(missing_ok=True)  # a new host has had no notice
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_slot_main,
                             args=(slot.host, slot.index, child, str(self.base), self.threads,
                                   self._synthetic_for(slot.host), os.getpid()),
                             name=f"bdl-host{slot.host}-slot{slot.index}", daemon=True)
        p.start()
        child.close()
        slot.proc, slot.conn, slot.ready, slot.kill_at, slot.notice_at = p, parent, False, None, None
        slot.started = False
        if slot.resume is None:
            slot.busy = None
        slot.spawned_at = time.time()

    def _synthetic_for(self, host: int) -> float | None:
        """Host ``host``'s synthetic unit time: one for all hosts, or one per host."""
        s = self.synthetic_unit_s
        return float(s[host]) if isinstance(s, (list, tuple)) else s

    def busy_slots(self) -> list[tuple[int, int, str]]:
        """(host, slot, instance) of every slot running an instance."""
        with self.lock:
            return [(s.host, s.index, s.busy) for s in self.slots if s.busy and s.ready]

    def slot_dir(self, host: int, slot: int) -> Path:
        return _slot_paths(self.base, host, slot)[0]

    def _slot(self, host: int, index: int) -> _Slot:
        return self.slots[host * self.n_slots + index]

    def _drain_slot(self, slot: _Slot) -> None:
        self._drain(slot, lambda msg: self._on_slot_message(slot, msg))

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
        if status == "server_fault":
            self._server_fault(inst, extras.get("fault_path", str(self.base)), err, extras.get("fault_errno"))
            return
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
            self._log_failure(inst.unit, f"client error: {err or status}")
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

    def _kill_slot(self, slot: _Slot) -> None:
        """SIGKILL a slot's process; it takes no new work until its respawn is ready."""
        slot.ready = False
        if slot.proc is not None:
            slot.proc.kill()

    def _slot_died(self, slot: _Slot, now: float) -> None:
        if slot.conn is not None:
            self._drain_slot(slot)
        if slot.proc.is_alive():
            self._kill_slot(slot)
        slot.proc.join(timeout=1)
        code = settled_exit(slot.proc)
        lost = slot.busy
        if lost and slot.resume != lost:
            inst = self.instances.get(lost)
            if inst is not None and inst.lost_at is None and inst.state == "in_progress":
                self._app_died(slot, inst, code, now)  # no simulated host loss: its app died
            else:
                self.slot_busy_s += now - slot.busy_since
                self._mark_lost(lost, now)  # a simulated host loss: the deadline tells
                slot.busy = None
        early = not slot.started and now - slot.spawned_at < _FAST_DEATH_S
        slot.fast_deaths = slot.fast_deaths + 1 if early else 0
        slot.last_exit = code
        if slot.fast_deaths >= _FAST_DEATHS_FREE:
            log.error("slot h%d/s%d keeps dying at start (exit %s, %d times): next start in %.1f s",
                      slot.host, slot.index, code, slot.fast_deaths,
                      _respawn_delay(slot.fast_deaths))
        slot.proc, slot.conn, slot.ready = None, None, False
        slot.respawn_at = now + _respawn_delay(slot.fast_deaths)
        self.counters["slot_restarts"] += 1

    def _app_died(self, slot: _Slot, inst: Any, code: int | None, now: float) -> None:
        """A slot's process died mid-unit on a host that lives on, as BOINC's client sees
        an app's death: killed from outside (:data:`_EXTERNAL_KILLS`), the unit restarts in
        the same slot from its checkpoint, with its deadline; otherwise (a crash, an exit
        status) it is a client error, and another instance is issued now. Waiting for the
        deadline, as for a lost host, would hold the unit ``units.timeout_s`` for nothing."""
        how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
        if code is not None and code < 0 and -code in _EXTERNAL_KILLS and inst.app_restarts < _APP_RESTARTS:
            inst.app_restarts += 1
            slot.resume = inst.name
            self.counters["app_restarts"] += 1
            log.warning("slot h%d/s%d: its process was killed (%s) running %s: restarting it there from its "
                        "checkpoint", slot.host, slot.index, how, inst.name)
            return
        self.slot_busy_s += now - slot.busy_since
        slot.busy = None
        self.counters["client_errors"] += 1
        log.warning("slot h%d/s%d: its process died (%s) running %s: a client error, issued again", slot.host,
                    slot.index, how, inst.name)
        self._log_failure(inst.unit, f"client error: the slot's process died ({how})")
        self._instance_failed(inst, "client_error")

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
