"""Redis SIGKILLed in the middle of ``boinc-dl run``: time from the kill to the next merge.

Runs the real command line (``python -m boinc_dl.server.cli run``: TensorFlow slots, two
assimilators, its private supervised Redis) on a digits job, and SIGKILLs the run's
redis-server ``--kills`` times, each right after an epoch closes. The supervisor
restarts it on its append-only file; the clients reconnect and carry on.

Measured, from the merge records' timestamps (``history.json``):

* ``kill_to_next_merge_s``: from each kill to the first merge committed after it
  (goal: < 10 s);
* the baseline, in the same run: the wait from a random instant to the next merge
  without a kill (``E[g^2] / 2E[g]`` over the gaps g between consecutive merges that
  span no kill), and the median gap;
* that every unit was merged exactly once and the run exited 0.

    python bench/bench_redis_restart.py [--epochs 6] [--kills 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402

SPEC = """name: redis-restart
model: models:mlp
model_args: {{input_dim: 64, hidden: 32, n_classes: 10}}
dataset: {{name: digits}}
training: {{epochs: {epochs}, batch_size: 32, learning_rate: 0.005, local_epochs: 1}}
vcasgd: {{n_subsets: 4, alpha: 0.5}}
units: {{timeout_s: 60}}
backend: {{kind: local, local: {{workers: 2, slots: 2, assimilators: 2}}}}
seed: 3
"""


def redis_pid(run_dir: Path) -> int | None:
    """The pid of the redis-server whose data dir is under ``run_dir``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "redis-server" in cmd and str(run_dir) in cmd:
            return int(proc.name)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--kills", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bdl-redis-restart-"))
    try:
        shutil.copy(ROOT / "examples" / "models.py", tmp / "models.py")
        (tmp / "job.yaml").write_text(SPEC.format(epochs=args.epochs))
        run_dir = tmp / "run"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "boinc_dl.server.cli", "run", "job.yaml", "--run-dir", str(run_dir),
                                 "-q"], cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = run_dir / "boinc-dl.log"
        kills: list[float] = []
        next_epoch = 2
        while proc.poll() is None and len(kills) < args.kills:
            text = log.read_text(errors="replace") if log.exists() else ""
            if f"epoch {next_epoch} closed" in text:
                pid = redis_pid(run_dir)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(time.time())
                    print(f"SIGKILL redis-server pid {pid} after epoch {next_epoch}", flush=True)
                next_epoch += 1
            time.sleep(0.05)
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            sys.exit(f"run failed ({proc.returncode}):\n{out}\n{err}")
        hist = json.loads((run_dir / "history.json").read_text())
        merges = sorted(u["t"] for u in hist["units"] if u.get("t"))
        counts = Counter(u["unit"] for u in hist["units"] if "failed" not in u)
        exactly_once = len(counts) == args.epochs * 4 and set(counts.values()) == {1}
        to_next = [min(t for t in merges if t > k) - k for k in kills if any(t > k for t in merges)]
        gaps = [b - a for a, b in zip(merges, merges[1:], strict=False)
                if not any(a < k < b for k in kills)]
        residual = sum(g * g for g in gaps) / (2 * sum(gaps)) if gaps else float("nan")
        restarts = log.read_text(errors="replace").count("redis-server restarted")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"kills {len(kills)}, restarts {restarts}, merges {len(merges)}, exactly once: {exactly_once}")
    print(f"kill -> next merge: {', '.join(f'{x:.2f} s' for x in to_next)}")
    print(f"baseline without a kill: wait from a random instant {residual:.2f} s, median gap "
          f"{statistics.median(gaps):.2f} s")
    emit("redis_restart", kills=len(kills), restarts=restarts, merges=len(merges), exactly_once=exactly_once,
         kill_to_next_merge_s=to_next, kill_to_next_merge_max_s=max(to_next) if to_next else None,
         baseline_wait_s=residual, baseline_median_gap_s=statistics.median(gaps),
         ratio_max=(max(to_next) / residual) if to_next and residual else None, goal_s=10.0,
         load=os.getloadavg()[0], **machine())


if __name__ == "__main__":
    main()
