"""What every ``boinc-dl run`` shares: the run directory, the store, the local backend,
logging, counters and the end-of-run summary."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from server.backends.local import LocalJobSystem
from server.common.redis_server import EmbeddedRedis
from server.common.spec import JobSpec
from server.common.store import JobStore, connect

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


def default_run_dir(spec: JobSpec) -> Path:
    return Path("runs") / spec.name


def open_store(run_dir: Path, redis_url: str | None, job: str) -> tuple[EmbeddedRedis | None, str, JobStore]:
    """The job's store: on ``redis_url``, or on a private Redis kept in ``run_dir/redis``."""
    server = None
    if redis_url is None:
        server = EmbeddedRedis(run_dir / "redis").start()
        redis_url = server.url
    return server, redis_url, JobStore(connect(redis_url), job)


def start_local_backend(spec: JobSpec, run_dir: Path, redis_url: str,
                        backend_opts: dict[str, Any] | None) -> LocalJobSystem:
    """The local job system the spec asks for (options overridden by ``backend_opts``), started."""
    opts = {**spec.backend.local.model_dump(), **(backend_opts or {})}
    backend = LocalJobSystem(run_dir, redis_url, spec.name, workers=opts["workers"], slots=opts["slots"],
                             assimilators=opts["assimilators"], threads_per_slot=opts["threads_per_slot"],
                             preempt_prob=opts["preempt_prob"], notice=opts.get("notice", False), seed=spec.seed)
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


def setup_logging(run_dir: Path) -> None:
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
