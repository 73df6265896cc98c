"""Time left in a run, from the throughput of completed units.

The naive ``elapsed / done * remaining`` jumps wildly early on (470 s, 158 s, 25 s in
the first seconds of a 17 s run): the elapsed time includes start-up (TensorFlow
imports, the first weights file) and units complete in waves, one per round of slots.
This estimator

* gives no estimate until there is evidence: ``min_units`` completions spread over at
  least ``min_span_s`` seconds after the first one;
* measures throughput after the first completion (start-up and the first wave
  excluded), up to the latest completion, and counts the time left down from there,
  so the time between two waves does not swing it; a wait longer than the rate
  foresaw falls back on the slower rate that includes it;
* smooths: each new estimate is blended with the previous one counted down by the time
  since, so the display settles and counts down instead of jumping.
"""

from __future__ import annotations

import math


class EtaEstimator:
    """Remaining seconds for ``total`` units, fed with (time, units done) observations."""

    def __init__(self, total: int, min_units: int = 3, min_span_s: float = 2.0, smoothing: float = 0.25):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError("smoothing must be in (0, 1]")
        self.total = max(0, int(total))
        self.min_units = max(1, int(min_units))
        self.min_span_s = float(min_span_s)
        self.smoothing = float(smoothing)
        self._first: tuple[float, int] | None = None  # (time, done) at the first completion
        self._last_done = 0
        self._last_change = 0.0
        self._eta: float | None = None
        self._eta_at = 0.0

    def observe(self, t: float, done: int) -> float | None:
        """Record that ``done`` units are complete at time ``t``; return the estimate."""
        done = min(int(done), self.total)
        if done >= self.total:
            self._eta, self._eta_at = 0.0, t
            return 0.0
        if done > self._last_done:
            if self._first is None:
                self._first = (t, done)
            self._last_done, self._last_change = done, t
        raw = self._raw(t)
        if raw is None:
            return None
        if self._eta is None:
            self._eta = raw
        else:
            counted_down = max(0.0, self._eta - (t - self._eta_at))
            self._eta = self.smoothing * raw + (1.0 - self.smoothing) * counted_down
        self._eta_at = t
        return self._eta

    def _raw(self, t: float) -> float | None:
        if self._first is None:
            return None
        t0, done0 = self._first
        units = self._last_done - done0
        span = self._last_change - t0
        if units < self.min_units or span < self.min_span_s:
            return None
        remaining = self.total - self._last_done
        waited = t - self._last_change
        per_unit = (t - t0) / units  # the current wait included: waves do not swing it
        left = remaining * per_unit - waited  # counted down since the last completion
        if left <= 0:  # overdue
            left = remaining * per_unit
        return left

    @property
    def estimate(self) -> float | None:
        """The last estimate returned by :meth:`observe` (None: not enough evidence yet)."""
        return self._eta


def format_eta(eta: float | None) -> str:
    """``-`` without an estimate, else whole seconds (``1 m 05 s`` past a minute)."""
    if eta is None or not math.isfinite(eta):
        return "-"
    s = int(round(eta))
    return f"{s // 60} m {s % 60:02d} s" if s >= 60 else f"{s} s"
