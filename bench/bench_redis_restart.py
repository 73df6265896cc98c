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

With ``--recovery-merges N``, instead: the rebuild of logged (durable) merges. A job of
``--params`` parameters (the paper's 4,972,746 by default) is snapshotted, then N
results are assimilated through the real path (result files written, retained,
hashed, synced, logged; each upload deleted after its merge, as a job system does),
Redis is SIGKILLed and restarted, and the time from the kill until the weights are
served again is measured (Redis's restart on its small AOF, then the replay of the N
merges from the snapshot and the retained inputs), with the AOF's growth per merge and
a bitwise comparison of the weights before and after.

    python bench/bench_redis_restart.py [--epochs 6] [--kills 3]
    python bench/bench_redis_restart.py --recovery-merges 1000 [--params 4972746]
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


def recovery(merges: int, params: int) -> None:
    """The ``--recovery-merges`` measurement (module doc)."""
    import numpy as np

    from bench.bench_assimilation import aof_size, log_bytes, resnet_like_shapes
    from boinc_dl.server.assimilator import snapshot as snaps
    from boinc_dl.server.assimilator.aof_sync import aof_files
    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.recovery import ensure_live
    from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights
    from tests.support.results import assimilate_files

    os.environ["BDL_SNAPSHOT_EVERY"] = str(10 * merges)  # the N merges all stay in the log
    shapes = resnet_like_shapes(params)
    fp = fingerprint_of([f"layer{i}/w" for i in range(len(shapes))], [np.zeros(s, np.float32) for s in shapes])
    tmp = Path(tempfile.mkdtemp(prefix="bdl-recovery-"))
    srv = EmbeddedRedis(tmp / "redis").start()
    try:
        spec = parse_spec({"name": "rec", "model": "m:f", "dataset": {"name": "digits"},
                           "vcasgd": {"alpha": 0.95, "n_subsets": merges}, "units": {"max_upload_bytes": 10**9}})
        store = JobStore(connect(srv.url), "rec")
        store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {"job_dir": str(tmp / "job")})
        rng = np.random.default_rng(0)
        store.init_weights("0", rng.standard_normal(fp.n_params).astype(np.float32))
        snaps.take(store, "0")
        aof0 = aof_size(tmp / "redis")
        aof0_incr = sum(p.stat().st_size for p in aof_files(tmp / "redis")
                        if p.name == "appendonly.aof" or p.name.endswith(".incr.aof"))
        base = rng.standard_normal(fp.n_params).astype(np.float32)
        t0 = time.perf_counter()
        for i in range(merges):
            unit = f"u{i}"
            store.register_unit(unit, {"epoch": 1, "shard": i, "model": "0"}, 1)
            path = tmp / f"r{i}.h5"
            base[i % base.size] += 1.0  # every result differs
            write_weights(path, WeightsFile(base, fp, job="rec", model="0", unit=unit))
            out = assimilate_files(store, [path], spec, unit=unit)
            assert out.status == "merged", out
            path.unlink()  # the job system's cleanup: the retained name keeps the data
            if (i + 1) % 100 == 0:
                print(f"  {i + 1} merges ({time.perf_counter() - t0:.0f} s)", flush=True)
        per_merge = (aof_size(tmp / "redis") - aof0) / merges
        log_per_merge = log_bytes(tmp / "redis", {store.mlog_key("0").encode(), store.mrec_key("0").encode()},
                                  aof0_incr)[0] / merges
        inputs = sum(f.stat().st_size for f in (tmp / "job" / "durable" / "inputs" / "0").iterdir())
        before = store.snapshot("0").flat.tobytes()
        t_kill = time.perf_counter()
        srv.kill()
        srv.restart()
        t_up = time.perf_counter()
        after_store = JobStore(connect(srv.url), "rec")
        report = ensure_live(after_store, "0")
        after = after_store.snapshot("0").flat.tobytes()
        t_done = time.perf_counter()
    finally:
        srv.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    assert report is not None
    total = t_done - t_kill
    print(f"{merges} logged merges of {fp.n_params:,} parameters since the last snapshot: AOF growth "
          f"{per_merge:,.0f} bytes per merge, of which the merge log {log_per_merge:,.0f} (goal < 1 KB); "
          f"retained inputs {inputs / 1e9:.2f} GB")
    print(f"SIGKILL -> weights served again: {total:.1f} s (Redis restart {t_up - t_kill:.2f} s, replay of "
          f"{report.merges} merges {report.seconds:.1f} s = {report.seconds / (inputs / 1e9):.1f} s per GB of "
          f"retained input, {report.seconds / report.merges * 1000:.0f} ms per merge); bitwise identical: "
          f"{before == after}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    emit("recovery", merges=merges, params=fp.n_params, aof_bytes_per_merge=per_merge,
         log_bytes_per_merge=log_per_merge, input_gb=inputs / 1e9,
         kill_to_served_s=total, redis_restart_s=t_up - t_kill, replay_s=report.seconds,
         replay_s_per_gb=report.seconds / (inputs / 1e9), replay_ms_per_merge=report.seconds / report.merges * 1000,
         bitwise_identical=before == after, load=os.getloadavg(), **machine())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--recovery-merges", type=int, default=0)
    ap.add_argument("--params", type=int, default=4_972_746)
    args = ap.parse_args()
    if args.recovery_merges:
        recovery(args.recovery_merges, args.params)
        return
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
