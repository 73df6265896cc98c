"""Chaos: VC-ASGD on the local backend with hosts, assimilators and Redis killed for real.

The same job (examples/digits-vcasgd.yaml: digits, 4 hosts x 2 slots, 2 assimilators)
runs through ``run_job`` (the ``boinc-dl run`` path) three times in this script:

1. fault-free (the baseline);
2. chaos without notices: 30% of unit instances SIGKILLed mid-way (the host
   vanishes; the server re-issues at the deadline t_o), both assimilator processes
   SIGKILLed once each, Redis SIGKILLed once and restarted on its AOF;
3. the same chaos, with preemption notices (the client checkpoints and reports the
   unit lost; it is re-issued at once).

For each run: every workunit's result assimilated exactly once (checked against the
merge log — the ``metrics`` stream's ``merge`` entries — the assimilated marks and the
weights version), final validation accuracy, elapsed time; the figures to reach are
"job finishes, exactly once, accuracy within 2 points of the fault-free run", and the
slowdown is reported.

The example's deadline (60 s) is meant for real fleets; units here take one to a few
seconds, so the deadline is set to ``--timeout-s`` (default 20 s). The paper's ratio
t_o/t_e is about 2 (5 min / 2.4 min); on a loaded shared machine unit times swing
several-fold, and a tighter deadline re-issues units that are only slow (they come back
late and are deduplicated, but the extra instances load the machine further).

    python bench/bench_chaos.py [--spec examples/digits-vcasgd.yaml] [--epochs N] [--timeout-s T]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.common.spec import JobSpec, load_spec  # noqa: E402
from boinc_dl.server.work_generator.prepare import n_shards  # noqa: E402
from tests.support.audit import audit_job  # noqa: E402
from tests.support.chaos import ChaosMonkey, ChaosPlan  # noqa: E402

PLAN = ChaosPlan(kill_assimilators_at=[0.25, 0.6], restart_redis_at=[0.4], redis_down_s=1.0)


def run_once(spec: JobSpec, work: Path, label: str, search_path: Path, chaos: bool, notice: bool,
             preempt_prob: float) -> dict:
    """One run of ``spec`` through run_job on its own Redis; returns its figures."""
    from rich.console import Console

    from boinc_dl.server.run import run_job

    srv = EmbeddedRedis(work / label / "redis").start()
    total = n_shards(spec) * spec.training.epochs
    monkey = None
    opts: dict = {}
    if chaos:
        opts = {"preempt_prob": preempt_prob, "notice": notice}
        monkey = ChaosMonkey(srv, spec.name, total, PLAN, assimilators=spec.backend.local.assimilators)
        monkey.start()
    t0 = time.time()
    try:
        res = run_job(spec, work / label / "run", live=False, redis_url=srv.url, backend_opts=opts,
                      search_path=search_path, console=Console(file=open(os.devnull, "w")))  # noqa: SIM115
    finally:
        if monkey is not None:
            monkey.stop()
    elapsed = time.time() - t0
    store = JobStore(connect(srv.url), spec.name)
    audit = audit_job(store, n_subsets=n_shards(spec), epochs=spec.training.epochs)
    b = res.backend
    out = {
        "status": res.status, "elapsed_s": round(elapsed, 2),
        "final_val_acc": res.epochs[-1]["val_acc"] if res.epochs else None,
        "exactly_once": audit.ok, "audit": audit.as_dict(),
        "units": total, "instances_sent": b.get("sent", 0), "preempted": b.get("preempted", 0),
        "preempted_frac": round(b.get("preempted", 0) / max(1, b.get("sent", 1)), 3),
        "timed_out": b.get("timed_out", 0), "lost_reported": b.get("lost_reported", 0),
        "reissued": b.get("reissued", 0), "late_results": b.get("late_results", 0),
        "duplicates": b.get("duplicates", 0), "assimilator_restarts": b.get("assimilator_restarts", 0),
        "redelivered": b.get("redelivered", 0), "reissue_policy": spec.vcasgd.reissue,
        "regenerated": b.get("regenerated", 0), "regen_fallback": b.get("regen_fallback", 0),
        # time from losing a unit to its re-issue: by deadline (no_reply) or by notice (lost)
        "deadline_reissue_median_s": b.get("no_reply_reissue_s_median"),
        "notice_reissue_median_s": b.get("lost_reissue_s_median"),
        "notice_redispatch_median_s": b.get("lost_dispatch_s_median"),
        "kill_offset_mean_s": b.get("kill_offset_mean_s"),
    }
    if monkey is not None:
        out["faults"] = [{"t": round(t, 2), "what": w, "detail": d} for t, w, d in monkey.log.events]
        out["assimilators_killed"] = monkey.log.count("assimilator_killed")
        out["redis_restarts"] = monkey.log.count("redis_restarted")
    srv.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "digits-vcasgd.yaml"))
    ap.add_argument("--epochs", type=int, default=None, help="override training.epochs")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="deadline t_o (units.timeout_s)")
    ap.add_argument("--preempt-prob", type=float, default=0.3)
    ap.add_argument("--no-notice-run", action="store_true", help="skip the run with preemption notices")
    ap.add_argument("--reissue", choices=["fresh", "same"], default=None,
                    help="override vcasgd.reissue (default: the spec's)")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    upd: dict = {"units": spec.units.model_copy(update={"timeout_s": args.timeout_s})}
    if args.reissue:
        upd["vcasgd"] = spec.vcasgd.model_copy(update={"reissue": args.reissue})
    if args.epochs:
        upd["training"] = spec.training.model_copy(update={"epochs": args.epochs})
    spec = spec.model_copy(update=upd)
    search = Path(args.spec).resolve().parent
    with tempfile.TemporaryDirectory(prefix="bdl-chaos-") as tmp:
        work = Path(tmp)
        base = run_once(spec, work, "baseline", search, chaos=False, notice=False, preempt_prob=0.0)
        emit("chaos_baseline", spec=spec.name, epochs=spec.training.epochs, timeout_s=args.timeout_s, **base,
             **machine())
        runs = [("chaos_no_notice", False)] + ([] if args.no_notice_run else [("chaos_notice", True)])
        for name, notice in runs:
            r = run_once(spec, work, name, search, chaos=True, notice=notice, preempt_prob=args.preempt_prob)
            acc_diff = (r["final_val_acc"] - base["final_val_acc"]) if r["final_val_acc"] is not None else None
            emit(name, spec=spec.name, epochs=spec.training.epochs, timeout_s=args.timeout_s,
                 baseline_elapsed_s=base["elapsed_s"], baseline_val_acc=base["final_val_acc"],
                 slowdown=round(r["elapsed_s"] / base["elapsed_s"], 2),
                 acc_diff_points=round(100 * acc_diff, 2) if acc_diff is not None else None,
                 within_2_points=acc_diff is not None and abs(acc_diff) <= 0.02,
                 finished=r["status"] == "done", **r)


if __name__ == "__main__":
    main()
