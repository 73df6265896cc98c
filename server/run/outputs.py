"""Run outputs: training history (JSON + CSV), learning-curve PNG, one-screen summary."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.assimilator.store import JobStore

#: units.csv's timing columns after the original ones (docs/planner.md, "Calibration").
UNIT_TIMINGS = ("load_s", "eval_s", "checkpoint_s", "train_cpu_s", "cpu_s",
                "validate_s", "validate_cpu_s", "merge_s", "merge_cpu_s", "commit_s", "first_step_cpu_s")
#: Appended after them, ``merge_rule: search`` (empty otherwise): the step the server chose
#: for the result, the checker's seconds for it, the result's whole wait for it, the server
#: weights' version it was searched at, and whether it fell back to delta's weight.
STEP_COLUMNS = ("step", "step_check_s", "step_wait_s", "step_at_version", "step_fallback")


def collect_history(store: JobStore) -> dict[str, Any]:
    """Per-epoch summaries and per-unit merge records of a job, from Redis."""
    epochs = [{"epoch": e, **s} for e, s in store.epochs().items()]
    return {"job": store.job, "meta": store.meta(), "epochs": epochs, "units": unit_records(store),
            "counters": store.counters(), "rejections": store.rejections(100)}


def unit_records(store: JobStore) -> list[dict[str, Any]]:
    """A job's per-unit records from Redis, in merge order: each merged unit's (the rows
    of ``units.csv``) and each failed one's reason."""
    units: list[dict[str, Any]] = []
    for m in store.metrics():
        if m["kind"] == "merge":
            units.append({k: m.get(k) for k in (
                "unit", "epoch", "shard", "version", "base_version", "staleness", "merge_rule", "clip_scale",
                "trusted", "val_acc", "val_loss",
                "train_loss", "train_acc", "examples_seen", "train_s", "wall_s", "host", "t",
                # Appended (the columns above keep their order): each unit's own durations,
                # from the client's clock (load, evaluation, checkpoints, CPU seconds) and
                # the assimilator's (validation, the merge call, its Redis commits, CPU).
                *UNIT_TIMINGS, *STEP_COLUMNS)})
        elif m["kind"] == "failed":
            units.append({"unit": m.get("unit"), "failed": m.get("reason")})
    return units


def write_json(path: Path, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, whole or not at all: a run killed while
    writing leaves the earlier file (a ``--resume`` of a finished job reads its
    ``summary.json`` back), never a truncated one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
    return path


def write_history(run_dir: Path, hist: dict[str, Any]) -> list[Path]:
    """history.json plus epochs.csv and units.csv; returns the paths written."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = [run_dir / "history.json", run_dir / "epochs.csv", run_dir / "units.csv"]
    write_json(out[0], hist)
    write_rows(out[1], hist["epochs"])
    write_rows(out[2], hist["units"])
    return out


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a CSV file, the columns in the order they first appear."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys or ["epoch"])
        w.writeheader()
        w.writerows(rows)
    return path


def plot_learning_curve(path: Path, curves: dict[str, list[dict[str, Any]]], title: str) -> Path:
    """Validation accuracy per epoch; shaded band = min..max of the clients' accuracies
    within the epoch and the error bar their standard deviation (the spread across units)."""
    import matplotlib.pyplot as plt

    fig = learning_curve_figure(curves, title)
    fig.savefig(path)
    plt.close(fig)
    return path


def learning_curve_figure(curves: dict[str, list[dict[str, Any]]], title: str) -> Any:
    """The figure :func:`plot_learning_curve` saves (epochs on a whole-number axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, epochs in curves.items():
        if not epochs:
            continue
        x = np.array([e["epoch"] for e in epochs])
        y = np.array([e["val_acc"] for e in epochs], dtype=float)
        lo = [e.get("client_val_acc_min") for e in epochs]
        has_units = all(v is not None for v in lo)
        line = ax.plot(x, y, marker="o", ms=3, label=f"{label}: server weights" if has_units else label)[0]
        hi = [e.get("client_val_acc_max") for e in epochs]
        mean = [e.get("client_val_acc_mean") for e in epochs]
        std = [e.get("client_val_acc_std") for e in epochs]
        if all(v is not None for v in lo + hi + mean + std):
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, label=f"{label}: units min-max")
            ax.errorbar(x, mean, yerr=std, fmt="none", ecolor=line.get_color(), alpha=0.6, capsize=2,
                        label=f"{label}: units mean ± std")
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole: no 2.5 ticks
    ax.set_ylabel("validation accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def save_final_model(run_dir: Path, model_file: Path, flat: np.ndarray) -> Path:
    """The job's model with the final server weights, as a Keras file."""
    from boinc_dl.server.common.keras_model import configure_tf, set_flat

    tf = configure_tf()
    model = tf.keras.models.load_model(model_file, compile=False)
    set_flat(model, flat)
    out = run_dir / "final_model.keras"
    model.save(out)
    return out
