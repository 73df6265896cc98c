"""The work generator daemon: ``boinc-dl boinc work-generator --project DIR``.

Declared in ``config.xml`` (``bin/start`` runs it from ``tmp_<host>`` with its output
in ``log_<host>/bdl_work_generator.log``). Every pass it takes each running job of
this project from Redis (submitted with ``boinc-dl submit --backend boinc``), lets the
job's work generator close finished epochs and create units up to its window through
:class:`~boinc_dl.server.backends.boinc.BoincJobSystem`, then creates the batch with one
``create_work --stdin`` call per job. It behaves like BOINC's own daemons: it exits
when the project's ``stop_daemons`` file appears and on SIGHUP or SIGTERM, and it
survives Redis or create_work failures (logged, retried next pass).

Every pass also cancels the workunits that are no longer needed (their unit merged or
given up, or superseded by a regenerated workunit). A job that ends (done, failed,
cancelled) gets a last sweep: every workunit BOINC may still send is cancelled and the
job's staged input files leave the download hierarchy.

A thread of this process is the held-out loss checker of the jobs it drives
(:mod:`boinc_dl.server.work_generator.losscheck`): the assimilators, fresh processes
without TensorFlow, queue their untrusted results' loss checks in Redis and wait for its
verdicts. It has its own Redis connection and its own Keras model per job.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem, BoincToolError
from boinc_dl.server.backends.boinc.project import BoincProject
from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.errors import BoincDLError, StoreUnavailable
from boinc_dl.server.common.spec import spec_from_json
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.work_generator.settle import cancel_open_units

log = logging.getLogger("boinc-dl.work_generator")

LOG_NAME = "bdl_work_generator.log"


def job_is_ours(meta: dict[str, str], project: BoincProject) -> bool:
    """A job submitted to this project's BOINC backend."""
    return meta.get("backend") == "boinc" and meta.get("boinc_project") == str(project.root)


#: After a job ends, keep sweeping for units created by a pass that raced with the end.
SWEEP_GRACE_S = 600.0
# how often a waiting work generator checks its jobs for a new merge or give-up
WAKE_S = 0.25


def finalize_job(store: JobStore, backend: BoincJobSystem) -> int:
    """A finished job: cancel its units in flight and every workunit BOINC may still
    send (regenerated or superseded ones included), unstage its files (once)."""
    n = cancel_open_units(store, backend)
    n += backend.cancel_all(store.job)
    if store.meta().get("boinc_finalized") != "1":
        removed = backend.unstage_job(store.job)
        store.set_meta(boinc_finalized=1)
        log.info("job %s finished: %d unit(s) cancelled, %d staged file(s) removed", store.job, n, removed)
    elif n:
        log.info("job %s: cancelled %d late unit(s)", store.job, n)
    return n


class WorkGeneratorDaemon:
    """One process driving every BOINC job of a project (see module docstring)."""

    def __init__(self, project: BoincProject, poll_s: float | None = None):
        self.project = project.require()
        self.poll_s = poll_s or project.settings.poll_s
        self.stop = threading.Event()
        self.r: Any = None
        self.backend: BoincJobSystem | None = None
        self.gens: dict[str, Any] = {}
        self._skipped: set[str] = set()
        self._persistence_checked = False
        #: job -> job directory of the running jobs this daemon drives: what the loss
        #: checker serves (replaced whole after each pass; the checker thread reads it).
        self.loss_jobs: dict[str, Path] = {}
        self.loss_checker: Any = None

    # ---- control --------------------------------------------------------------------------
    def install_signals(self) -> None:
        """Exit at once on SIGHUP/SIGTERM/SIGINT.

        BOINC's ``bin/stop`` sends SIGHUP and returns without waiting, and ``bin/start``
        skips a daemon whose lock (held by this process) is still taken, so a restart
        only works if the daemon is gone within the fraction of a second between the
        two. Every step of a pass is crash-safe (Redis transactions; units created in
        BOINC are recorded and re-checked at start; an epoch's evaluation is redone),
        so the handler ends the process instead of finishing the pass, and skips the
        interpreter's slow shutdown (seconds with TensorFlow loaded). A watchdog thread
        woken through the signal wakeup fd does the same when the main thread is busy
        in native code and cannot run the Python handler.
        """
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        threading.Thread(target=self._watchdog, args=(rfd,), name="signal-watchdog", daemon=True).start()

    def _watchdog(self, rfd: int) -> None:
        data = os.read(rfd, 16)
        wanted = {int(signal.SIGHUP), int(signal.SIGTERM), int(signal.SIGINT)}
        while not wanted.intersection(data):
            data = os.read(rfd, 16)
        # give the Python handler a moment (it logs which signal); then leave regardless
        time.sleep(0.2)
        self._exit_now("a stop signal (watchdog)")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop.set()
        self._exit_now(signal.Signals(signum).name)

    @staticmethod
    def _exit_now(why: str) -> None:
        # Written straight to fd 2 (the daemon's log file), not through logging: the
        # watchdog may run while the main thread holds a logging handler's lock.
        # (logging's StreamHandler flushes every record, so nothing is left buffered)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(2, f"{stamp} [INFO] {log.name}: got {why}: exiting now\n".encode())
        os._exit(0)

    def should_stop(self) -> bool:
        if self.project.stop_daemons_file.exists():
            if not self.stop.is_set():
                log.info("quitting: trigger file %s is present", self.project.stop_daemons_file)
            self.stop.set()
        return self.stop.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep, checking the stop conditions every second (like BOINC's daemon_sleep)."""
        end = time.monotonic() + seconds
        while not self.should_stop():
            left = end - time.monotonic()
            if left <= 0:
                return
            self.stop.wait(min(1.0, left))

    def progress(self) -> dict[str, tuple[int, int]]:
        """(units merged, units given up) of every job this daemon drives: what frees a
        VC-ASGD window slot, completes an epoch or moves a MOP model on."""
        return {job: JobStore(self.r, job).progress() for job in list(self.gens)}

    def wait_for_work(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, but return as soon as a merge or a give-up lands in a
        job this daemon drives (checked every ``WAKE_S``); True when woken that way.

        A merge frees a slot of the window and may complete an epoch. Waiting out the
        whole pass interval instead leaves the next units uncreated while the host that
        just reported asks for work, gets "no tasks" and goes quiet until its next
        ``next_rpc_delay`` (docs/boinc.md, "Keeping hosts busy"). The check is one
        pipelined round trip of two ``HLEN`` per job.
        """
        end = time.monotonic() + seconds
        before = self._progress_or_none() if self.gens and self.r is not None else None
        if before is None:
            self.sleep(seconds)
            return False
        while not self.should_stop():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.stop.wait(min(WAKE_S, left))
            now = self._progress_or_none()
            if now is None:  # Redis down: the next pass finds it and backs off
                self.sleep(max(0.0, end - time.monotonic()))
                return False
            if now != before:
                return True
        return False

    def _progress_or_none(self) -> dict[str, tuple[int, int]] | None:
        try:
            return self.progress()
        except StoreUnavailable:
            return None

    # ---- passes ---------------------------------------------------------------------------
    def connect(self) -> None:
        if self.r is None:
            self.r = connect(self.project.redis_url(), timeout=5.0)
            self.backend = BoincJobSystem(self.project, self.r)
            if not self._persistence_checked:
                self._persistence_checked = True
                self.report_persistence()

    def report_persistence(self) -> None:
        """Log, once per process, what in the Redis's persistence settings could lose
        merges (``boinc-dl redis check`` says the same): an admin's own Redis often runs
        without an AOF or with ``everysec``. Never fatal: the daemon works either way."""
        from boinc_dl.server.assimilator.persistence import check_persistence

        try:
            findings = check_persistence(self.r)
        except Exception as e:  # noqa: BLE001 - a diagnostic must not stop the daemon
            log.warning("could not check Redis's persistence settings: %s", e)
            return
        for f in findings:
            (log.info if f.severity == "note" else log.warning)("Redis at %s (%s): %s", f.node, f.severity, f.message)

    def start_loss_checker(self) -> None:
        """Start the loss checker thread (once per process)."""
        if self.loss_checker is not None:
            return
        from boinc_dl.server.work_generator.losscheck import LossChecker

        self.loss_checker = LossChecker(lambda: connect(self.project.redis_url(), timeout=5.0),
                                        lambda: self.loss_jobs, self.stop)
        threading.Thread(target=self.loss_checker.run, name="loss-checker", daemon=True).start()

    def generator(self, store: JobStore, meta: dict[str, str]) -> Any:
        if store.job in self.gens:
            return self.gens[store.job]
        from boinc_dl.server.work_generator.mop_generator import MOPWorkGenerator
        from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator

        spec = spec_from_json(store.spec_json())
        job_dir = Path(meta.get("job_dir") or self.project.job_dir(store.job))
        assert self.backend is not None
        gen: Any
        if spec.mode == "mop":
            # Pull mode: hosts ask BOINC for work, so the scheduler only decides which units
            # may exist (one per model in flight); partitions are sticky files and BOINC's
            # locality scheduling sends units to hosts that already hold them.
            gen = MOPWorkGenerator(store, spec, job_dir, self.backend, availability=None,
                                   search_path=Path(meta["search_path"]) if meta.get("search_path") else None)
        else:
            gen = VCASGDWorkGenerator(store, spec, job_dir, self.backend)
        # Units registered but never created (a crash in between): create them now.
        # Units already in BOINC are skipped by the backend's ledger.
        n = gen.recover(resubmit_in_progress=True)
        if n:
            log.info("job %s: %d unit(s) re-checked after a restart", store.job, n)
        self.gens[store.job] = gen
        log.info("job %s: driving it (%s)", store.job, spec.mode)
        return gen

    def one_pass(self) -> int:
        """Step every job of this project once; how many jobs are still running."""
        self.connect()
        assert self.backend is not None
        running = 0
        serving: dict[str, Path] = {}
        for job in JobStore.list_jobs(self.r):
            if self.should_stop():
                break
            store = JobStore(self.r, job)
            meta = store.meta()
            if not job_is_ours(meta, self.project):
                continue
            status = meta.get("status", "running")
            if status in FINISHED:
                self.gens.pop(job, None)
                try:
                    ended = float(meta.get("finished_at", 0))
                except ValueError:
                    ended = 0.0
                if meta.get("boinc_finalized") != "1" or time.time() - ended < SWEEP_GRACE_S:
                    try:
                        finalize_job(store, self.backend)
                    except BoincToolError as e:
                        log.error("job %s: %s (retrying next pass)", job, e)
                continue
            serving[job] = Path(meta.get("job_dir") or self.project.job_dir(job))
            try:
                gen = self.generator(store, meta)
                alive = gen.step()
                self.backend.flush()
                # workunits of merged, given-up or superseded units: cancelled at once
                self.backend.cancel_stray(job)
                # results the validator could not judge: judged again, before any is thrown away
                self.backend.revalidate_undecided(job)
                self.backend.cancel_stuck(job)  # MOP: a stuck sub-epoch runs again
            except BoincToolError as e:
                log.error("job %s: %s (retrying next pass)", job, e)
                running += 1
                continue
            except StoreUnavailable:
                raise
            except BoincDLError as e:
                log.error("job %s: %s", job, e)
                continue
            except Exception as e:  # noqa: BLE001 - one bad job must not stop the others
                fault = diskfaults.as_server_error(e, self.project.job_dir(job), then="retrying next pass")
                if fault is not None:  # a full disk: one line, nothing charged, the next pass goes on
                    log.error("job %s: %s", job, fault)
                    self.gens.pop(job, None)
                    running += 1
                    continue
                log.exception("job %s: unexpected error (retrying next pass)", job)
                self.gens.pop(job, None)
                running += 1
                continue
            if alive:
                running += 1
                continue
            self.gens.pop(job, None)
            try:
                finalize_job(store, self.backend)
            except BoincToolError as e:
                log.error("job %s: %s (retrying next pass)", job, e)
        self.loss_jobs = serving
        return running

    def run(self, once: bool = False, max_passes: int | None = None) -> int:
        """Loop until stopped; returns the exit status."""
        self.project.redis_url()  # a missing setting is fatal; Redis being down is not
        log.info("work generator for %s started (pass every %.0fs)", self.project.root, self.poll_s)
        if not once:
            self.start_loss_checker()
        passes = 0
        delay = self.poll_s
        while not self.should_stop():
            try:
                self.one_pass()
                delay = self.poll_s
            except StoreUnavailable as e:
                log.error("%s; reconnecting", e)
                self.r = None
                self.gens.clear()
                delay = min(max(delay * 2, 1.0), 60.0)
            except BoincDLError as e:
                log.error("%s", e)
                delay = min(max(delay * 2, 1.0), 60.0)
            passes += 1
            if once or (max_passes is not None and passes >= max_passes):
                break
            if delay == self.poll_s:
                self.wait_for_work(delay)
            else:  # backing off from Redis or a tool: no early wake-up
                self.sleep(delay)
        if self.backend is not None and self.backend.pending():
            try:
                self.backend.flush()
            except BoincDLError as e:
                log.error("could not create queued units before exiting: %s", e)
        log.info("work generator stopped")
        return 0


def setup_logging(project: BoincProject, verbose: bool = False) -> None:
    """Log to stderr (bin/start sends it to log_<host>/); run by hand, also to that file."""
    fmt = logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    root.addHandler(h)
    if sys.stderr.isatty():
        try:
            project.log_dir.mkdir(parents=True, exist_ok=True)
            fh = logging.FileHandler(project.log_dir / LOG_NAME)
            fh.setFormatter(fmt)
            root.addHandler(fh)
        except OSError as e:
            log.warning("cannot log to %s: %s", project.log_dir, e)
