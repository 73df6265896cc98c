"""The planner's check of a finished run: predicted versus actual epoch time.

Every ``boinc-dl run`` of a VC-ASGD job on the local backend ends with this check. The
prediction uses the run's own measured median unit wall time (the client side is what
a user calibrates) and the model's merge-time estimate for the model size; the queueing
(window, P, slots) is simulated. A large gap says the server side or the pipeline
behaves differently than the model assumes.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from server.common.spec import JobSpec
from server.planner.model import (
    SHARED_MERGE_RATIO,
    Config,
    HostType,
    ServerCosts,
    Workload,
    merge_estimate_s,
)
from server.planner.sim import simulate


def predict_epoch(spec: JobSpec, units: list[dict[str, Any]], params: int, elapsed_s: float,
                  epochs_done: int) -> dict[str, Any] | None:
    """{predicted_epoch_s, actual_epoch_s, error} for a finished run, or None without data."""
    walls = [float(u["wall_s"]) for u in units if u.get("wall_s") not in (None, "")]
    if not walls or epochs_done <= 0:
        return None
    loc = spec.backend.local
    model_bytes = 4 * params
    # The planner's merge estimate for the model size, and the resource-sharing model:
    # the local backend's slots, assimilators and Redis share this host's cores. The
    # slots' staging is already inside their measured wall time, so only the merges are
    # CPU work on the shared cores here.
    m = merge_estimate_s(model_bytes)
    costs = ServerCosts(merge_s=m, dispatch_s=0.05, cpu_cores=os.cpu_count() or 1,
                        merge_shared_s=m * SHARED_MERGE_RATIO)
    host = HostType("this host", unit_s=statistics.median(walls), cores=loc.slots, bandwidth_mbps=1e9,
                    preempt_p=loc.preempt_prob)
    cfg = Config(((host, loc.workers),), loc.slots, loc.assimilators, window=spec.vcasgd.window,
                 timeout_s=spec.units.timeout_s)
    w = Workload(spec.vcasgd.n_subsets, epochs_done, params)
    pred = simulate(cfg, w, costs, reps=5).epoch_s
    actual = elapsed_s / epochs_done
    return {"predicted_epoch_s": round(pred, 3), "actual_epoch_s": round(actual, 3),
            "error": round(pred / actual - 1, 4), "unit_wall_median_s": round(host.unit_s, 3),
            "merge_s_estimate": round(costs.merge_s, 4)}
