"""A small ``boinc-dl run`` from start to finish, before vs after: where a run's start-up goes.

A user's first run, and every run of the test suite, pays the run's start-up: the run's
own process imports TensorFlow (the initial model, the evaluator, the checker) and the
local backend's fork server imports it again before it forks the first slot. This runs
the same small job (the user's own ``.npz`` of 400 examples, their ``mymodel:build``, 1
host x 2 slots, 2 epochs) with the current code and with a baseline exported from a git
revision (``--baseline-ref``), interleaved, and reports medians of the wall time of the
whole command and of the start-up the run itself reports (``summary.json``'s
``planner.startup_s``: the run's elapsed time less its epochs' time).

    python3 bench/bench_run_startup.py --repeats 3
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import before_after_args, cli_env, emit, export_ref, interleaved, machine, median  # noqa: E402
from tests.support.userjob import user_files  # noqa: E402  (the user's own files, as the tests write them)

REPO = Path(__file__).resolve().parents[1]
BASELINE_REF = "d623d10"  # before the lean TensorFlow import and the early fork server

ARGS = ["--workers", "1", "--slots", "2", "--assimilators", "1"]


def run_once(code: tuple[Path, str] | None, work: Path) -> dict[str, float]:
    """One ``boinc-dl run`` of the job in ``work`` (a fresh run directory), timed, with the
    code of :func:`export_ref`'s ``code`` (None: the installed code)."""
    shutil.rmtree(work / "runs", ignore_errors=True)
    env, prefix = cli_env(code)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", f"{prefix}server.cli", "run", "job.yaml", *ARGS], cwd=work, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t
    summary = json.loads((work / "runs" / "mine" / "summary.json").read_text())
    return {"wall_s": wall, "startup_s": float(summary["planner"]["startup_s"]),
            "val_acc": float(summary["final_val_acc"])}


def main() -> None:
    args = before_after_args(__doc__, BASELINE_REF)
    with tempfile.TemporaryDirectory(prefix="bench_run_startup_") as tmp_s:
        tmp = Path(tmp_s)
        base = export_ref(REPO, args.baseline_ref, tmp / "baseline")
        sides = {"before": (base, tmp / "before"), "after": (None, tmp / "after")}
        for _, work in sides.values():
            user_files(work)
        runs = interleaved(sides, args.repeats, lambda side, _i: run_once(*sides[side]))
    med = {side: {k: round(median([r[k] for r in rs]), 3) for k in rs[0]} for side, rs in runs.items()}
    print(f"{'':14}{'before':>10}{'after':>10}")
    for k in ("wall_s", "startup_s", "val_acc"):
        print(f"{k:14}{med['before'][k]:>10}{med['after'][k]:>10}")
    emit("run_startup", repeats=args.repeats, baseline_ref=args.baseline_ref, before=med["before"],
         after=med["after"], ratio_wall=round(med["after"]["wall_s"] / med["before"]["wall_s"], 3),
         ratio_startup=round(med["after"]["startup_s"] / med["before"]["startup_s"], 3),
         load1=os.getloadavg()[0], **machine())


if __name__ == "__main__":
    main()
