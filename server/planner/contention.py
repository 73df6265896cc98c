"""Contention: a unit's CPU seconds grow with the units running beside it.

Processor sharing alone says a unit costs the same CPU seconds however many slots share
the cores, only spread over more wall time. Measured on real units it does not: the same
unit took 1.03-1.14x the CPU of a 1-slot run at 2 slots, and up to 1.41x at 6 slots on 2
cores (caches, memory bandwidth and the scheduler's switching between the slots'
processes; bench/README.md). The planner models it as a factor on each running unit's
CPU work,

    f(k) = 1 + g * (k - 1),

with k the units running at that moment, and calibrates ``g`` from what runs record: each
merged unit's CPU seconds and wall interval (``units.csv``), hence the time-averaged
number of units it ran beside. A run of one slot sees k = 1 throughout and says nothing
about ``g``; pooled with a run of more slots (``--calibrate RUN_1SLOT --calibrate
RUN_4SLOTS``), each unit of the second is compared with what its size costs at k = 1.

Everything here works on plain numbers, so that rows of any source (a ``units.csv``, a
job's merge records) feed it the same way.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: A unit counts as "alone" (calibrating the 1-slot costs) below this mean concurrency,
#: and as "crowded" (calibrating g) at or above it.
ALONE_BELOW = 1.5
#: Fewest crowded units the fit of g needs; with fewer, g = 0.
MIN_CROWDED = 3
#: g is clamped to [0, G_MAX]: a unit costing more than 2x per extra slot is not contention
#: but a broken row (or other work on the machine during the calibration run).
G_MAX = 2.0


def factor(g: float, running: float) -> float:
    """``f(k) = 1 + g (k - 1)``: CPU-seconds factor of a unit while ``running`` units
    (itself included) run at once (the one home of the formula: the calibration's
    description, the simulation and the plan's bound use it)."""
    return 1.0 + g * max(0.0, running - 1.0)


@dataclass(frozen=True)
class Contention:
    """The fitted contention term, and what it was fitted on."""

    g: float = 0.0  # extra CPU per unit, per other unit running at once (fraction)
    units: int = 0  # crowded units the fit used
    max_running: float = 1.0  # the highest mean concurrency a unit of the calibration saw
    note: str = "no run of more than one slot to calibrate from: contention not modelled (g = 0)"

    def factor(self, running: float) -> float:
        """CPU-seconds factor of a unit while ``running`` units (itself included) run."""
        return factor(self.g, running)

    def describe(self) -> str:
        if self.units == 0:
            return self.note
        return (f"contention g = {self.g:.3f} per extra running unit (from {self.units} units that ran "
                f"beside up to {self.max_running:.1f} at once: x{self.factor(2):.2f} at 2, "
                f"x{self.factor(4):.2f} at 4, x{self.factor(6):.2f} at 6)")


def mean_concurrency(intervals: Sequence[tuple[float, float] | None]) -> list[float | None]:
    """For each (start, end) interval, the time-averaged number of intervals (itself
    included) open during it; None for a missing or empty interval.

    A sweep over the sorted ends: the count of open intervals is a step function, its
    running integral is kept at every boundary, and each interval reads the integral's
    difference between its own ends (n log n, fine for ``MAX_ROWS`` rows)."""
    pts = sorted({x for iv in intervals if iv is not None and iv[1] > iv[0] for x in iv})
    if not pts:
        return [None] * len(intervals)
    delta = [0] * len(pts)
    for iv in intervals:
        if iv is not None and iv[1] > iv[0]:
            delta[bisect.bisect_left(pts, iv[0])] += 1
            delta[bisect.bisect_left(pts, iv[1])] -= 1
    integral = [0.0] * len(pts)  # the count's integral from pts[0] to pts[i]
    open_ = 0
    for i in range(1, len(pts)):
        open_ += delta[i - 1]
        integral[i] = integral[i - 1] + open_ * (pts[i] - pts[i - 1])
    out: list[float | None] = []
    for iv in intervals:
        if iv is None or iv[1] <= iv[0]:
            out.append(None)
            continue
        a, b = bisect.bisect_left(pts, iv[0]), bisect.bisect_left(pts, iv[1])
        out.append((integral[b] - integral[a]) / (iv[1] - iv[0]))
    return out


def fit_contention(samples: Sequence[tuple[float, float]]) -> Contention:
    """``g`` from (mean concurrency, CPU seconds measured / the same unit's CPU seconds
    at concurrency 1) of each unit: the median of the per-unit slopes ``(ratio - 1) /
    (k - 1)`` over the crowded units (k >= ``ALONE_BELOW``). A median, since a few units
    of a run meet other work on the machine (the per-unit ratios of one run spread by
    ~10%). With fewer than ``MIN_CROWDED`` crowded units: g = 0, and the note says why."""
    ok = [(k, r) for k, r in samples if k == k and r == r and 0 < r < 100 and 1 <= k < 1e4]
    crowded = [(k, r) for k, r in ok if k >= ALONE_BELOW]
    top = max((k for k, _ in ok), default=1.0)
    if len(crowded) < MIN_CROWDED:
        why = ("a 1-slot calibration only" if not crowded else
               f"only {len(crowded)} unit{'s' * (len(crowded) != 1)} ran beside others")
        return Contention(0.0, 0, top, f"{why}: contention not modelled (g = 0); calibrate from a run of "
                          f"2 x cores slots too for plans of many slots")
    g = statistics.median((r - 1.0) / (k - 1.0) for k, r in crowded)
    return Contention(min(G_MAX, max(0.0, g)), len(crowded), top, "")
