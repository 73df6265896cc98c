"""``boinc-dl run``: a whole job on the embedded local backend, start to finish.

Starts a private Redis (append-only file in the run directory), prepares the job,
starts the local job system, drives the work generator until the job finishes,
shows live progress, and writes the run directory: final model, history, learning
curve and summary. Ctrl-C stops cleanly; ``--resume`` continues from Redis.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from server.backends.local import LocalJobSystem
from server.common.errors import BoincDLError
from server.common.redis_server import EmbeddedRedis
from server.common.spec import JobSpec
from server.common.store import JobStore, connect
from server.eta import EtaEstimator, format_eta
from server.failfast import FailFastWatch
from server.report import collect_history, plot_learning_curve, save_final_model, write_history
from server.signals import RunStopped
from server.status import record_heartbeat
from server.work_generator.prepare import n_shards, prepare_job
from server.work_generator.vcasgd import VCASGDWorkGenerator

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


def default_run_dir(spec: JobSpec) -> Path:
    return Path("runs") / spec.name


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


def open_store(run_dir: Path, redis_url: str | None, job: str) -> tuple[EmbeddedRedis | None, str, JobStore]:
    """The job's store: on ``redis_url``, or on a private Redis kept in ``run_dir/redis``."""
    server = None
    if redis_url is None:
        # Supervised: a Redis that dies is restarted on its AOF within a second and the
        # run carries on (clients retry); it dies with this process, whatever kills it.
        server = EmbeddedRedis(run_dir / "redis", die_with_parent=True).start().supervise()
        redis_url = server.url
    return server, redis_url, JobStore(connect(redis_url), job)


def start_local_backend(spec: JobSpec, run_dir: Path, redis_url: str,
                        backend_opts: dict[str, Any] | None) -> LocalJobSystem:
    """The local job system the spec asks for (options overridden by ``backend_opts``), started."""
    opts = {**spec.backend.local.model_dump(), **(backend_opts or {})}
    backend = LocalJobSystem(run_dir, redis_url, spec.name, workers=opts["workers"], slots=opts["slots"],
                             assimilators=opts["assimilators"], threads_per_slot=opts["threads_per_slot"],
                             preempt_prob=opts["preempt_prob"], notice=opts.get("notice", False), seed=spec.seed,
                             synthetic_unit_s=opts.get("synthetic_unit_s"))
    backend.start()
    return backend


def run_job(spec: JobSpec, run_dir: Path | None = None, resume: bool = False, redis_url: str | None = None,
            console: Console | None = None, live: bool = True, backend_opts: dict[str, Any] | None = None,
            search_path: Path | None = None) -> RunResult:
    """Run ``spec`` on the local backend; see the module docstring."""
    console = console or Console()
    run_dir = Path(run_dir or default_run_dir(spec)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir)
    server, redis_url, store = open_store(run_dir, redis_url, spec.name)
    try:
        if spec.mode != "vcasgd":
            from server.mop_run import run_mop_job  # noqa: PLC0415 - MOP is optional

            return run_mop_job(spec, run_dir, resume, redis_url, store, console, live, backend_opts,
                               search_path)
        return _run_vcasgd(spec, run_dir, resume, redis_url, store, console, live, backend_opts, search_path)
    finally:
        if server is not None:  # also when the job could not even be prepared
            server.stop()


def _run_vcasgd(spec: JobSpec, run_dir: Path, resume: bool, redis_url: str, store: JobStore,
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
                       reason=store.meta().get("reason", ""))
    result.exit_code = exit_code
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
    (run_dir / "summary.json").write_text(json.dumps(
        {"status": status, "elapsed_s": result.elapsed_s, "backend": snap, "reason": result.reason,
         "final_val_acc": result.epochs[-1]["val_acc"] if result.epochs else None,
         "outputs": result.outputs}, indent=1))
    return result


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

    def __init__(self, spec: JobSpec, store: JobStore, backend: LocalJobSystem, gen: object, every_s: float = 0.5):
        self.store, self.gen, self.every_s = store, gen, every_s
        self.sync = _CounterSync(store, backend)
        self.fail_fast = FailFastWatch(backend, k=min(3, n_shards(spec)))
        self.last = 0.0

    def tick(self, force: bool = False) -> bool:
        """True when it did its work (time to refresh a view too)."""
        now = time.time()
        if not force and now - self.last < self.every_s:
            return False
        self.last = now
        self.sync.push()
        record_heartbeat(self.store)
        verdict = self.fail_fast.check()
        if verdict and self.store.meta().get("status") == "running":
            fail_job(self.store, self.gen, verdict)
        return True


def _drive(gen: VCASGDWorkGenerator, spec: JobSpec, store: JobStore, backend: LocalJobSystem,
           console: Console, live: bool, t0: float) -> None:
    """Step the work generator until the job finishes, refreshing the progress view."""
    watch = RunWatch(spec, store, backend, gen, every_s=0.25 if live else 0.5)
    eta = EtaEstimator(n_shards(spec) * spec.training.epochs)
    view = Live(_progress_table(spec, store, backend, t0, eta), console=console, refresh_per_second=4) \
        if live else None
    if view:
        view.start()
    try:
        while gen.step():
            time.sleep(0.05)
            if watch.tick() and view:
                view.update(_progress_table(spec, store, backend, t0, eta))
        if view:
            view.update(_progress_table(spec, store, backend, t0, eta))
    finally:
        if view:
            view.stop()
    watch.tick(force=True)


class _CounterSync:
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


def _setup_logging(run_dir: Path) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_bdl", False) for h in root.handlers):
        return
    h = logging.FileHandler(run_dir / "boinc-dl.log")
    h.setFormatter(logging.Formatter("%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"))
    h._bdl = True  # type: ignore[attr-defined]
    root.addHandler(h)
    root.setLevel(logging.INFO)


def summary_table(res: RunResult, spec: JobSpec) -> Table:
    """The one-screen summary printed at the end of a run."""
    t = Table(title=f"{spec.name}: {res.status}" + (f" ({res.reason})" if res.reason else ""), show_header=False)
    if res.epochs:
        last = res.epochs[-1]
        best = max(res.epochs, key=lambda e: e["val_acc"])
        t.add_row("epochs", str(len(res.epochs)))
        t.add_row("final val accuracy", f"{last['val_acc']:.4f}")
        t.add_row("best val accuracy", f"{best['val_acc']:.4f} (epoch {best['epoch']})")
        if last.get("client_val_acc_mean") is not None:
            t.add_row("last epoch, units", f"mean {last['client_val_acc_mean']:.4f} ± {last['client_val_acc_std']:.4f}")
    b = res.backend
    if b:
        busy = b.get("slot_busy_s", 0.0)
        t.add_row("units", f"{b.get('merged', 0)} merged, {b.get('reissued', 0)} re-issued, "
                           f"{b.get('timed_out', 0)} timed out, {b.get('rejected', 0)} rejected, "
                           f"{b.get('given_up', 0)} given up")
        t.add_row("slot utilisation", f"{busy / max(1e-9, b.get('elapsed_s', 0) * b.get('slots', 1)):.0%}")
    t.add_row("elapsed", f"{res.elapsed_s:.1f} s")
    for k, v in res.outputs.items():
        t.add_row(k, v)
    return t
