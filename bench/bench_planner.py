"""The planner's predictions against measured runs of the local backend.

Each configuration is first PREDICTED (closed form and discrete-event simulation) and
then MEASURED: a real VC-ASGD job on the local backend — real slot processes, a real
Redis, real validation and strict merges of real weights files — at the paper's model
size (4,972,735 float32 parameters: an MLP 64-66303-10, eleven short of the VC-ASGD
paper's 4,972,746) and at a small one, with synthetic unit times per simulated instance
type and simulated preemption (vanish: a kill, re-issue at the deadline t_o).

Calibration happens in the same run, on configurations that are not validated:
per model size, the merge time of one assimilator and the speed-up of P = 2 and 4
(server-bound runs: tiny units, many hosts), and the per-unit staging cost and dispatch
latency (one client-bound run). The machine is shared and noisy; both the
calibration and the validation runs see the same noise.

Reported per configuration: predicted (simulation, the planner's answer where queues
form; closed form beside it), measured, error. Over all: MAPE, Spearman's rank
correlation, the pairs of configurations ordered as measured among those whose measured
times differ by more than their run-to-run spread (``--repeats``), the measurement's rank
agreement with its own repeats (the ceiling of any model's), and the regret of the
planner's recommendation — the cheapest predicted
configuration meeting a deadline (the median predicted time, fixed before measuring),
priced as simulated instance types — against the cheapest measured one that met it.

    python bench/bench_planner.py [--epochs 2] [--units 8] [--repeats 3] [--only fig3]

``--generated N`` is the other validation, the user's path end to end: real TensorFlow
units of the digits MLP (no synthetic times) run by the installed ``boinc-dl run``. Per
model size, one 1-slot run calibrates (``read_calibration`` on its run directory, exactly
what ``boinc-dl plan SPEC --calibrate RUN_DIR`` does); N configurations drawn by a
seeded generator over model size, C (workers), T (slots), P and unit size, none of them
a calibration run, are then predicted and measured (the run's pipeline epoch time,
``summary.json``'s ``actual_epoch_s``). Two predictions per configuration: the
local-backend plan (``boinc-dl plan SPEC``, :mod:`boinc_dl.server.planner.local`) and
the fleet model with a planner-only fleet file for this machine (``--fleet``).

    python bench/bench_planner.py --generated 12 [--seed 11] [--epochs 3] [--repeats 2] [--keep DIR] [--cal-runs 3]

``--cal-runs K`` calibrates each model size from K 1-slot runs pooled (``boinc-dl plan
--calibrate RUN1 --calibrate RUN2 ...``) and also scores the plan calibrated from the
first of them alone (``local1``) against the same measurements. ``--cal-crowd-slots N``
(default 2 x cores, as docs/planner.md tells a user) adds one run of 1 worker x N slots
per model size to the pool: it calibrates the contention term (a unit's CPU seconds grow
with the units running beside it); the plan from the 1-slot runs alone (g = 0, the model
before it) is scored too (``flat``). Each configuration's report has the other work
sampled before it (what the plan knew) and measured during it (the machine's busy CPU
less the run's own, over its wall time).

``--combine DIR DIR ...`` reports several ``--keep`` invocations of one seed as repeats
(each invocation short enough to run alone). With ``--repeats R`` each configuration is measured R times (in rounds: all once, then
again); its time is the median, and a pair counts as "beyond noise" when the gap of
their medians exceeds both configurations' measured spread ((max - min) / median) and
the median spread of all. With one run each, gaps under 10% are ties.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.planner.model import Config, HostType, ServerCosts, Workload, closed_form  # noqa: E402
from boinc_dl.server.planner.sim import simulate  # noqa: E402
from tests.support.harness import run_headless, small_spec  # noqa: E402

SIZES = {"small": 16, "large": 66303}  # MLP hidden units: 1,210 and 4,972,735 parameters
PARAMS = {"small": 64 * 16 + 16 + 16 * 10 + 10, "large": 64 * 66303 + 66303 + 66303 * 10 + 10}
# Simulated instance types: compute time of one unit alone, cores (processor sharing
# beyond them), and an hourly price to rank by dollars (g4dn.xlarge and c6i.xlarge spot).
FAST = HostType("fast", unit_s=1.0, cores=4)
SLOW = HostType("slow", unit_s=2.0, cores=2)
PRICE = {"fast": 0.21, "slow": 0.065}
TIMEOUT_S = 6.0
NOISE_FLOOR = 0.05  # with one run per configuration: gaps under 5% count as ties
CORES = os.cpu_count() or 1  # the host every slot, assimilator and Redis shares


@dataclass(frozen=True)
class Case:
    label: str
    size: str
    p_servers: int
    hosts: tuple[tuple[HostType, int], ...]
    slots: int
    preempt: float = 0.0


def cases() -> list[Case]:
    f, s = FAST, SLOW
    return [
        Case("L-P1C1T2", "large", 1, ((f, 1),), 2),
        Case("L-P1C2T2", "large", 1, ((f, 2),), 2),
        Case("L-P2C2T4", "large", 2, ((f, 2),), 4),
        Case("L-P4C4T4", "large", 4, ((f, 4),), 4),
        Case("L-P2C4T2-mix-p10", "large", 2, ((f, 2), (s, 2)), 2, 0.1),
        Case("L-P4C2T8-p20", "large", 4, ((f, 2),), 8, 0.2),
        Case("S-P1C2T1-slow", "small", 1, ((s, 2),), 1),
        Case("S-P2C2T4-mix", "small", 2, ((f, 1), (s, 1)), 4),
        Case("S-P4C4T4-p10", "small", 4, ((f, 4),), 4, 0.1),
        Case("S-P2C4T2-p20", "small", 2, ((f, 4),), 2, 0.2),
        # The VC-ASGD paper's Fig. 3 at the paper's model size: P=1, C=3, T in {2, 4, 8}; P=3 at T=8.
        Case("fig3-P1C3T2", "large", 1, ((f, 3),), 2),
        Case("fig3-P1C3T4", "large", 1, ((f, 3),), 4),
        Case("fig3-P1C3T8", "large", 1, ((f, 3),), 8),
        Case("fig3-P3C3T8", "large", 3, ((f, 3),), 8),
    ]


def measure(work: Path, label: str, size: str, p_servers: int, host_times: list[float], slots: int,
            units: int, epochs: int, preempt: float, seed: int) -> dict:
    """One real run; returns the time from all slots ready to the last merge, and the
    per-unit wall times the slots reported."""
    spec = small_spec(label, model_args={"hidden": SIZES[size]}, training={"epochs": epochs},
                      vcasgd={"n_subsets": units, "alpha": 0.5},
                      units={"timeout_s": TIMEOUT_S, "max_error_results": 8, "max_total_results": 16},
                      backend={"local": {"workers": len(host_times), "slots": slots,
                                         "assimilators": p_servers}}, seed=seed)
    srv = EmbeddedRedis(work / label / "redis").start()
    box: dict = {}

    def on_start(backend, gen) -> None:
        gen.evaluator()  # load TensorFlow and the model before the clock starts
        t_end = time.time() + 120
        while time.time() < t_end:
            with backend.lock:
                if all(s.ready for s in backend.slots) and all(a.ready for a in backend.assims):
                    break
            time.sleep(0.02)
        box["backend"], box["t_ready"] = backend, time.time()

    try:
        res = run_headless(spec, work / label / "run", srv.url, search_path=ROOT / "examples",
                           backend_opts={"synthetic_unit_s": host_times, "preempt_prob": preempt,
                                         "preempt_reissued": False, "seed": seed},
                           on_start=on_start, timeout_s=600)
        store = JobStore(connect(srv.url), spec.name)
        merges = sorted(m["t"] for m in store.metrics() if m["kind"] == "merge")
    finally:
        srv.stop()
    b = box["backend"]
    walls = list(b.unit_times)
    return {"status": res.status, "T_s": merges[-1] - box["t_ready"], "merges": merges, "t_ready": box["t_ready"],
            "unit_wall_s": walls, "kills": res.backend["preempted"], "slot_downtime_s": res.backend.get(
                "slot_downtime_median_s")}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_commit_s(work: Path, size: str, repeats: int = 16) -> float:
    """CPU seconds Redis spends committing one merge of this model size, the part of a
    merge it serves one at a time: the shards' ``SET``s in one ``MULTI``/``EXEC`` into a
    Redis with the local backend's settings (append-only file on), read from the Redis
    process's own CPU time (the client's packing and waiting are not Redis' work)."""
    from boinc_dl.server.assimilator.shards import ShardLayout, shards_for

    n = PARAMS[size]
    flat = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    lay = ShardLayout(n, shards_for(n))
    srv = EmbeddedRedis(work / f"commit-{size}").start()
    try:
        r = connect(srv.url)
        assert srv.pid is not None
        c0 = _cpu_s(srv.pid)
        for _ in range(repeats):
            p = r.pipeline(transaction=True)
            for i in range(lay.shards):
                p.set(f"c:{i}", memoryview(flat[lay.bounds(i)]).cast("B"))
            p.execute()
        return (_cpu_s(srv.pid) - c0) / repeats
    finally:
        srv.kill()


def calibrate(work: Path, size: str, args: argparse.Namespace) -> dict[str, ServerCosts]:
    """Calibrate both models at this model size on four runs that are never validated.

    * ``cal-*-client`` (2 hosts x 1 slot of 0.5 s units, P = 4: client-bound): staging is
      the slots' wall time beyond the sleep; dispatch latency the job's residual;
    * ``cal-*-P1``, ``-P2``, ``-P4`` (4 hosts x 1 slot of 0.02 s units: server-bound).

    The plain model takes one merge's time from the P = 1 merge rate and the speed-up of
    P = 2, 4 from the rate ratios, and a dispatch latency from the client-bound run's
    residual, as before. The resource-sharing model instead knows the host's cores and
    finds the CPU seconds of a merge (alone at P = 1: ``cal-*-P1``; shared at P = 2:
    ``cal-*-P2``) and of the generator's creation of a unit (``cal-*-client``) for which
    its own simulation reproduces those runs (a joint least-squares fit); ``cal-*-P4`` is
    left out of the fit as its check. Redis' share of a merge, which it serves one
    commit at a time, is measured directly (:func:`measure_commit_s`) and not fitted.
    """
    runs, rate = {}, {}
    for p in (1, 2, 4):
        # Server-bound: 4 hosts x 1 slot of 0.02 s units keep P assimilators busy.
        r = measure(work, f"cal-{size}-P{p}", size, p, [0.02] * 4, 1, 16, 1, 0.0, args.seed)
        runs[p] = r
        ts = r["merges"]
        rate[p] = (len(ts) - 1) / (ts[-1] - ts[0])
    merge_s = 1 / rate[1]
    speedup = {p: rate[p] / rate[1] for p in rate}
    sleep = 0.5
    rc = measure(work, f"cal-{size}-client", size, 4, [sleep, sleep], 1, 8, 1, 0.0, args.seed)
    stage = max(0.0, statistics.median(rc["unit_wall_s"]) - sleep)

    def cal_cfg(p: int, unit_s: float, hosts: int) -> Config:
        return Config(((HostType("cal", unit_s, cores=1, bandwidth_mbps=1e9), hosts),), 1, p)

    def sim(costs: ServerCosts, cfg: Config, units: int) -> float:
        return simulate(cfg, Workload(units, 1, PARAMS[size]), costs, reps=20, seed=args.seed).job_s

    # The plain model, as before: dispatch from the client-bound run's residual.
    base = ServerCosts(merge_s, speedup, stage_s=stage, dispatch_s=0.0)
    dispatch = max(0.0, (rc["T_s"] - sim(base, cal_cfg(4, sleep, 2), 8)) / 4)  # 4 dispatches per slot
    plain = replace(base, dispatch_s=dispatch)
    # The resource-sharing model: fit its own parameters to the same runs.
    commit = measure_commit_s(work, size)
    shared = ServerCosts(merge_s, {}, stage_s=stage, dispatch_s=0.0, cpu_cores=CORES,
                         merge_shared_s=merge_s / max(speedup[2], 0.05) * min(2, CORES), colocated=True,
                         create_s=0.5 * merge_s, commit_s=commit)
    # Least squares of the log errors over the three runs, all three parameters at once
    # (Nelder-Mead in log space): each run mixes them (creation is in every unit's path).
    from scipy.optimize import minimize

    def loss(x: list[float]) -> float:
        c = replace(shared, merge_s=math.exp(x[0]), merge_shared_s=math.exp(x[1]), create_s=math.exp(x[2]))
        err = [math.log(sim(c, cal_cfg(p, 0.02, 4), 16) / runs[p]["T_s"]) for p in (1, 2)]
        err.append(math.log(sim(c, cal_cfg(4, sleep, 2), 8) / rc["T_s"]))
        return sum(e * e for e in err)

    x0 = [math.log(0.6 * merge_s), math.log(0.8 * merge_s), math.log(0.4 * merge_s)]
    x = minimize(loss, x0, method="Nelder-Mead", options={"xatol": 1e-3, "fatol": 1e-7, "maxiter": 400}).x
    shared = replace(shared, merge_s=math.exp(x[0]), merge_shared_s=math.exp(x[1]), create_s=math.exp(x[2]))
    check = {f"cal-{size}-P{p}": {"measured_s": round(runs[p]["T_s"], 3),
                                  "sharing_s": round(sim(shared, cal_cfg(p, 0.02, 4), 16), 3)} for p in (1, 2, 4)}
    check[f"cal-{size}-client"] = {"measured_s": round(rc["T_s"], 3),
                                   "sharing_s": round(sim(shared, cal_cfg(4, sleep, 2), 8), 3)}
    emit("planner_calibration", size=size, params=PARAMS[size], cores=CORES,
         plain={"merge_s": round(merge_s, 4), "speedup": {str(k): round(v, 3) for k, v in speedup.items()},
                "stage_s": round(stage, 4), "dispatch_s": round(dispatch, 4)},
         sharing={"merge_cpu_s": round(shared.merge_s, 4), "merge_shared_cpu_s": round(shared.merge_shared_s or 0, 4),
                  "stage_cpu_s": round(stage, 4), "create_cpu_s": round(shared.create_s, 4),
                  "commit_s": round(commit, 4)},
         calibration_runs=check, load=os.getloadavg()[0])
    return {"plain": plain, "sharing": shared}


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


GEN_SIZES = (128, 512)  # MLP hidden units of the generated configurations
GEN_NOISE = 0.10  # one run per configuration: measured gaps under 10% count as ties


def generate(n: int, seed: int) -> list[dict]:
    """``n`` distinct configurations (hidden, C, T, P, units per epoch), seeded; never the
    calibration's shape (C = T = P = 1)."""
    import random

    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        c = {"hidden": rng.choice(GEN_SIZES), "workers": rng.randint(1, 3), "slots": rng.randint(1, 2),
             "units": rng.choice((4, 6, 8, 12))}
        c["assimilators"] = rng.randint(1, min(2, c["workers"] * c["slots"]))
        if c["workers"] * c["slots"] == 1 or c in out:
            continue
        out.append(c)
    return out


def _gen_spec(work: Path, label: str, c: dict, epochs: int) -> Path:
    import yaml

    p = work / f"{label}.yaml"
    p.write_text(yaml.safe_dump({
        "name": label, "mode": "vcasgd", "model": "models:mlp",
        "model_args": {"input_dim": 64, "hidden": c["hidden"], "n_classes": 10},
        "dataset": {"name": "digits", "val_fraction": 0.2},
        "training": {"epochs": epochs, "batch_size": 16, "learning_rate": 0.002, "local_epochs": 4},
        "vcasgd": {"n_subsets": c["units"]}, "units": {"timeout_s": 60},
        "backend": {"kind": "local", "local": {"workers": c["workers"], "slots": c["slots"],
                                               "assimilators": c["assimilators"], "threads_per_slot": 1}},
        "seed": 7}))
    return p


def _gen_run(work: Path, label: str, c: dict, epochs: int) -> dict:
    """``boinc-dl run`` as a user runs it; its summary's pipeline epoch time."""
    import json
    import shutil
    import subprocess

    shutil.copy(ROOT / "examples" / "models.py", work / "models.py")
    spec = _gen_spec(work, label, c, epochs)
    run_dir = work / label
    exe = Path(sys.executable).parent / "boinc-dl"
    t0 = time.time()
    busy0 = _busy_cpu_s()
    proc = subprocess.Popen(["nice", str(exe), "run", str(spec), "--run-dir", str(run_dir), "-q"], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    tree = _TreeCpu(proc.pid)
    tree.start()
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        tree.stop()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{label}: boinc-dl run failed: {out.stderr[-2000:]}")
    wall = time.time() - t0
    # Other work during the run: the machine's busy CPU seconds less the run's own (every
    # process of its tree, sampled while alive), over the run's wall time. Not what the plan
    # knew (it samples 1 s before): what the run met.
    other = max(0.0, (_busy_cpu_s() - busy0) - tree.cpu_s()) / wall if wall > 0 else 0.0
    summ = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": run_dir, "epoch_s": float(summ["planner"]["actual_epoch_s"]),
            "after_the_fact_s": float(summ["planner"]["predicted_epoch_s"]), "wall_s": wall,
            "background_during": other}


def _busy_cpu_s() -> float:
    """CPU seconds this machine has been busy (all cores, /proc/stat: not idle or iowait)."""
    try:
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(parts[:7]) - parts[3] - parts[4]) / os.sysconf("SC_CLK_TCK")


class _TreeCpu:
    """CPU seconds of a process and all its descendants, sampled from /proc every 0.2 s
    while they live (the last seen value of each; one that lives under 0.2 s is missed).
    Reaped-children rusage is not enough: slot processes that are killed and left to
    init at the run's exit are never reaped by it (measured: 0.7-0.9 cores "other" on a
    quiet machine that way)."""

    def __init__(self, root: int) -> None:
        import threading

        self.root, self.seen, self.known = root, {}, {root}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        tck = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parent[int(d)] = int(rest[1])
            cpu[int(d)] = (int(rest[11]) + int(rest[12])) / tck  # utime + stime
        grew = True
        while grew:  # the tree: known processes and their children, transitively
            new = {p for p, pp in parent.items() if pp in self.known and p not in self.known}
            self.known |= new
            grew = bool(new)
        for p in self.known:
            if p in cpu:
                self.seen[p] = max(self.seen.get(p, 0.0), cpu[p])

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_s(self) -> float:
        return sum(self.seen.values())


def main_generated(args: argparse.Namespace) -> None:
    from boinc_dl.server.planner.calibrate import read_calibration, read_calibrations
    from boinc_dl.server.planner.fleetfile import parse_fleet
    from boinc_dl.server.planner.local import LocalCandidate, background_load, predict, this_machine
    from boinc_dl.server.planner.prices import TablePriceBook
    from boinc_dl.server.planner.search import Candidate, Planner, Space

    t_bench = time.time()
    machine_ = this_machine()
    n_train, local_epochs = 1437, 4  # digits with val_fraction 0.2
    configs = generate(args.generated, args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bdl-plan-gen-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cals, cals1, flats = {}, {}, {}
        for h in sorted({c["hidden"] for c in configs}):
            # The calibration run: 1 worker x --cal-slots slots, P = 1, 4 units per epoch.
            cal_cfg = {"hidden": h, "workers": 1, "slots": args.cal_slots, "assimilators": 1, "units": 4}
            dirs = []
            for k in range(args.cal_runs):
                # At rest too: CPU seconds per unit are not load-free here. Calibrated right
                # after another run (seed 11, 2026-11-26) they read ~30% above the same units'
                # a few minutes later, and every plan over-predicted by 15-41%.
                time.sleep(3.0)
                cal_busy = background_load()
                for _ in range(30):  # wait (up to ~1 min) for the machine to be at rest
                    if cal_busy < 0.2:
                        break
                    time.sleep(1.0)
                    cal_busy = background_load()
                name = f"cal-h{h}" if args.cal_slots == 1 else f"cal{args.cal_slots}-h{h}"
                m = _gen_run(work, name + (f"-{k}" if k else ""), cal_cfg, 2)
                dirs.append(m["run_dir"])
                one = read_calibration(m["run_dir"])  # what `boinc-dl plan --calibrate RUN_DIR` reads
                emit("planner_gen_calibration", hidden=h, slots=args.cal_slots, run=k, units=one.units,
                     background=round(cal_busy, 2),
                     first_step_s=round(one.first_step_s, 4),
                     compute_us_per_example=round(one.compute_per_example_s * 1e6, 2),
                     overhead_s=round(one.overhead_s, 4), merge_ms=round((one.merge_s or 0) * 1e3, 2),
                     commit_ms=round((one.commit_s or 0) * 1e3, 3), eval_s=round(one.eval_s, 3),
                     median_unit_wall_s=round(one.wall_s, 3), measured_epoch_s=m["epoch_s"])
            cals1[h] = read_calibration(dirs[0])
            flats[h] = read_calibrations(dirs)  # the 1-slot runs pooled: no contention term (g = 0)
            if args.cal_crowd_slots > 1:
                # The contention run docs/planner.md asks for: 1 worker x 2 x cores slots,
                # two units per slot and epoch (each slot's first unit traces the model and
                # is left out of the fit).
                n = args.cal_crowd_slots
                crowd = {"hidden": h, "workers": 1, "slots": n, "assimilators": 1, "units": 2 * n}
                time.sleep(3.0)
                m = _gen_run(work, f"cal-crowd{n}-h{h}", crowd, 2)
                dirs.append(m["run_dir"])
            cals[h] = read_calibrations(dirs)  # `--calibrate RUN1 --calibrate RUN2 ...`: pooled
            emit("planner_gen_contention", hidden=h, runs=len(dirs), g=round(cals[h].contention.g, 4),
                 units=cals[h].contention.units, max_running=round(cals[h].contention.max_running, 2),
                 note=cals[h].contention.describe())
        for i, c in enumerate(configs):
            label = f"g{i:02d}-h{c['hidden']}-C{c['workers']}T{c['slots']}P{c['assimilators']}-u{c['units']}"
            cal = cals[c["hidden"]]
            params = 64 * c["hidden"] + c["hidden"] + c["hidden"] * 10 + 10
            cand = LocalCandidate(c["workers"], c["slots"], c["assimilators"], c["units"])
            # What `boinc-dl plan` measures: other work on this machine now; 3 s after the
            # previous run (sampled at once, it read ~1 busy core every time while the runs'
            # own units showed no other work: CPU/wall 0.95 on 2 slots).
            time.sleep(3.0)
            busy = background_load()
            local = predict(cal, cand, replace(machine_, background=busy), epochs=args.epochs, params=params, n_train=n_train,
                            local_epochs=local_epochs, timeout_s=60.0)
            local1 = predict(cals1[c["hidden"]], cand, replace(machine_, background=busy), epochs=args.epochs,
                             params=params, n_train=n_train, local_epochs=local_epochs, timeout_s=60.0)
            flat = predict(flats[c["hidden"]], cand, replace(machine_, background=busy), epochs=args.epochs,
                           params=params, n_train=n_train, local_epochs=local_epochs, timeout_s=60.0)
            # The fleet model with a planner-only fleet file for this machine (the path).
            ff = parse_fleet({"types": {"c6i.xlarge": {"speed": 1.0, "cores": machine_.cores, "max_count": 3,
                                                 "preempt_p": 0.0, "bandwidth_mbps": 1e6}},
                              "markets": ["on-demand"], "costs": {"server_cores": machine_.cores}}, None)
            examples = n_train / c["units"] * local_epochs
            hosts, _ = ff.host_types(cal.unit_compute_s(examples))
            w = Workload(c["units"], args.epochs, params, base_units_per_epoch=c["units"])
            costs = replace(ff.server_costs(w.model_bytes(), cal), background=busy)
            space = Space(tuple(hosts), (3,), ("on-demand",), (c["slots"],), (c["assimilators"],), (c["units"],),
                          None, 60.0)
            planner = Planner(space, w, costs, TablePriceBook.load())
            fleet = planner.score(Candidate((c["workers"],), "on-demand", c["slots"], c["assimilators"],
                                            c["units"]), "simulation").pred
            m = _gen_run(work, label, c, args.epochs)  # predicted first, then measured
            rows.append({"label": label, **c, "local_s": round(local.pred.epoch_s, 3), "local_bound": local.bound,
                         **({"local1_s": round(local1.pred.epoch_s, 3)} if args.cal_runs > 1 else {}),
                         **({"flat_s": round(flat.pred.epoch_s, 3)} if args.cal_crowd_slots > 1 else {}),
                         "fleet_s": round(fleet.epoch_s, 3), "background": round(busy, 2), "runs": [m]})
        # Repeats in rounds (every configuration once, then again), so that a slow drift
        # of the machine shows in each configuration's spread.
        for r in range(1, args.repeats):
            for c, row in zip(configs, rows, strict=True):
                row["runs"].append(_gen_run(work, f"{row['label']}-r{r}", c, args.epochs))
        for row in rows:
            runs = row.pop("runs")
            ts = [m["epoch_s"] for m in runs]
            meas_s = statistics.median(ts)
            row.update(measured_s=round(meas_s, 3), measured_runs_s=[round(t, 3) for t in ts],
                       spread=round((max(ts) - min(ts)) / meas_s, 4),
                       local_err=round(row["local_s"] / meas_s - 1, 3), fleet_err=round(row["fleet_s"] / meas_s - 1, 3),
                       after_the_fact_err=round(statistics.median(m["after_the_fact_s"] for m in runs) / meas_s - 1, 3),
                       run_wall_s=round(runs[0]["wall_s"], 1), load=round(os.getloadavg()[0], 2),
                       background_during=round(statistics.median(m["background_during"] for m in runs), 2))
            emit("planner_gen_case", **row)
    if args.keep:  # for --combine: this invocation's predictions and measurements
        import json

        (Path(args.keep) / "cases.json").write_text(json.dumps({"seed": args.seed, "epochs": args.epochs,
                                                                 "rows": rows}, indent=1))
    report_generated(rows, args, time.time() - t_bench)


def report_generated(rows: list[dict], args: argparse.Namespace, wall_s: float) -> None:
    """MAPE, pairs beyond noise, Spearman and regret of the local plan and the fleet model."""
    meas = [r["measured_s"] for r in rows]
    repeats = min(len(r["measured_runs_s"]) for r in rows)
    # The noise a pair's gap is judged against: with repeats, the measured run-to-run
    # spread of both configurations and at least the median spread of all (two runs
    # can agree by chance); with one run each, a fixed GEN_NOISE.
    floor = statistics.median(r["spread"] for r in rows) if repeats > 1 else GEN_NOISE

    def beyond(i: int, j: int, noise: float | None = None) -> bool:
        tie = noise if noise is not None else max(floor, rows[i]["spread"], rows[j]["spread"]) \
            if repeats > 1 else GEN_NOISE
        return abs(meas[i] - meas[j]) > tie * min(meas[i], meas[j])

    summary = {}
    for key in ("local", "fleet", *(("local1",) if all("local1_s" in r for r in rows) else ()),
                *(("flat",) if all("flat_s" in r for r in rows) else ())):
        pred = [r[f"{key}_s"] for r in rows]
        mape = statistics.fmean(abs(p / m - 1) for p, m in zip(pred, meas, strict=True))
        pairs = [(i, j) for i, j in itertools.combinations(range(len(rows)), 2) if beyond(i, j)]
        ok = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in pairs)
        ten = [(i, j) for i, j in itertools.combinations(range(len(rows)), 2) if beyond(i, j, GEN_NOISE)]
        ok10 = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in ten)
        pick = min(range(len(rows)), key=lambda k: pred[k])
        summary[key] = {"mape": round(mape, 4), "spearman": round(spearman(pred, meas), 3),
                        "pairs_beyond_noise": len(pairs), "pairs_ordered": ok,
                        "pairs_beyond_10pct": len(ten), "pairs_ordered_10pct": ok10,
                        "recommended": rows[pick]["label"], "regret": round(meas[pick] / min(meas) - 1, 4)}
    att = statistics.fmean(abs(r["after_the_fact_err"]) for r in rows)
    emit("planner_generated", configs=len(rows), seed=args.seed, epochs=args.epochs, repeats=repeats,
         noise_floor=round(floor, 4), median_spread=round(statistics.median(r["spread"] for r in rows), 4),
         max_spread=round(max(r["spread"] for r in rows), 4),
         local=summary["local"], fleet=summary["fleet"],
         **({"local_first_calibration_only": summary["local1"]} if "local1" in summary else {}),
         **({"local_without_contention": summary["flat"]} if "flat" in summary else {}),
         after_the_fact_mape=round(att, 4),
         bench_wall_s=round(wall_s, 1), load=os.getloadavg(), **machine())
    print(f"{'configuration':36s} {'measured':>9s} {'spread':>7s} {'local plan':>11s} {'err':>6s} "
          f"{'fleet model':>11s} {'err':>6s} {'bg before':>9s} {'during':>6s}")
    for r in rows:
        first = f"   first calibration alone {r['local1_s'] / r['measured_s'] - 1:+.0%}" if "local1_s" in r else ""
        flat = f"   without contention {r['flat_s'] / r['measured_s'] - 1:+.0%}" if "flat_s" in r else ""
        print(f"{r['label']:36s} {r['measured_s']:8.3f}s {r['spread']:7.1%} {r['local_s']:10.3f}s "
              f"{r['local_err']:+6.0%} {r['fleet_s']:10.3f}s {r['fleet_err']:+6.0%} {r['background']:9.2f} "
              f"{r.get('background_during', float('nan')):6.2f}{flat}{first}")
    for key, v in summary.items():
        print(f"{key}: MAPE {v['mape']:.1%}, Spearman {v['spearman']}, {v['pairs_ordered']} of "
              f"{v['pairs_beyond_noise']} pairs beyond noise ordered ({v['pairs_ordered_10pct']} of "
              f"{v['pairs_beyond_10pct']} beyond 10%), recommended {v['recommended']}, regret {v['regret']:.1%}")


def combine_generated(args: argparse.Namespace) -> None:
    """Several --keep invocations of the same seed as repeats: the first one's predictions
    (made before it measured), each configuration's median over all of them."""
    import json

    runs = [json.loads((Path(d) / "cases.json").read_text()) for d in args.combine]
    if len({(r["seed"], r["epochs"]) for r in runs}) != 1:
        raise SystemExit("--combine: the invocations differ in seed or epochs")
    args.seed, args.epochs = runs[0]["seed"], runs[0]["epochs"]
    rows = []
    for row, *others in zip(*(r["rows"] for r in runs), strict=True):
        ts = [t for x in (row, *others) for t in x["measured_runs_s"]]
        m = statistics.median(ts)
        rows.append({**row, "measured_s": round(m, 3), "measured_runs_s": ts,
                     "spread": round((max(ts) - min(ts)) / m, 4), "local_err": round(row["local_s"] / m - 1, 3),
                     "fleet_err": round(row["fleet_s"] / m - 1, 3)})
    report_generated(rows, args, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--units", type=int, default=8, help="units per epoch")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--only", default="", help="run only cases whose label contains this")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per validation configuration "
                    "(median; their spread is the noise the ranks are judged against)")
    ap.add_argument("--generated", type=int, default=0, help="instead: N seeded configurations of real units, "
                    "calibrated from 1-slot runs' units.csv (module docstring)")
    ap.add_argument("--cal-slots", type=int, default=1, help="--generated: slots of the calibration runs (1 worker)")
    ap.add_argument("--cal-runs", type=int, default=1, help="--generated: calibration runs per model size, pooled "
                    "(the first one's plan alone is scored too, as local1)")
    ap.add_argument("--cal-crowd-slots", type=int, default=2 * (os.cpu_count() or 1),
                    help="--generated: slots of the one contention calibration run per model size, pooled with "
                    "the 1-slot runs (docs/planner.md; default 2 x cores; 1: none, the plan without contention "
                    "is then all)")
    ap.add_argument("--keep", default="", help="--generated: keep the runs (specs, run directories) in this directory")
    ap.add_argument("--combine", nargs="+", default=[], help="instead: report --keep directories of the same "
                    "--generated seed as repeats (the first one's predictions, the median measured)")
    args = ap.parse_args()
    if args.combine:
        combine_generated(args)
        return
    if args.generated:
        if "--epochs" not in sys.argv:
            args.epochs = 3
        if "--seed" not in sys.argv:
            args.seed = 11
        main_generated(args)
        return
    t_bench = time.time()
    todo = [c for c in cases() if args.only in c.label]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bdl-plan-") as tmp:
        work = Path(tmp)
        costs = {size: calibrate(work, size, args) for size in sorted({c.size for c in todo})}
        for c in todo:
            cfg = Config(tuple((replace(h, bandwidth_mbps=1e9, preempt_p=c.preempt), n) for h, n in c.hosts),
                         c.slots, c.p_servers, timeout_s=TIMEOUT_S)
            w = Workload(args.units, args.epochs, PARAMS[c.size])
            cs = costs[c.size]
            sim = simulate(cfg, w, cs["sharing"], reps=20, seed=args.seed).job_s
            cf = closed_form(cfg, w, cs["sharing"]).job_s
            plain = simulate(cfg, w, cs["plain"], reps=20, seed=args.seed).job_s
            plain_cf = closed_form(cfg, w, cs["plain"]).job_s
            times = [h.unit_s * max(1.0, c.slots / h.cores) for h in cfg.host_list()]
            reps = [measure(work, f"{c.label}-r{k}", c.size, c.p_servers, times, c.slots, args.units, args.epochs,
                            c.preempt, args.seed + k) for k in range(args.repeats)]
            r = reps[0]
            hourly = sum(PRICE[h.name] * n for h, n in c.hosts)
            ts = [x["T_s"] for x in reps]
            meas = statistics.median(ts)
            spread = (max(ts) - min(ts)) / meas  # run-to-run noise of this configuration
            row = {"config": c.label, "role": "validation", "size": c.size, "P": c.p_servers, "C": cfg.n_hosts,
                   "T": c.slots, "CxT": cfg.total_slots, "p": c.preempt, "predicted_s": round(sim, 3),
                   "closed_form_s": round(cf, 3), "plain_s": round(plain, 3), "plain_closed_form_s": round(plain_cf, 3),
                   "measured_s": round(meas, 3), "error": round(sim / meas - 1, 4),
                   "closed_form_error": round(cf / meas - 1, 4), "plain_error": round(plain / meas - 1, 4),
                   "plain_closed_form_error": round(plain_cf / meas - 1, 4),
                   "measured_runs_s": [round(t, 3) for t in ts], "spread": round(spread, 4),
                   "kills": sum(x["kills"] for x in reps), "status": r["status"], "hourly": hourly,
                   "load": os.getloadavg()[0]}
            rows.append(row)
            emit("planner_case", **row)

    def mape(key: str) -> float:
        return round(statistics.fmean(abs(r[key]) for r in rows), 4)

    def rho(key: str) -> float | None:
        return round(spearman([r[key] for r in rows], [r["measured_s"] for r in rows]), 4) if len(rows) > 2 else None

    def pairs(key: str) -> dict[str, int]:
        """Pairs of configurations ordered as measured, among those whose measured times
        differ by more than both configurations' run-to-run spread (the rest are ties
        within noise: no model can be held to their order)."""
        ok = n = 0
        for a, b in itertools.combinations(rows, 2):
            gap = abs(a["measured_s"] - b["measured_s"]) / min(a["measured_s"], b["measured_s"])
            if gap <= max(a["spread"], b["spread"], NOISE_FLOOR):
                continue
            n += 1
            ok += (a[key] < b[key]) == (a["measured_s"] < b["measured_s"])
        return {"ordered": ok, "of": n}

    def self_agreement() -> dict[str, object]:
        """The measurement against its own repeats: Spearman between repeat i's and repeat
        j's times over all configurations, and whether they rank them identically. The
        ceiling of any model's rank agreement with one measured run: ranks that differ
        between two runs of the same configurations cannot all be predicted."""
        k = min(len(r["measured_runs_s"]) for r in rows)
        out: list[dict[str, object]] = []
        for i, j in itertools.combinations(range(k), 2):
            a = [r["measured_runs_s"][i] for r in rows]
            b = [r["measured_runs_s"][j] for r in rows]
            out.append({"runs": [i, j], "spearman": round(spearman(a, b), 4),
                        "identical_ranks": list(np.argsort(a)) == list(np.argsort(b))})
        return {"pairs_of_runs": out,
                "identical": sum(bool(x["identical_ranks"]) for x in out), "of": len(out),
                "model_spearman_per_run": [round(spearman([r["predicted_s"] for r in rows],
                                                          [r["measured_runs_s"][i] for r in rows]), 4)
                                           for i in range(k)]}

    # The recommendation: cheapest predicted within a deadline fixed before measuring.
    deadline = statistics.median(r["predicted_s"] for r in rows)
    cost = {r["config"]: (r["hourly"] * r["predicted_s"], r["hourly"] * r["measured_s"]) for r in rows}
    ok_pred = [r for r in rows if r["predicted_s"] <= deadline]
    ok_meas = [r for r in rows if r["measured_s"] <= deadline]
    pick = min(ok_pred, key=lambda r: cost[r["config"]][0])
    best = min(ok_meas, key=lambda r: cost[r["config"]][1]) if ok_meas else None
    regret = cost[pick["config"]][1] / cost[best["config"]][1] - 1 if best else None
    fig3 = {r["config"]: r for r in rows if r["config"].startswith("fig3")}
    fig3_out = {}
    if len(fig3) == 4:
        t2, t4, t8, p3 = (fig3[f"fig3-{k}"] for k in ("P1C3T2", "P1C3T4", "P1C3T8", "P3C3T8"))
        for key in ("predicted_s", "plain_s", "measured_s"):
            fig3_out[key.rsplit("_", 1)[0]] = {"T4_faster_than_T2": t4[key] < t2[key],
                                               "T8_slower_than_T4": t8[key] > t4[key],
                                               "P3_fixes_T8": p3[key] < t8[key]}
    emit("planner_validation", configs=len(rows), calibration_configs=sorted(f"cal-{z}-{k}" for z in costs
                                                                       for k in ("P1", "P2", "P4", "client")),
         mape=mape("error"), closed_form_mape=mape("closed_form_error"), plain_mape=mape("plain_error"),
         plain_closed_form_mape=mape("plain_closed_form_error"),
         spearman=rho("predicted_s"), closed_form_spearman=rho("closed_form_s"), plain_spearman=rho("plain_s"),
         pairs_beyond_noise=pairs("predicted_s"), plain_pairs_beyond_noise=pairs("plain_s"), repeats=args.repeats,
         measured_self_agreement=self_agreement() if len(rows) > 2 and args.repeats > 1 else None,
         deadline_s=round(deadline, 2), recommended=pick["config"], best_measured=best["config"] if best else None,
         recommended_met_deadline=pick["measured_s"] <= deadline,
         regret=round(regret, 4) if regret is not None else None, fig3=fig3_out,
         bench_wall_s=round(time.time() - t_bench, 1), load=os.getloadavg(), **machine())


if __name__ == "__main__":
    main()
