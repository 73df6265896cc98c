"""The run's ETA on synthetic timelines: no estimate without evidence, then it settles
and counts down instead of jumping as the naive elapsed/done estimate does."""

from __future__ import annotations

import pytest

from boinc_dl.server.run.eta import EtaEstimator, format_eta


def _waves(startup: float, wave_s: float, slots: int, total: int, spread: float = 0.05) -> list[tuple[float, int]]:
    """Completion times of ``total`` units run ``slots`` at a time after a start-up."""
    return [(startup + wave_s * (i // slots + 1) + spread * (i % slots), i + 1) for i in range(total)]


def _replay(est: EtaEstimator, events: list[tuple[float, int]], end: float, dt: float = 0.25):
    out, done, pending = [], 0, list(events)
    t = 0.0
    while t <= end:
        while pending and pending[0][0] <= t:
            done = pending.pop(0)[1]
        out.append((t, done, est.observe(t, done)))
        t += dt
    return out


def test_a_17_second_run_settles_instead_of_jumping() -> None:
    """3 s of start-up, 32 units in waves of 8 every 3.5 s: the run ends at ~17.4 s."""
    events = _waves(3.0, 3.5, 8, 32)
    end = events[-1][0]
    trace = _replay(EtaEstimator(32), events, end + 1)
    first = next(i for i, (_, _, e) in enumerate(trace) if e is not None)
    t_first, done_first, _ = trace[first]
    assert done_first >= 1 + 3 and t_first >= events[0][0] + 2.0  # 3 units over 2 s after the first
    # The naive estimate at the first completion: elapsed / done * remaining, off by 10x.
    naive = events[0][0] / 1 * 31
    assert naive > 10 * (end - events[0][0])
    shown = [(t, e) for t, _, e in trace[first:] if t < end]
    for t, e in shown:
        assert abs(e - (end - t)) < 0.5 * (end - t) + 1.5, (t, e, end - t)  # within half the truth, or 1.5 s
    for (t1, e1), (t2, e2) in zip(shown, shown[1:], strict=False):
        assert e2 - e1 < 1.0, (t1, e1, t2, e2)  # never jumps up by a second per quarter second
        assert e1 - e2 < (t2 - t1) + 2.0, (t1, e1, t2, e2)  # nor drops by more than a wave's worth
    assert trace[-1][2] == 0.0


def test_no_estimate_without_evidence_and_a_stall_counts() -> None:
    est = EtaEstimator(10, min_units=3, min_span_s=2.0)
    assert est.observe(0.0, 0) is None
    assert est.observe(5.0, 1) is None  # the first completion only starts the clock
    assert est.observe(6.0, 3) is None  # 2 units in 1 s: not enough span
    e = est.observe(8.0, 5)  # 4 units in 3 s after the first: ~0.75 s per unit, 5 left
    assert e is not None and 3.0 < e < 5.0
    stalled = [est.observe(8.0 + k, 5) for k in range(1, 30)]
    assert stalled[-1] > 5.0  # a long stall raises the estimate instead of reaching 0
    assert all(x is not None and x >= 0 for x in stalled)


def test_estimates_are_robust_to_odd_input() -> None:
    est = EtaEstimator(0)
    assert est.observe(1.0, 0) == 0.0  # nothing to do
    est = EtaEstimator(4)
    assert est.observe(1.0, 7) == 0.0  # more reported done than exist
    with pytest.raises(ValueError):
        EtaEstimator(4, smoothing=0.0)
    assert format_eta(None) == "-" and format_eta(float("nan")) == "-"
    assert format_eta(42.4) == "42 s" and format_eta(125) == "2 m 05 s"
