"""``boinc-dl run`` for MOP jobs: model selection on the embedded local backend.

Partitions are placed on simulated hosts round-robin (``mop.replication`` hosts per
partition); each host's slots are the scheduler's workers and units carry a host hint,
so a host only ever holds its own partitions' data. Writes a leaderboard (terminal and
CSV), per-model learning curves in one PNG, the best model's file and the schedule.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.spec import JobSpec, local_options
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.common.workunit import parse_unit_name
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
from boinc_dl.server.run.outputs import unit_records, write_json, write_rows
from boinc_dl.server.work_generator.mop.assignment import round_robin_availability
from boinc_dl.server.work_generator.mop.state import MopState
from boinc_dl.server.work_generator.mop_generator import MOPWorkGenerator, model_file
from boinc_dl.server.work_generator.prepare import effective_spec, prepare_job

#: Configurations named in learning_curves.png's legend (the best ones).
LEGEND_MAX = 12


def placement(n_hosts: int, slots: int, partitions: int, replication: int) -> tuple[dict[str, set[int]], dict[str, int]]:
    """(worker -> partitions, worker -> host): partition j on hosts (j + r) mod N."""
    by_host = round_robin_availability([str(h) for h in range(n_hosts)], partitions, min(replication, n_hosts))
    avail, host_of = {}, {}
    for h in range(n_hosts):
        for s in range(slots):
            w = f"h{h}s{s}"
            avail[w] = set(by_host[str(h)])
            host_of[w] = h
    return avail, host_of


def format_params(params: dict[str, Any]) -> str:
    """``hidden=64 depth=2 learning_rate=0.003``: a configuration as a reader tells them apart."""
    def value(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return json.dumps(v) if isinstance(v, dict | list) else str(v)

    return " ".join(f"{k}={value(v)}" for k, v in params.items()) or "(no parameters)"


def _acc(v: float | None) -> str:
    return f"{v:.4f}" if v is not None else "-"


def _short(reason: str, width: int = 24) -> str:
    """A reason as the printed leaderboard shows it: whole when short, else its first
    clause (``exploited: replaced by a copy of c43...`` -> ``exploited``); leaderboard.csv
    keeps it whole."""
    return reason if len(reason) <= width else reason.split(":")[0][:width]


#: Reasons that say nothing beyond the status (every model of a finished grid search).
_PLAIN_REASONS = ("", "search finished")


def leaderboard(store: JobStore) -> list[dict[str, Any]]:
    """One row per configuration, best first: by the validation accuracy of the weights
    it ends with (``final_val_acc``, what ``best_model.keras`` holds for the first row),
    ties by its best accuracy at any epoch, then by epochs trained.

    Ranking by the best epoch instead would name a model whose weights no longer score
    that: only each configuration's latest weights are kept (a PBT run's top row read
    0.9930 where its saved weights scored 0.9859)."""
    state = MopState(store)
    configs = state.configs()
    results = state.results()
    rows = []
    for cid, c in configs.items():
        curve = [results[e][cid]["val_acc"] for e in sorted(results) if cid in results[e]]
        rows.append({"model": cid, "status": c.get("status"), "best_val_acc": max(curve) if curve else None,
                     "final_val_acc": curve[-1] if curve else None, "epochs": len(curve),
                     "params": json.dumps(c.get("params", {}), sort_keys=True),
                     "config": format_params(c.get("params", {})), "parent": c.get("parent"),
                     "reason": c.get("reason", ""), "curve": curve})
    rows.sort(key=_rank)
    return rows


def _rank(row: dict[str, Any]) -> tuple[float, float, int]:
    """Sort key of a leaderboard row (ascending: best first); rows without a result last."""
    def acc(v: float | None) -> float:
        return -v if v is not None else 1.0

    return acc(row["final_val_acc"]), acc(row["best_val_acc"]), -int(row["epochs"])


def curves_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """Validation accuracy per epoch of each configuration, named in full by its
    parameters in a legend beside the plot (the best ``LEGEND_MAX`` of them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [r for r in rows if r["curve"]]
    labelled = shown[:LEGEND_MAX]  # rows are best first: the legend names the best ones
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for r in shown:
        ax.plot(range(1, len(r["curve"]) + 1), r["curve"], marker="o", ms=2, lw=1,
                label=r["config"] if r in labelled else None)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if labelled:
        more = f" (best {len(labelled)} of {len(shown)})" if len(shown) > len(labelled) else ""
        # Beside the plot, whole: the parameters are what tells the curves apart.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  title=f"configuration{more}", title_fontsize=7)
    fig.tight_layout()
    return fig


def selected(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration a leaderboard selects: its first row with a result (rows are
    ranked best first, those without a result last); ``None`` when none has one."""
    return rows[0] if rows and rows[0]["final_val_acc"] is not None else None


def write_mop_outputs(run_dir: Path, store: JobStore, gen: MOPWorkGenerator | None, title: str,
                      rows: list[dict[str, Any]]) -> dict[str, str]:
    """leaderboard.csv, learning_curves.png, best_model.keras, units.csv, history.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    lb = run_dir / "leaderboard.csv"
    with lb.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "curve"] if rows else ["model"])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k != "curve"})
    out["leaderboard"] = str(lb)
    fig = curves_figure(rows, title)
    png = run_dir / "learning_curves.png"
    fig.savefig(png)
    plt.close(fig)
    out["learning_curves"] = str(png)
    best = selected(rows)
    if best is not None:
        from boinc_dl.server.run.outputs import save_final_model

        flat, _ = store.get_weights(best["model"])
        files_dir = Path(store.meta().get("job_dir", run_dir))
        from boinc_dl.server.work_generator.prepare import JobFiles

        saved = save_final_model(run_dir, model_file(JobFiles(files_dir, store.job), best["model"]), flat)
        target = run_dir / "best_model.keras"
        saved.replace(target)
        out["best_model"] = str(target)
    # One row per sub-epoch trained (a configuration's visit to a partition), with the
    # configuration's id beside the unit: its durations, as VC-ASGD runs record them.
    units = [{"model": (parse_unit_name(str(u["unit"])) or {}).get("model"), **u} for u in unit_records(store)]
    out["units"] = str(write_rows(run_dir / "units.csv", units))
    hist = {"job": store.job, "meta": store.meta(), "leaderboard": rows,
            "epochs": [{"epoch": e, **s} for e, s in store.epochs().items()],
            "units": units, "schedule": MopState(store).schedule_log(),
            "visit_orders": gen.visit_orders() if gen else {}, "counters": store.counters(),
            "rejections": store.rejections(100)}
    write_json(run_dir / "history.json", hist)
    out["history"] = str(run_dir / "history.json")
    return out


def _table(store: JobStore, spec: JobSpec, backend: LocalJobSystem, t0: float) -> Table:
    meta = store.meta()
    snap = backend.snapshot()
    t = Table(title=f"boinc-dl · {spec.name} · MOP, {backend.n_hosts} hosts x {backend.n_slots} slots", box=None)
    t.add_column("configuration", overflow="fold")
    t.add_column("status")
    t.add_column("epochs")
    t.add_column("val acc")
    t.add_column("best val acc")
    for r in leaderboard(store)[:12]:
        t.add_row(r["config"], str(r["status"]), str(r["epochs"]), _acc(r["final_val_acc"]), _acc(r["best_val_acc"]))
    closed = int(float(meta.get("closed_epoch", 0)))
    t.caption = (f"epochs {closed} / {spec.training.epochs} closed · running {snap['running']}, queued "
                 f"{snap['unsent']} · re-issued {snap['reissued']} · {time.time() - t0:.0f} s")
    return t


class MOPProgressLines:
    """One plain line per closed epoch for output that is not a terminal: the best
    configuration so far, by its parameters."""

    def __init__(self, spec: JobSpec, store: JobStore, console: Console, t0: float):
        self.spec, self.store, self.console, self.t0 = spec, store, console, t0
        self.closed = int(float(store.meta().get("closed_epoch", 0)))

    def __call__(self, final: bool) -> None:
        closed = int(float(self.store.meta().get("closed_epoch", 0)))
        if closed <= self.closed:
            return
        rows = leaderboard(self.store)
        live = sum(1 for r in rows if r["status"] == "running")
        best = selected(rows)
        for e in range(self.closed + 1, closed + 1):
            text = f"epoch {e}/{self.spec.training.epochs} - {len(rows)} configurations"
            if live and not final:
                text += f", {live} training"
            if best is not None and e == closed:
                text += f" - best val_acc {best['final_val_acc']:.4f}: {best['config']}"
            self.console.print(f"{text} - {time.time() - self.t0:.1f} s", highlight=False, soft_wrap=True)
        self.closed = closed


def run_mop_job(spec: JobSpec, run_dir: Path, resume: bool, redis_url: str, store: JobStore,
                console: Console, live: bool, backend_opts: dict[str, Any] | None,
                search_path: Path | None, lines: bool = False) -> RunResult:
    """Run a MOP job to completion on the local backend (see the module docstring).

    ``store`` is on ``redis_url``; :func:`boinc_dl.server.run.run_job` owns that Redis's lifetime."""
    assert spec.mop is not None
    backend: LocalJobSystem | None = None
    gen: MOPWorkGenerator | None = None
    t0 = time.time()
    status = "interrupted"
    exit_code = 0
    snap: dict[str, Any] = {}
    earlier: dict[str, Any] | None = None
    clock: JobClock | None = None
    try:
        console.print(f"[bold]boinc-dl[/] preparing MOP job [cyan]{spec.name}[/] in {run_dir}", soft_wrap=True)
        prestart_local_backend(store, run_dir, resume)
        opts = local_options(spec, backend_opts)
        prepare_job(spec, store, run_dir, resume=resume, search_path=search_path,
                    slots=int(opts["workers"]) * int(opts["slots"]), owner=owner_fields())
        spec = effective_spec(spec, store)
        print_derived(console, store)
        avail, host_of = placement(opts["workers"], opts["slots"], spec.mop.partitions, spec.mop.replication)
        earlier = finished_earlier(store, spec.name, run_dir, resume, console)
        if earlier is None and store.meta().get("status") not in FINISHED:
            store.set_meta(status="running", reason="", **owner_fields())
            backend = start_local_backend(spec, run_dir, redis_url, backend_opts)
            gen = MOPWorkGenerator(store, spec, run_dir, backend, avail, host_of, search_path)
            recovered = gen.recover(resubmit_in_progress=True)
            if recovered:
                console.print(f"resumed: {recovered} unit(s) in flight re-submitted")
            clock = JobClock(store, t0, recovered)
            watch = RunWatch(spec, store, backend, gen, clock)
            drive(gen, watch, lambda: _table(store, spec, backend, t0), console, live, refresh_per_second=2,
                  report=MOPProgressLines(spec, store, console, t0) if lines and not live else None)
        status = store.meta().get("status", "running")
    except KeyboardInterrupt as e:
        stopped, exit_code = stop_reason(e)
        store.retry_s = min(store.retry_s, 5.0)  # stopping: do not wait out a long Redis outage
        console.print(f"\n[yellow]interrupted[/] ({stopped}): state is saved; continue with [bold]--resume[/]")
        store.set_meta(status="interrupted", reason=stopped)
    finally:
        if backend is not None:
            snap = backend.snapshot()
            snap["data_bytes_per_host"] = backend.data_bytes_per_host()
            backend.stop()
        end_prestart(backend)
    # A --resume of a finished job writes its outputs again; its time and counters stay the
    # finishing run's (this process trained nothing).
    earlier = earlier or {}
    res = RunResult(status=status, run_dir=run_dir, backend=earlier.get("backend", snap),
                    elapsed_s=earlier.get("elapsed_s", time.time() - t0),
                    reason=store.meta().get("reason", ""), exit_code=exit_code)
    res.totals = earlier.get("job") or end_clock(store, clock)
    lb = leaderboard(store)
    res.outputs = write_mop_outputs(run_dir, store, gen, f"{spec.name}: validation accuracy per model", lb)
    res.epochs = [{"epoch": e, **s} for e, s in store.epochs().items()]
    res.best = selected(lb)
    t = Table(title=f"leaderboard ({len(lb)} configurations; val acc: of the weights kept, best first)")
    # The configuration whole, folded rather than cut: its values are what tells rows apart.
    # (The model ids are in leaderboard.csv: 80 columns hold the rest unbroken.)
    t.add_column("configuration", overflow="fold", min_width=22)
    t.add_column("status", no_wrap=True)
    for col in ("epochs", "val acc", "best"):
        t.add_column(col, no_wrap=True)
    for r in lb[:20]:
        note = f" ({_short(r['reason'])})" if r["reason"] not in _PLAIN_REASONS else ""
        t.add_row(r["config"], str(r["status"]) + note, str(r["epochs"]), _acc(r["final_val_acc"]),
                  _acc(r["best_val_acc"]))
    console.print(t)
    write_json(run_dir / "summary.json",
        {"status": status, "elapsed_s": res.elapsed_s, "backend": res.backend, "job": res.totals,
         "reason": res.reason, "best": lb[0] if lb else None, "outputs": res.outputs})
    return res
