"""``boinc-dl run`` of a VC-ASGD job on the embedded local backend, start to finish.

On the store :func:`boinc_dl.server.run.run_job` opens (a private Redis with its append-only
file in the run directory unless one is given), prepares the job, starts the local job system, drives the work generator until the job finishes,
shows live progress, and writes the run directory: final model, history, learning
curve and summary. Ctrl-C stops cleanly; ``--resume`` continues from Redis.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.planner.runcheck import predict_epoch
from boinc_dl.server.run.eta import EtaEstimator, format_eta
from boinc_dl.server.run.lifecycle import (
    RunResult,
    RunWatch,
    drive,
    start_local_backend,
    stop_reason,
)
from boinc_dl.server.run.outputs import (
    collect_history,
    plot_learning_curve,
    save_final_model,
    write_history,
)
from boinc_dl.server.work_generator.prepare import n_shards, prepare_job
from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator

log = logging.getLogger(__name__)


def _progress_table(spec: JobSpec, store: JobStore, backend: LocalJobSystem, t0: float,
                    eta: EtaEstimator | None = None) -> Table:
    meta = store.meta()
    n = n_shards(spec)
    epoch = int(float(meta.get("epoch", 1)))
    closed = int(float(meta.get("closed_epoch", 0)))
    done_units = sum(int(store.epoch_counts(e).get("assimilated", 0) + store.epoch_counts(e).get("failed", 0))
                     for e in range(1, epoch + 1))
    total = n * spec.training.epochs
    snap = backend.snapshot()
    elapsed = time.time() - t0
    eta = eta or EtaEstimator(total)
    eta.total = total
    left = eta.observe(time.time(), done_units)
    acc = meta.get("latest_val_acc")
    t = Table(title=f"boinc-dl · {spec.name} · VC-ASGD on {backend.n_hosts} hosts x {backend.n_slots} slots, "
                    f"{backend.n_assim} assimilators", show_header=False, box=None)
    t.add_row("epoch", f"{closed} closed / {spec.training.epochs}  (creating units of epoch {epoch})")
    t.add_row("units", f"{done_units} done / {total}   in flight {snap['running']} running, {snap['unsent']} queued")
    t.add_row("faults", f"re-issued {snap['reissued']}, timed out {snap['timed_out']}, preempted "
                        f"{snap['preempted']}, rejected {snap['rejected']}, late {snap['late_results']}")
    t.add_row("val accuracy", f"{float(acc):.4f}" if acc else "-")
    t.add_row("elapsed / ETA", f"{elapsed:6.1f} s / {format_eta(left)}")
    return t


def run_vcasgd(spec: JobSpec, run_dir: Path, resume: bool, redis_url: str, store: JobStore,
                console: Console, live: bool, backend_opts: dict[str, Any] | None,
                search_path: Path | None) -> RunResult:
    backend: LocalJobSystem | None = None
    t0 = time.time()
    status = "interrupted"
    exit_code = 0
    try:
        console.print(f"[bold]boinc-dl[/] preparing job [cyan]{spec.name}[/] in {run_dir}")
        files = prepare_job(spec, store, run_dir, resume=resume, search_path=search_path)
        if store.meta().get("status") in ("done", "failed", "cancelled") and resume:
            console.print(f"job {spec.name} already {store.meta()['status']}: writing its outputs")
        else:
            store.set_meta(status="running", reason="")
            backend = start_local_backend(spec, run_dir, redis_url, backend_opts)
            gen = VCASGDWorkGenerator(store, spec, run_dir, backend)
            # A restarted run's job system is new: units in flight before are resubmitted.
            recovered = gen.recover(resubmit_in_progress=True)
            if recovered:
                console.print(f"resumed: {recovered} unit(s) in flight re-submitted")
            _drive(gen, spec, store, backend, console, live, t0)
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
    result = RunResult(status=status, run_dir=run_dir, backend=snap, elapsed_s=time.time() - t0,
                       reason=store.meta().get("reason", ""), exit_code=exit_code)
    hist = collect_history(store)
    hist["backend"] = snap
    result.epochs = hist["epochs"]
    for p in write_history(run_dir, hist):
        result.outputs[p.stem] = str(p)
    if hist["epochs"]:
        png = plot_learning_curve(run_dir / "learning_curve.png", {"VC-ASGD": hist["epochs"]},
                                  f"{spec.name}: validation accuracy per epoch")
        result.outputs["learning_curve"] = str(png)
    if status == "done":
        flat, _ = store.get_weights("0")
        result.outputs["final_model"] = str(save_final_model(run_dir, files.model, flat))
        result.planner = predict_epoch(spec, hist["units"], int(flat.size), result.elapsed_s, len(result.epochs))
    (run_dir / "summary.json").write_text(json.dumps(
        {"status": status, "elapsed_s": result.elapsed_s, "backend": snap, "reason": result.reason,
         "planner": result.planner,
         "final_val_acc": result.epochs[-1]["val_acc"] if result.epochs else None,
         "outputs": result.outputs}, indent=1))
    return result


def _drive(gen: VCASGDWorkGenerator, spec: JobSpec, store: JobStore, backend: LocalJobSystem,
           console: Console, live: bool, t0: float) -> None:
    """Step the work generator until the job finishes, refreshing the progress view."""
    watch = RunWatch(spec, store, backend, gen, every_s=0.25 if live else 0.5)
    eta = EtaEstimator(n_shards(spec) * spec.training.epochs)
    drive(gen, watch, lambda: _progress_table(spec, store, backend, t0, eta), console, live, refresh_per_second=4)
