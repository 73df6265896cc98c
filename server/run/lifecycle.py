"""What every ``boinc-dl run`` shares: the run directory, the store, the local backend,
logging, counters and the end-of-run summary."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.backends.local.jobsystem import start_fork_server, stop_fork_server
from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.spec import JobSpec, local_options
from boinc_dl.server.common.spec_defaults import describe
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.run.failfast import FailFastWatch
from boinc_dl.server.run.jobclock import JobClock, recorded_story
from boinc_dl.server.run.signals import RunStopped, raise_if_stopped
from boinc_dl.server.work_generator.prepare import derived_settings, n_shards

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished (or interrupted) run produced."""

    status: str
    run_dir: Path
    epochs: list[dict[str, Any]] = field(default_factory=list)
    backend: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    #: For an interrupted run, the exit code its signal asks for (130 for Ctrl-C).
    exit_code: int = 0
    planner: dict[str, Any] | None = None  # predicted vs actual epoch time (VC-ASGD)
    job: str = ""  # the job's name (``--new`` numbers it)
    #: The job's totals over every run that trained it (:func:`~boinc_dl.server.run.jobclock.job_totals`);
    #: ``backend`` and ``elapsed_s`` are this process's.
    totals: dict[str, Any] = field(default_factory=dict)
    #: MOP: the leaderboard's first row (the configuration ``best_model.keras`` holds).
    best: dict[str, Any] | None = None


def default_run_dir(spec: JobSpec) -> Path:
    return Path("runs") / spec.name


def open_store(run_dir: Path, redis_url: str | None, job: str) -> tuple[EmbeddedRedis | None, str, JobStore]:
    """The job's store: on ``redis_url``, or on a private Redis kept in ``run_dir/redis``."""
    server = None
    if redis_url is None:
        # Supervised: a Redis that dies is restarted on its AOF within a second and the
        # run carries on (clients retry); it dies with this process, whatever kills it.
        server = EmbeddedRedis(run_dir / "redis", die_with_parent=True).start().supervise()
        redis_url = server.url
    return server, redis_url, JobStore(connect(redis_url), job)


def prestart_local_backend(store: JobStore, run_dir: Path, resume: bool) -> None:
    """Start the local backend's fork server before the job is prepared, so that its
    TensorFlow import runs beside the run's own (the initial model): start-up pays for one
    import, not two in a row. Not for a resumed job that is over (no backend starts)."""
    if resumes_finished(store, resume):
        return
    start_fork_server(run_dir)


def end_prestart(backend: LocalJobSystem | None) -> None:
    """At a run's end: a run whose backend never started (its job failed to prepare)
    stops the fork server :func:`prestart_local_backend` started, which may still be
    importing TensorFlow, rather than leave it to outlive the run."""
    if backend is None:
        stop_fork_server()


def start_local_backend(spec: JobSpec, run_dir: Path, redis_url: str,
                        backend_opts: dict[str, Any] | None) -> LocalJobSystem:
    """The local job system the spec asks for (options overridden by ``backend_opts``), started."""
    opts = local_options(spec, backend_opts)
    backend = LocalJobSystem(run_dir, redis_url, spec.name, workers=opts["workers"], slots=opts["slots"],
                             assimilators=opts["assimilators"], threads_per_slot=opts["threads_per_slot"],
                             preempt_prob=opts["preempt_prob"], notice=opts.get("notice", False), seed=spec.seed,
                             synthetic_unit_s=opts.get("synthetic_unit_s"))
    backend.start()
    return backend


class CounterSync:
    """Mirror the job system's fault counters into Redis (status, admin page) as deltas,
    so a resumed run adds to the totals instead of resetting them."""

    KEYS = ("reissued", "timed_out", "preempted", "late_results", "given_up", "client_errors", "slot_restarts")

    def __init__(self, store: JobStore, backend: LocalJobSystem):
        self.store, self.backend = store, backend
        self.pushed = dict.fromkeys(self.KEYS, 0)

    def push(self) -> None:
        snap = self.backend.snapshot()
        for k in self.KEYS:
            delta = int(snap.get(k, 0)) - self.pushed[k]
            if delta:
                self.store.incr_counter(k, delta)
                self.pushed[k] += delta


def owner_fields() -> dict[str, Any]:
    """The job-meta fields that say this process owns the job and is alive now (read by
    ``status``). Written with the job's creation and with every status change to
    ``running``, so that a run killed before its first heartbeat shows as crashed, not
    as running for ever."""
    return {"owner_pid": os.getpid(), "owner_host": socket.gethostname(), "heartbeat_at": time.time()}


def record_heartbeat(store: JobStore, clock: JobClock | None = None) -> None:
    """Say that this process owns the running job and is alive now (read by ``status``),
    and, with ``clock``, how long the job has been run by every process so far."""
    store.set_meta(**owner_fields(), **(clock.fields() if clock else {}))


def stop_reason(e: KeyboardInterrupt) -> tuple[str, int]:
    """(what stopped the run, in words; the exit code that says so: 128 + signal)."""
    if isinstance(e, RunStopped):
        return f"stopped by {e}", e.exit_code
    return "stopped by Ctrl-C", 130


def fail_job(store: JobStore, gen: object, reason: str) -> None:
    """End the job as failed now (units in flight are cancelled by the generator)."""
    finish = getattr(gen, "fail", None)
    if callable(finish):
        finish(reason)
    else:
        store.set_meta(status="failed", stopping=1, finished_at=time.time(), reason=reason)
    log.error("job %s failed: %s", store.job, reason)


class RunWatch:
    """What the run's loop does besides stepping the generator, every ``every_s``: push
    fault counters, beat the heartbeat, and fail the job fast when no unit can succeed."""

    def __init__(self, spec: JobSpec, store: JobStore, backend: LocalJobSystem, gen: object, clock: JobClock,
                 every_s: float = 0.5):
        self.store, self.gen, self.every_s = store, gen, every_s
        self.backend, self.clock = backend, clock
        self.sync = CounterSync(store, backend)
        self.fail_fast = FailFastWatch(backend, k=min(3, n_shards(spec)))
        self.last = 0.0

    def tick(self, force: bool = False) -> bool:
        """True when it did its work (time to refresh a view too). Raises the job
        system's :class:`ServerResourceError` once it has one (the run pauses)."""
        fault = getattr(self.backend, "server_fault", None)
        if fault is not None:
            raise fault
        now = time.time()
        if not force and now - self.last < self.every_s:
            return False
        self.last = now
        self.sync.push()
        record_heartbeat(self.store, self.clock)
        verdict = self.fail_fast.check()
        if verdict and self.store.meta().get("status") == "running":
            fail_job(self.store, self.gen, verdict)
        return True


def drive(gen: Any, watch: RunWatch, render: Callable[[], Table], console: Console, live: bool,
          refresh_per_second: float, report: Callable[[bool], None] | None = None) -> None:
    """Step the work generator until the job finishes: tick ``watch`` as it goes and,
    when ``live``, redraw ``render()`` whenever the watch did its work (and once at the
    end); otherwise call ``report(final)`` then (plain progress lines)."""
    view = Live(render(), console=console, refresh_per_second=refresh_per_second) if live else None
    if view:
        view.start()
    try:
        while gen.step():
            time.sleep(0.05)
            raise_if_stopped()  # a stop signal whose exception Python swallowed
            if watch.tick():
                if view:
                    view.update(render())
                elif report is not None:
                    report(False)
        watch.tick(force=True)
        if view:
            view.update(render())
        elif report is not None:
            report(True)
    except Exception as e:
        fault = diskfaults.as_server_error(e, watch.backend.base)
        if fault is None:
            raise
        raise pause_job(watch.store, fault, watch.backend.capacity) from None
    finally:
        if view:
            view.stop()


def pause_job(store: JobStore, fault: diskfaults.ServerResourceError, slots: int = 1) -> diskfaults.ServerResourceError:
    """Record that the job paused on a server-side I/O fault (best effort: Redis may not be
    able to write either) and return the error to end the run with: one line naming the
    path, the space free there and the space the run needs, and what to do."""
    if fault.then:
        return fault  # recorded already
    store.retry_s = 0.0  # one attempt: a Redis that cannot write its AOF refuses it at once
    try:
        store.set_meta(status="paused", reason=fault.what)
    except BoincDLError:
        pass
    try:
        n_params = int(float(store.meta().get("n_params", 0)))
    except (BoincDLError, ValueError):
        n_params = 0
    log.error("job %s paused: %s", store.job, fault)
    return fault.with_advice(diskfaults.RESUME_ADVICE, diskfaults.run_space_needed(n_params, slots))


class _RunLogHandler(logging.FileHandler):
    """The run's log file; a record it cannot write (a full disk) is dropped quietly,
    not reported with a traceback on the terminal for every line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


def setup_logging(run_dir: Path) -> None:
    """Log to ``run_dir/boinc-dl.log`` (a process running several jobs moves to the latest)."""
    root = logging.getLogger()
    target = str((run_dir / "boinc-dl.log").resolve())
    for h in list(root.handlers):
        if getattr(h, "_bdl", False):
            if getattr(h, "baseFilename", None) == target:
                return
            root.removeHandler(h)
            h.close()
    h = _RunLogHandler(target)
    h.setFormatter(logging.Formatter("%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"))
    h._bdl = True  # type: ignore[attr-defined]
    root.addHandler(h)
    root.setLevel(logging.INFO)


def print_derived(console: Console, store: JobStore) -> None:
    """Say which defaults the job derived from its data and hosts (first run and resumes)."""
    chosen = derived_settings(store)
    if chosen:
        console.print("defaults chosen for this data and these hosts (set them in the spec to override):",
                      highlight=False, soft_wrap=True)
        for line in describe(chosen):
            console.print(f"  {line}", highlight=False, soft_wrap=True)


def earlier_summary(run_dir: Path) -> dict[str, Any]:
    """What the run that finished the job recorded (elapsed time, backend counters, the
    planner's check): a ``--resume`` of a finished job rewrites its outputs, not its story."""
    import json

    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in ("elapsed_s", "backend", "job", "planner") if k in data}


def resumes_finished(store: JobStore, resume: bool) -> bool:
    """A ``--resume`` of a job an earlier run finished: nothing to train, outputs to write."""
    return resume and store.meta().get("status") in FINISHED


def finished_earlier(store: JobStore, name: str, run_dir: Path, resume: bool,
                     console: Console) -> dict[str, Any] | None:
    """For a ``--resume`` of a job an earlier run finished: say so and return what that run
    recorded (:func:`earlier_summary`), which the outputs written again keep; ``None`` when
    the job still has to run."""
    if not resumes_finished(store, resume):
        return None
    console.print(f"job {name} already {store.meta()['status']}: writing its outputs")
    earlier = earlier_summary(run_dir)
    if "job" not in earlier:  # the finishing run died before its summary: the store knows its runs
        earlier = {**recorded_story(store), **earlier}
    return earlier


def summary_table(res: RunResult, spec: JobSpec) -> Table:
    """The one-screen summary printed at the end of a run."""
    t = Table(title=f"{res.job or spec.name}: {res.status}" + (f" ({res.reason})" if res.reason else ""),
              show_header=False)
    if res.best is not None:  # model selection: the configuration it selected, by its kept weights
        t.add_row("epochs closed", f"{len(res.epochs)} of {spec.training.epochs}")
        b = res.best
        acc = f"val accuracy {b['final_val_acc']:.4f}" if b.get("final_val_acc") is not None else "no result"
        t.add_row("best configuration", f"{b['config']}: {acc} after {b['epochs']} epoch(s) "
                                        f"(model {b['model']}, best_model.keras)")
    elif res.epochs:
        last = res.epochs[-1]
        best = max(res.epochs, key=lambda e: e["val_acc"])
        t.add_row("epochs closed", f"{len(res.epochs)} of {spec.training.epochs}")
        t.add_row("final val accuracy", f"{last['val_acc']:.4f}")
        t.add_row("best val accuracy", f"{best['val_acc']:.4f} (epoch {best['epoch']})")
        if last.get("client_val_acc_mean") is not None:
            t.add_row("last epoch, units", f"mean {last['client_val_acc_mean']:.4f} ± {last['client_val_acc_std']:.4f}")
    b = res.backend
    job = res.totals
    # A job several runs trained (--resume): its own totals, this run's share beside them;
    # this process's counters alone would misreport it.
    resumed = int(job.get("runs", 1)) > 1
    if b or job:
        c = b if b and not resumed else job  # no counters of its own (a rewrite of a finished one): the job's
        merged = f"{c.get('merged', 0)} merged" + (f" ({b.get('merged', 0)} by this run)" if resumed else "")
        again = f", {job['resubmitted']} re-submitted on resuming" if resumed and job.get("resubmitted") else ""
        t.add_row("units", f"{merged}{again}, {c.get('reissued', 0)} re-issued, "
                           f"{c.get('timed_out', 0)} timed out, {c.get('rejected', 0)} rejected, "
                           f"{c.get('given_up', 0)} given up")
    if b:
        busy = b.get("slot_busy_s", 0.0)
        t.add_row("slot utilisation", f"{busy / max(1e-9, b.get('elapsed_s', 0) * b.get('slots', 1)):.0%}")
    if resumed:
        t.add_row("elapsed", f"{float(job.get('active_s', 0)):.1f} s in {job['runs']} runs "
                             f"({res.elapsed_s:.1f} s this run)")
    else:
        t.add_row("elapsed", f"{res.elapsed_s:.1f} s")
    if res.planner:
        startup = res.planner.get("startup_s")
        after = f" after {startup:.1f} s start-up" if startup else ""
        t.add_row("epoch time", f"{res.planner['actual_epoch_s']:.2f} s{after}; planner predicted "
                                f"{res.planner['predicted_epoch_s']:.2f} s ({res.planner['error']:+.0%})")
    if res.outputs:
        names = []
        for v in res.outputs.values():
            p = Path(v)
            names.append(p.name if p.parent == res.run_dir else str(p))
        t.add_row("files", f"{res.run_dir}/: " + ", ".join([*names, "summary.json"]))
    return t
