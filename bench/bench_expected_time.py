"""The VC-ASGD paper's expected-time model under preemption, measured.

"Distributed Deep Learning Using Volunteer Computing-Like Paradigm" (section IV-E)
models instance terminations as Bernoulli trials: with kill probability p, a subtask
that times out costs t_o more, and the expected training time is

    T(p) = n*t_e + n*p*t_o,      n = n_s / (n_c * n_tc)

with n_s subtasks in the job, n_c client instances and n_tc simultaneous subtasks per
instance. This script measures T(p) on the local backend with synthetic units (a
sleep of fixed length through the whole real pipeline: workunit files, slots, result
files, validation, merges in Redis, deadlines, SIGKILLed slots), for p in {0.05, 0.2}:

* the baseline run (p = 0) measured in the same script gives n*t_e (so t_e is the
  effective time per subtask and slot, overheads included);
* a unit's host is killed mid-unit with probability p; as in the paper's model, only
  a unit's first instance may be killed (the rescheduled one completes);
  ``--rekill`` kills re-issued instances too, and the model's p becomes the expected
  number of timeouts per subtask, p/(1-p);
* the prediction is checked against the measured time (figure to reach: within 15%),
  both with the expected number of kills n_s*p and with the number that happened;
* with preemption notices, the n*p*t_o term shrinks: a lost unit costs the work done
  before the notice (the kill comes at 10-90% of a unit; the mean is measured) plus the
  notice-to-re-dispatch latency, both measured per unit by the job system; the model is
  n*t_e + n*p*(kill offset + latency). An upper bound replaces the latency by the host's
  whole downtime (notice, report, replacement host started).

Why the model holds here: the generator keeps at most as many units in flight as there
are slots (``vcasgd.window`` defaults to the slot count, for the freshest weights), so a
lost unit holds one window place for t_o and one slot idles, exactly the paper's
accounting. Slot utilisation is reported too: the pipeline between a merge and the next
dispatch leaves slots idle on a loaded machine, which is part of the measured t_e.

    python bench/bench_expected_time.py [--te 0.5] [--to 3.0] [--epochs 10] [--subsets 16] [--reps 3] [--rekill]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from tests.support.audit import audit_job  # noqa: E402
from tests.support.harness import run_headless, small_spec  # noqa: E402

HOSTS, SLOTS = 4, 2


def run(work: Path, label: str, args: argparse.Namespace, p: float, mode: str) -> dict:
    spec = small_spec(label, training={"epochs": args.epochs}, vcasgd={"n_subsets": args.subsets},
                      units={"timeout_s": args.to, "max_error_results": 8, "max_total_results": 16},
                      backend={"local": {"workers": HOSTS, "slots": SLOTS, "assimilators": 2}},
                      seed=args.seed)
    srv = EmbeddedRedis(work / label / "redis").start()
    try:
        res = run_headless(spec, work / label / "run", srv.url, search_path=ROOT / "examples",
                           backend_opts={"synthetic_unit_s": args.te, "preempt_prob": p, "preempt_mode": mode,
                                         "preempt_reissued": args.rekill, "seed": args.seed},
                           timeout_s=3600)
        audit = audit_job(JobStore(connect(srv.url), spec.name), n_subsets=args.subsets, epochs=args.epochs)
    finally:
        srv.stop()
    b = res.backend
    delays = [d["reissue_s"] for d in res.reissue_delays]
    dispatch = [d["dispatch_s"] for d in res.reissue_delays if "dispatch_s" in d]
    return {"status": res.status, "T_s": res.elapsed_s, "exactly_once": audit.ok, "kills": b["preempted"],
            "timed_out": b["timed_out"], "lost_reported": b["lost_reported"], "sent": b["sent"],
            "reissue_median_s": statistics.median(delays) if delays else None,
            "dispatch_median_s": statistics.median(dispatch) if dispatch else None,
            "reissue_max_s": max(delays) if delays else None, "kill_offset_mean_s": b["kill_offset_mean_s"],
            "downtime_median_s": b["slot_downtime_median_s"],
            "slot_utilisation": b["slot_busy_s"] / max(1e-9, b["elapsed_s"] * b["slots"])}


# One repetition: a baseline on each side of the faulty runs, so that each faulty run is
# compared with the mean of the two baselines measured around it (load drifts).
ORDER = [("base", 0.0, "vanish"), ("p5-vanish", 0.05, "vanish"), ("p20-vanish", 0.2, "vanish"),
         ("p5-notice", 0.05, "notice"), ("p20-notice", 0.2, "notice"), ("base", 0.0, "vanish")]
CONFIGS = [c for c in ORDER[1:-1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--te", type=float, default=0.5, help="synthetic unit length (s)")
    ap.add_argument("--to", type=float, default=3.0, help="deadline t_o (s)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--subsets", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (each with its own baselines)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--rekill", action="store_true", help="re-issued instances may be killed too")
    args = ap.parse_args()
    n_s = args.epochs * args.subsets
    n = n_s / (HOSTS * SLOTS)
    reps: list[dict[str, list[dict]]] = []
    with tempfile.TemporaryDirectory(prefix="bdl-etime-") as tmp:
        work = Path(tmp)
        for rep in range(args.reps):
            got: dict[str, list[dict]] = {}
            for i, (label, p, mode) in enumerate(ORDER):
                r = run(work, f"{label}-r{rep}-{i}", argparse.Namespace(**{**vars(args), "seed": args.seed + rep}),
                        p, mode)
                got.setdefault(label, []).append(r)
                emit("expected_time_run", config=label, rep=rep, p=p, mode=mode, T_s=round(r["T_s"], 2),
                     kills=r["kills"], exactly_once=r["exactly_once"], status=r["status"])
            reps.append(got)
    bases = [statistics.fmean(r["T_s"] for r in got["base"]) for got in reps]
    all_runs = [r for got in reps for rs in got.values() for r in rs]
    emit("expected_time_baseline", n_s=n_s, n_c=HOSTS, n_tc=SLOTS, n=n, te_sleep_s=args.te, t_o=args.to,
         reps=args.reps, T_s=round(statistics.median(bases), 2), T_per_rep=[round(b, 2) for b in bases],
         slot_utilisation=round(statistics.median(r["slot_utilisation"] for got in reps for r in got["base"]), 3),
         t_e_effective_s=round(statistics.median(bases) / n, 3),
         exactly_once=all(r["exactly_once"] for r in all_runs), finished=all(r["status"] == "done" for r in all_runs),
         **machine())
    for label, p, mode in CONFIGS:
        p_eff = p / (1 - p) if args.rekill else p
        rows = []
        for got, base_T in zip(reps, bases, strict=True):
            (r,) = got[label]
            t_e = base_T / n  # n*t_e: the baselines measured around this run
            if mode == "vanish":
                model = n * t_e + n * p_eff * args.to  # the paper's T(p)
                realized = n * t_e + r["kills"] / (HOSTS * SLOTS) * args.to
                extra = {"model_realized_T_s": realized, "error_realized": r["T_s"] / realized - 1}
            else:
                # With a notice, a kill costs the work done before it (mean dispatch-to-kill
                # time) plus the notice-to-re-dispatch latency: the paper's t_o term with t_o
                # replaced by what a notice leaves of it. Upper bound: the host's whole
                # downtime (notice, report, replacement host up) instead of the latency,
                # as if no other slot could take the re-issued unit meanwhile.
                per_kill = (r["kill_offset_mean_s"] or 0.0) + (r["dispatch_median_s"] or 0.0)
                per_kill_hi = (r["kill_offset_mean_s"] or 0.0) + (r["downtime_median_s"] or 0.0)
                model = n * t_e + n * p_eff * per_kill
                extra = {"notice_term_s": n * p_eff * per_kill, "notice_to_reissue_s": r["reissue_median_s"],
                         "notice_to_redispatch_s": r["dispatch_median_s"], "kill_offset_s": r["kill_offset_mean_s"],
                         "host_downtime_s": r["downtime_median_s"], "model_hi_T_s": n * t_e + n * p_eff * per_kill_hi}
            rows.append({"T_s": r["T_s"], "base_T_s": base_T, "model_T_s": model, "error": r["T_s"] / model - 1,
                         "extra_s": r["T_s"] - base_T, "kills": r["kills"], **extra})

        def med(key: str, rows: list[dict] = rows) -> float:
            return round(statistics.median(x[key] for x in rows), 3)

        out = {"p": p, "mode": mode, "reps": len(rows), "n": n, "t_o": args.to, "T_s": med("T_s"),
               "baseline_T_s": med("base_T_s"), "model_T_s": med("model_T_s"), "error": med("error"),
               "within_15pct": abs(med("error")) <= 0.15, "errors_per_rep": [round(x["error"], 3) for x in rows],
               "measured_extra_s": med("extra_s"), "npto_s": round(n * p_eff * args.to, 2),
               "extra_vs_npto": round(med("extra_s") / (n * p_eff * args.to), 3),
               "kills_mean": statistics.fmean(x["kills"] for x in rows), "expected_kills": round(n_s * p_eff, 1),
               "exactly_once": all(got[label][0]["exactly_once"] for got in reps)}
        if mode == "vanish":
            out.update(model_realized_T_s=med("model_realized_T_s"), error_realized=med("error_realized"))
        else:
            out.update(notice_term_s=med("notice_term_s"), notice_to_reissue_s=med("notice_to_reissue_s"),
                       notice_to_redispatch_s=med("notice_to_redispatch_s"), kill_offset_s=med("kill_offset_s"),
                       host_downtime_s=med("host_downtime_s"), model_hi_T_s=med("model_hi_T_s"))
        emit("expected_time", **out)


if __name__ == "__main__":
    main()
