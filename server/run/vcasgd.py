"""``boinc-dl run`` of a VC-ASGD job on the embedded local backend, start to finish.

On the store :func:`boinc_dl.server.run.run_job` opens (a private Redis with its append-only
file in the run directory unless one is given), prepares the job, starts the local job system, drives the work generator until the job finishes,
shows live progress, and writes the run directory: final model, history, learning
curve and summary. Ctrl-C stops cleanly; ``--resume`` continues from Redis.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator import stepsearch
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.spec import JobSpec, local_options
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.planner.runcheck import predict_epoch
from boinc_dl.server.run.eta import EtaEstimator, format_eta
from boinc_dl.server.run.jobclock import JobClock, end_clock
from boinc_dl.server.run.lifecycle import (
    RunResult,
    RunWatch,
    drive,
    end_prestart,
    finished_earlier,
    owner_fields,
    prestart_local_backend,
    print_derived,
    start_local_backend,
    stop_reason,
)
from boinc_dl.server.run.outputs import (
    collect_history,
    plot_learning_curve,
    save_final_model,
    write_history,
    write_json,
)
from boinc_dl.server.work_generator.prepare import (
    derived_settings,
    effective_spec,
    n_shards,
    prepare_job,
)
from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator

log = logging.getLogger(__name__)


def _epoch_line(closed: int, epochs: int, creating: int, status: str) -> str:
    """``3 / 20 closed · units of epochs 4-5 in flight`` (no "creating" once it is over)."""
    text = f"{closed} / {epochs} closed"
    if status in FINISHED or closed >= epochs:
        return text
    first = closed + 1
    return text + (f" · training epoch {first}" if creating <= first else f" · units of epochs {first}-{creating} in flight")


def _units_done(store: JobStore, epoch: int) -> int:
    return sum(int(c.get("assimilated", 0) + c.get("failed", 0))
               for c in (store.epoch_counts(e) for e in range(1, epoch + 1)))


def _progress_table(spec: JobSpec, store: JobStore, backend: LocalJobSystem, t0: float,
                    eta: EtaEstimator | None = None) -> Table:
    meta = store.meta()
    n = n_shards(spec)
    epoch = int(float(meta.get("epoch", 1)))
    closed = int(float(meta.get("closed_epoch", 0)))
    done_units = _units_done(store, epoch)
    total = n * spec.training.epochs
    snap = backend.snapshot()
    elapsed = time.time() - t0
    eta = eta or EtaEstimator(total)
    eta.total = total
    left = eta.observe(time.time(), done_units)
    acc = meta.get("latest_val_acc")
    t = Table(title=f"boinc-dl · {spec.name} · VC-ASGD on {backend.n_hosts} hosts x {backend.n_slots} slots, "
                    f"{backend.n_assim} assimilators", show_header=False, box=None)
    t.add_row("epochs", _epoch_line(closed, spec.training.epochs, epoch, meta.get("status", "")))
    t.add_row("units", f"{done_units} done / {total}   in flight {snap['running']} running, {snap['unsent']} queued")
    t.add_row("faults", f"re-issued {snap['reissued']}, timed out {snap['timed_out']}, preempted "
                        f"{snap['preempted']}, rejected {snap['rejected']}, late {snap['late_results']}")
    t.add_row("val accuracy", f"{float(acc):.4f}" if acc else "-")
    t.add_row("elapsed / ETA", f"{elapsed:6.1f} s / {format_eta(left)}")
    return t


class ProgressLines:
    """Plain progress lines for output that is not a terminal (a log file, a pipe), as
    Keras's ``verbose=2`` prints them: one per closed epoch, and one every
    ``every_units`` merged units in between when the last line is ``min_gap_s`` old."""

    def __init__(self, spec: JobSpec, store: JobStore, backend: LocalJobSystem, console: Console, t0: float,
                 eta: EtaEstimator, every_units: int | None = None, min_gap_s: float = 10.0):
        self.spec, self.store, self.backend, self.console, self.t0, self.eta = spec, store, backend, console, t0, eta
        self.n = n_shards(spec)
        self.every_units = every_units or max(1, self.n // 4)
        self.min_gap_s = min_gap_s
        self.closed = int(float(store.meta().get("closed_epoch", 0)))
        self.units_at_line = -1
        self.line_at = time.time()

    def __call__(self, final: bool) -> None:
        meta = self.store.meta()
        epoch = int(float(meta.get("epoch", 1)))
        closed = int(float(meta.get("closed_epoch", 0)))
        total = self.n * self.spec.training.epochs
        done = _units_done(self.store, epoch)
        left = self.eta.observe(time.time(), done)
        elapsed = time.time() - self.t0
        if closed > self.closed:
            epochs = self.store.epochs()
            for e in range(self.closed + 1, closed + 1):
                s = epochs.get(e, {})
                acc, loss, at = s.get("val_acc"), s.get("val_loss"), s.get("ended_at")
                text = f"epoch {e}/{self.spec.training.epochs}"
                if acc is not None and loss is not None:
                    text += f" - val_acc {acc:.4f} - val_loss {loss:.4f}"
                text += f" - {(float(at) if at else time.time()) - self.t0:.1f} s"
                if e == closed and not final and left is not None:
                    text += f" - ETA {format_eta(left)}"
                self.console.print(text, highlight=False, soft_wrap=True)
            self.closed, self.units_at_line, self.line_at = closed, done, time.time()
            return
        if (not final and done - max(0, self.units_at_line) >= self.every_units
                and time.time() - self.line_at >= self.min_gap_s):
            snap = self.backend.snapshot()
            eta = f" - ETA {format_eta(left)}" if left is not None else ""
            self.console.print(f"  units {done}/{total} done, {snap['running']} running - {elapsed:.1f} s{eta}",
                               highlight=False, soft_wrap=True)
            self.units_at_line, self.line_at = done, time.time()


def run_vcasgd(spec: JobSpec, run_dir: Path, resume: bool, redis_url: str, store: JobStore,
               console: Console, live: bool, backend_opts: dict[str, Any] | None,
               search_path: Path | None, lines: bool = False) -> RunResult:
    backend: LocalJobSystem | None = None
    checker_stop: threading.Event | None = None
    t0 = time.time()
    status = "interrupted"
    exit_code = 0
    earlier: dict[str, Any] = {}
    clock: JobClock | None = None
    try:
        console.print(f"[bold]boinc-dl[/] preparing job [cyan]{spec.name}[/] in {run_dir}", soft_wrap=True)
        prestart_local_backend(store, run_dir, resume)
        opts = local_options(spec, backend_opts)
        files = prepare_job(spec, store, run_dir, resume=resume, search_path=search_path,
                            slots=int(opts["workers"]) * int(opts["slots"]), owner=owner_fields())
        spec = effective_spec(spec, store)
        print_derived(console, store)
        finished = finished_earlier(store, spec.name, run_dir, resume, console)
        if finished is not None:
            earlier = finished
        else:
            store.set_meta(status="running", reason="", backend="local", **owner_fields())
            checker_stop = start_checker(spec, store, run_dir, redis_url)
            backend = start_local_backend(spec, run_dir, redis_url, backend_opts)
            gen = VCASGDWorkGenerator(store, spec, run_dir, backend)
            # A restarted run's job system is new: units in flight before are resubmitted.
            recovered = gen.recover(resubmit_in_progress=True)
            if recovered:
                console.print(f"resumed: {recovered} unit(s) in flight re-submitted")
            clock = JobClock(store, t0, recovered)
            _drive(gen, spec, store, backend, clock, console, live, lines, t0)
        status = store.meta().get("status", "running")
    except KeyboardInterrupt as e:
        stopped, exit_code = stop_reason(e)
        store.retry_s = min(store.retry_s, 5.0)  # stopping: do not wait out a long Redis outage
        console.print(f"\n[yellow]interrupted[/] ({stopped}): state is saved; continue with [bold]--resume[/]")
        try:
            store.set_meta(status="interrupted", reason=stopped)
        except BoincDLError:
            pass
    finally:
        snap = backend.snapshot() if backend else {}
        if backend is not None:
            backend.stop()
        end_prestart(backend)
        if checker_stop is not None:
            checker_stop.set()
    result = RunResult(status=status, run_dir=run_dir, backend=earlier.get("backend", snap),
                       elapsed_s=earlier.get("elapsed_s", time.time() - t0),
                       reason=store.meta().get("reason", ""), exit_code=exit_code)
    result.totals = earlier.get("job") or end_clock(store, clock)
    hist = collect_history(store)
    hist["backend"] = snap
    result.epochs = hist["epochs"]
    for p in write_history(run_dir, hist):
        result.outputs[p.stem] = str(p)
    if hist["epochs"]:
        png = plot_learning_curve(run_dir / "learning_curve.png", {"VC-ASGD": hist["epochs"]},
                                  f"{spec.name}: validation accuracy per epoch")
        result.outputs["learning_curve"] = str(png)
    if status in ("done", "cancelled"):
        # A cancelled job keeps what it learned: the server's weights when it was stopped.
        flat, _ = store.get_weights("0")
        result.outputs["final_model"] = str(save_final_model(run_dir, files.model, flat))
    if status == "done":
        result.planner = earlier["planner"] if "planner" in earlier else predict_epoch(
            spec, hist["units"], int(flat.size), result.elapsed_s, len(result.epochs), backend_opts)
    settings = {"n_subsets": spec.vcasgd.n_subsets, "local_epochs": spec.training.local_epochs,
                "merge_rule": spec.vcasgd.merge_rule, "alpha": spec.vcasgd.alpha,
                "learning_rate": spec.training.learning_rate,
                "batch_size": spec.training.batch_size, "derived": [c.field for c in derived_settings(store)]}
    write_json(run_dir / "summary.json",
        {"status": status, "elapsed_s": result.elapsed_s, "backend": result.backend, "job": result.totals,
         "reason": result.reason, "planner": result.planner, "settings": settings,
         "final_val_acc": result.epochs[-1]["val_acc"] if result.epochs else None,
         "outputs": result.outputs})
    return result


def start_checker(spec: JobSpec, store: JobStore, run_dir: Path, redis_url: str) -> threading.Event | None:
    """For ``merge_rule: search``, the checker that answers the assimilators' step requests
    (a thread of this process, which has TensorFlow loaded for the epochs' evaluation);
    set the returned event to stop it. Requests of an earlier run of the job (killed with
    its checker) are dropped first: every one of them is asked again by its result's next
    delivery, at once instead of after its wait."""
    if not stepsearch.enabled(spec):
        return None
    from boinc_dl.server.work_generator.losscheck import LossChecker

    dropped = store.drop_loss_requests()
    spool = lc.spool_dir(run_dir)
    if spool.is_dir():
        shutil.rmtree(spool, ignore_errors=True)
    if dropped:
        log.info("%d step request(s) of an earlier run dropped: asked again", dropped)
    stop = threading.Event()
    checker = LossChecker(lambda: connect(redis_url, timeout=5.0), lambda: {spec.name: run_dir}, stop)
    threading.Thread(target=checker.run, name="step-search", daemon=True).start()
    return stop


def _drive(gen: VCASGDWorkGenerator, spec: JobSpec, store: JobStore, backend: LocalJobSystem, clock: JobClock,
           console: Console, live: bool, lines: bool, t0: float) -> None:
    """Step the work generator until the job finishes, refreshing the progress view."""
    watch = RunWatch(spec, store, backend, gen, clock, every_s=0.25 if live else 0.5)
    eta = EtaEstimator(n_shards(spec) * spec.training.epochs)
    report = ProgressLines(spec, store, backend, console, t0, EtaEstimator(n_shards(spec) * spec.training.epochs)) \
        if lines and not live else None
    drive(gen, watch, lambda: _progress_table(spec, store, backend, t0, eta), console, live, refresh_per_second=4,
          report=report)
