"""The planner's check of a finished run: predicted versus actual epoch time.

Every ``boinc-dl run`` of a VC-ASGD job on the local backend ends with this check. The
actual epoch time is the pipeline's (first unit started to last merge, over the epochs);
the start-up before it is reported apart. The
prediction uses the run's own measured median unit wall time (the client side is what
a user calibrates) and the model's merge-time estimate for the model size; the queueing
(window, P, slots) is simulated. A large gap says the server side or the pipeline
behaves differently than the model assumes.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from boinc_dl.server.common.spec import JobSpec, local_options
from boinc_dl.server.planner.model import (
    SHARED_MERGE_RATIO,
    Config,
    HostType,
    ServerCosts,
    Workload,
    merge_estimate_s,
)
from boinc_dl.server.planner.sim import simulate


def predict_epoch(spec: JobSpec, units: list[dict[str, Any]], params: int, elapsed_s: float,
                  epochs_done: int, backend_opts: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """{predicted_epoch_s, actual_epoch_s, error} for a finished run, or None without data
    (no unit timings, no epoch, or units older than this process's ``elapsed_s``).
    ``backend_opts`` are the run's overrides of the spec's local backend (``--workers``,
    ``--slots``, ``--assimilators``): the configuration that ran is the one simulated."""
    walls = [float(u["wall_s"]) for u in units if u.get("wall_s") not in (None, "")]
    if not walls or epochs_done <= 0:
        return None
    loc = local_options(spec, backend_opts)
    model_bytes = 4 * params
    # The planner's merge estimate for the model size, and the resource-sharing model:
    # the local backend's slots, assimilators and Redis share this host's cores. The
    # slots' staging is already inside their measured wall time, so only the merges are
    # CPU work on the shared cores here.
    m = merge_estimate_s(model_bytes)
    costs = ServerCosts(merge_s=m, dispatch_s=0.05, cpu_cores=os.cpu_count() or 1,
                        merge_shared_s=m * SHARED_MERGE_RATIO)
    host = HostType("this host", unit_s=statistics.median(walls), cores=int(loc["slots"]), bandwidth_mbps=1e9,
                    preempt_p=float(loc["preempt_prob"]))
    cfg = Config(((host, int(loc["workers"])),), int(loc["slots"]), int(loc["assimilators"]), window=spec.vcasgd.window,
                 timeout_s=spec.units.timeout_s)
    w = Workload(spec.vcasgd.n_subsets, epochs_done, params)
    # Each slot's first unit also traces the model (TensorFlow's first call): a one-time
    # cost per slot, paid in the first wave. The run's own first wave gives it.
    warmup = _first_wave_extra_s(units, cfg.total_slots, host.unit_s)
    pred = (simulate(cfg, w, costs, reps=5).job_s + warmup) / epochs_done
    # The model times the pipeline from the first unit's start to the last merge; the
    # run's elapsed time also holds the start-up (slot processes loading TensorFlow, the
    # first evaluation), which no fleet configuration changes. Compare like with like,
    # and report the start-up beside it.
    span = _pipeline_span_s(units)
    if span is not None and span > elapsed_s:
        # units from before this process started (a resumed run, or one resumed after the
        # job had finished): this process's time is not the epochs' time, and the units'
        # span holds the pause between the runs; no like-for-like comparison is left
        return None
    work_s = span if span is not None and span > 0 else elapsed_s
    actual = work_s / epochs_done
    return {"predicted_epoch_s": round(pred, 3), "actual_epoch_s": round(actual, 3),
            "error": round(pred / actual - 1, 4), "startup_s": round(elapsed_s - work_s, 3),
            "unit_wall_median_s": round(host.unit_s, 3), "first_wave_extra_s": round(warmup, 3),
            "merge_s_estimate": round(costs.merge_s, 4),
            "configuration": {"workers": cfg.hosts[0][1], "slots": cfg.slots, "assimilators": cfg.assimilators}}


def _timed(units: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start on its slot, wall time) of every unit with a usable merge time ``t`` and
    ``wall_s`` in its record (NaN and negative walls skipped)."""
    out = []
    for u in units:
        try:
            t, wall = float(u["t"]), float(u["wall_s"])
        except (KeyError, TypeError, ValueError):
            continue
        if t == t and wall == wall and wall >= 0:  # skip NaN
            out.append((t - wall, wall))
    return out


def _first_wave_extra_s(units: list[dict[str, Any]], slots: int, median_wall: float) -> float:
    """How much longer the first ``slots`` units to start ran than the median unit."""
    first = [wall for _, wall in sorted(_timed(units))[:slots]]
    return max(0.0, statistics.median(first) - median_wall) if first else 0.0


def _pipeline_span_s(units: list[dict[str, Any]]) -> float | None:
    """Seconds from the first merged unit's start on its slot (its merge time less its
    wall time) to the last merge, from the units' own records; None without them."""
    timed = _timed(units)
    return max(start + wall for start, wall in timed) - min(start for start, _ in timed) if timed else None
