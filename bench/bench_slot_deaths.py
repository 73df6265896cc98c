"""Slot processes killed mid-unit under ``boinc-dl run``, before vs after: time lost to them.

A slot's process can die while its host lives on: a user's ``kill``, the kernel's
out-of-memory killer, a crash in a native library. BOINC's client restarts an app
killed from outside in its slot, from its checkpoint, and reports any other death as an
error at once, so the server issues the unit again (client/app_control.cpp). This runs
the same job (the user's own ``.npz`` of 4,000 examples, their ``mymodel:build``, 1 host
x 2 slots, 10 epochs of 20 local epochs, ``units.timeout_s`` 60) with the current code
and with a baseline exported from a git revision (``--baseline-ref``), interleaved, and
in each run kills a busy slot's process three times (SIGKILL, SIGKILL, SIGSEGV), each
at a random moment of a unit, the same moments on both sides. It reports the wall time
of the whole command, the units that timed out, and what the kills cost over a run with
none.

    python3 bench/bench_slot_deaths.py --repeats 2
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import before_after_args, cli_env, emit, export_ref, interleaved, machine, median  # noqa: E402
from tests.support.procs import busy_slot  # noqa: E402  (a run's slot training now, from /proc)
from tests.support.userjob import MINIMAL, user_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASELINE_REF = "15a3d84"  # a slot's death held its unit until the deadline
ARGS = ["--workers", "1", "--slots", "2", "--assimilators", "1"]
SPEC = MINIMAL.replace("training: {epochs: 2}", "training: {epochs: 10, local_epochs: 20}\nunits: {timeout_s: 60}")
KILLS = (signal.SIGKILL, signal.SIGKILL, signal.SIGSEGV)


def run_once(code: tuple[Path, str] | None, work: Path, kills: bool, seed: int) -> dict[str, float]:
    """One ``boinc-dl run`` of the job in ``work``, with :data:`KILLS` of busy slots (or
    none), with the code of :func:`export_ref`'s ``code`` (None: the installed code)."""
    shutil.rmtree(work / "runs", ignore_errors=True)
    env, prefix = cli_env(code)
    rng = random.Random(seed)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"{prefix}server.cli", "run", "job.yaml", *ARGS], cwd=work,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    landed = 0
    try:
        for sig in KILLS if kills else ():
            time.sleep(rng.uniform(2, 6))
            victim = None
            while victim is None and proc.poll() is None:
                victim = busy_slot(proc.pid)
            if victim is not None:
                os.kill(victim, sig)
                landed += 1
        proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.perf_counter() - t
    summary = json.loads((work / "runs" / "mine" / "summary.json").read_text())
    b = summary["backend"]
    return {"wall_s": wall, "kills": landed, "timed_out": b.get("timed_out", 0), "reissued": b.get("reissued", 0),
            "restarted": b.get("app_restarts", 0), "val_acc": float(summary["final_val_acc"])}


def main() -> None:
    args = before_after_args(__doc__, BASELINE_REF)
    with tempfile.TemporaryDirectory(prefix="bench_slot_deaths_") as tmp_s:
        tmp = Path(tmp_s)
        base = export_ref(REPO, args.baseline_ref, tmp / "baseline")
        sides = {"before": (base, tmp / "before"), "after": (None, tmp / "after")}
        for _, work in sides.values():
            user_files(work, SPEC, n=4000)
        clean = [run_once(None, tmp / "after", False, 0)]
        runs = {**interleaved(sides, args.repeats, lambda side, i: run_once(*sides[side], True, seed=i)),
                "no kills": clean}
    med = {side: {k: round(median([r[k] for r in rs]), 3) for k in rs[0]} for side, rs in runs.items()}
    print(f"{'':12}" + "".join(f"{s:>12}" for s in med))
    for k in med["after"]:
        print(f"{k:12}" + "".join(f"{med[s][k]:>12}" for s in med))
    clean = med["no kills"]["wall_s"]
    emit("slot_deaths", repeats=args.repeats, baseline_ref=args.baseline_ref, **med,
         ratio_wall=round(med["after"]["wall_s"] / med["before"]["wall_s"], 3),
         cost_before_s=round(med["before"]["wall_s"] - clean, 1), cost_after_s=round(med["after"]["wall_s"] - clean, 1),
         load1=os.getloadavg()[0], **machine())


if __name__ == "__main__":
    main()
