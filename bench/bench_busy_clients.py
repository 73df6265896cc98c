"""Idle share of BOINC hosts while a job has work left: before/after, same script.

A simulated clock drives clients that fetch work as BOINC 7.20's do (work-fetch backoff of
0.5-1.5 x 600 s doubling up to a day after a "no tasks" reply, cleared by a finished
upload; results reported at once; 7 s ``request_delay``; ``next_rpc_delay`` honoured;
``server/faults/workfetch_sim.py``) against:

* MOP, the grid example's shape (8 configurations x 4 partitions, 3 epochs) on 1 and 2
  hosts of 2 slots: *before* = epoch barrier, no ``next_rpc_delay`` (boinc-dl until now);
  *after* = grid search pipelined per model, ``next_rpc_delay`` 60 s (what install sets);
  plus each change alone;
* VC-ASGD, 64 subsets x 2 epochs on 16 hosts of 2 slots: fixed window 8 (the old default)
  vs the window sized from the active hosts (slots + 1 spare per host);
* VC-ASGD, the shipped example (8 subsets x 20 epochs) on one host of 2 slots with 5 s
  tasks and merges 3.5 s after the report (as measured on a real server): the generator
  every 5 s and BOINC's 5 s feeder sleep (before) vs the generator woken by each merge and
  the feeder's 1 s that install sets (after); then both with the real client's own pace,
  against what the real server measured.

Idle share = idle slot-seconds / all slot-seconds while the job still had units to create
or to send. Means over ``--seeds`` runs. Server side, unless said otherwise: assimilation
10 s after the report, generator pass every 5 s, feeder 5 s.

    python bench/bench_busy_clients.py [--unit-s 300] [--seeds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit  # noqa: E402
from tests.support.workfetch_sim import MOPGenerator, VCASGDGenerator, simulate  # noqa: E402


def mop(hosts: int, pipelined: bool, delay: float, unit_s: float, seeds: int) -> dict[str, float]:
    rs = [simulate(MOPGenerator(8, 4, 3, pipelined, seed=s), hosts, 2, next_rpc_delay=delay, unit_s=unit_s,
                   seed=s) for s in range(seeds)]
    assert all(r.finished for r in rs)
    return {"idle": statistics.mean(r.idle_share for r in rs),
            "makespan_s": statistics.mean(r.makespan_s for r in rs),
            "rpcs_per_host_hour": statistics.mean(r.rpcs_per_host_hour for r in rs),
            "backoffs": statistics.mean(r.backoffs for r in rs)}


def vcasgd(window: int | None, unit_s: float, seeds: int) -> dict[str, float]:
    rs = [simulate(VCASGDGenerator(64, 2, window), 16, 2, next_rpc_delay=60, unit_s=unit_s, seed=s)
          for s in range(seeds)]
    assert all(r.finished for r in rs)
    return {"idle": statistics.mean(r.idle_share for r in rs),
            "makespan_s": statistics.mean(r.makespan_s for r in rs),
            "rpcs_per_host_hour": statistics.mean(r.rpcs_per_host_hour for r in rs)}


def short_units(seeds: int, pace: bool = False, **server: float) -> dict[str, float]:
    """The example on one 2-slot host; ``pace``: the real client's 4 s from reply to
    start and 6 s from exit to upload done (docs/boinc.md, "Latency")."""
    client = {"fetch_s": 4.0, "upload_s": 6.0} if pace else {}
    rs, first8 = [], []
    for s in range(seeds):
        kw = dict(next_rpc_delay=60, unit_s=5.0, seed=s, request_delay=0.0, assimilate_s=3.5, **client, **server)
        rs.append(simulate(VCASGDGenerator(8, 20, None), 1, 2, **kw))
        g = VCASGDGenerator(8, 20, None)
        simulate(g, 1, 2, max_s=480, **kw)
        first8.append(g.merged)
    assert all(r.finished for r in rs)
    return {"idle": statistics.mean(r.idle_share for r in rs),
            "makespan_s": statistics.mean(r.makespan_s for r in rs),
            "backoffs": statistics.mean(r.backoffs for r in rs),
            "first8": statistics.mean(first8),
            "rpcs_per_host_hour": statistics.mean(r.rpcs_per_host_hour for r in rs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unit-s", type=float, default=300.0, help="mean unit run time (+-25%)")
    ap.add_argument("--seeds", type=int, default=8)
    a = ap.parse_args()
    t0 = time.perf_counter()
    print(f"units of {a.unit_s:g} s +-25%, {a.seeds} seeds each\n")
    print(f"{'MOP':<40}{'hosts':>6}{'idle':>8}{'makespan':>10}{'RPC/host/h':>12}{'backoffs':>10}")
    out = {}
    for hosts in (1, 2):
        for label, pipe, delay in (("barrier, no next_rpc_delay (before)", False, 0),
                                   ("pipelined only", True, 0), ("next_rpc_delay 60 s only", False, 60),
                                   ("pipelined + next_rpc_delay 60 (after)", True, 60)):
            r = mop(hosts, pipe, delay, a.unit_s, a.seeds)
            out[(hosts, pipe, delay)] = r
            print(f"{label:<40}{hosts:>6}{r['idle']:>8.1%}{r['makespan_s']:>9.0f}s{r['rpcs_per_host_hour']:>12.1f}"
                  f"{r['backoffs']:>10.1f}")
    fixed, sized = vcasgd(8, a.unit_s, a.seeds), vcasgd(None, a.unit_s, a.seeds)
    print(f"\nVC-ASGD, 16 hosts x 2 slots: fixed window 8: idle {fixed['idle']:.1%}, {fixed['makespan_s']:.0f} s; "
          f"window from hosts: idle {sized['idle']:.1%}, {sized['makespan_s']:.0f} s")
    print("\nVC-ASGD, the example (8 subsets x 20 epochs) on 1 host x 2 slots, 5 s tasks:")
    short = {}
    for label, server in (("before: generator every 5 s, feeder 5 s", {"feeder_s": 5.0}),
                          ("feeder 1 s only", {"feeder_s": 1.0}),
                          ("generator woken by merges only", {"feeder_s": 5.0, "wake_on_merge": True}),
                          ("after: both", {"feeder_s": 1.0, "wake_on_merge": True})):
        r = short[label.split(":")[0]] = short_units(a.seeds, **server)
        print(f"  {label:<42} idle {r['idle']:6.1%}  makespan {r['makespan_s']:6.0f} s  backoffs {r['backoffs']:5.1f}")
    print("  with the real client's pace (4 s reply -> start, 6 s exit -> uploaded); the real server in brackets:")
    for label, server, real in (("before", {"feeder_s": 5.0}, "21 in 8 min"),
                                ("after", {"feeder_s": 1.0, "wake_on_merge": True}, "52 in 8 min, 1,434 s, 510/h")):
        r = short[f"{label}+pace"] = short_units(a.seeds, pace=True, **server)
        print(f"  {label:<42} merged in 8 min {r['first8']:5.1f}  makespan {r['makespan_s']:6.0f} s  "
              f"RPC/host/h {r['rpcs_per_host_hour']:5.0f}  [{real}]")
    b1, f1, b2, f2 = out[(1, False, 0)], out[(1, True, 60)], out[(2, False, 0)], out[(2, True, 60)]
    emit("busy_clients", unit_s=a.unit_s, seeds=a.seeds,
         mop_1host_idle_before=round(b1["idle"], 4), mop_1host_idle_after=round(f1["idle"], 4),
         mop_2hosts_idle_before=round(b2["idle"], 4), mop_2hosts_idle_after=round(f2["idle"], 4),
         mop_1host_makespan_ratio=round(f1["makespan_s"] / b1["makespan_s"], 3),
         mop_2hosts_makespan_ratio=round(f2["makespan_s"] / b2["makespan_s"], 3),
         rpcs_per_host_hour_after=round(max(f1["rpcs_per_host_hour"], f2["rpcs_per_host_hour"]), 1),
         rpcs_per_host_hour_before=round(max(b1["rpcs_per_host_hour"], b2["rpcs_per_host_hour"]), 1),
         vcasgd_idle_fixed8=round(fixed["idle"], 4), vcasgd_idle_hosts=round(sized["idle"], 4),
         vcasgd_makespan_ratio=round(sized["makespan_s"] / fixed["makespan_s"], 3),
         example_1host_makespan_before_s=round(short["before"]["makespan_s"]),
         example_1host_makespan_after_s=round(short["after"]["makespan_s"]),
         example_1host_makespan_ratio=round(short["after"]["makespan_s"] / short["before"]["makespan_s"], 3),
         example_paced_first8_before=round(short["before+pace"]["first8"], 1),
         example_paced_first8_after=round(short["after+pace"]["first8"], 1),
         example_paced_makespan_after_s=round(short["after+pace"]["makespan_s"]),
         wall_s=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
