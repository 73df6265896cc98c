"""Calibration from a job's own history: the ``units.csv`` a run writes.

Each merged unit's row carries the client's training time (``train_s``), the slot's
wall time (``wall_s``) and when it was merged (``t``). From them: the unit time a slot
of that run's host type needs, and the parameter servers' merge rate when they were the
bottleneck (the median gap between consecutive merges is an upper bound of one merge's
service time over P).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

MAX_ROWS = 1_000_000  # a units.csv is ours, but bound what we read all the same


@dataclass(frozen=True)
class History:
    """What a finished run says about unit and merge times."""

    units: int
    train_s: float | None  # median client training time of one unit
    wall_s: float | None  # median client wall time (training plus reading and writing files)
    merge_gap_s: float | None  # median time between consecutive merges
    span_s: float | None  # first to last merge


def _float(v: str | None) -> float | None:
    try:
        x = float(v) if v not in (None, "") else None
    except ValueError:
        return None
    return x if x is not None and x == x and x >= 0 else None


def read_history(path: Path | str) -> History:
    """Summarise a run's ``units.csv`` (rows of failed units are skipped)."""
    train, wall, ts = [], [], []
    with Path(path).open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i >= MAX_ROWS:
                break
            if row.get("failed"):
                continue
            for key, out in (("train_s", train), ("wall_s", wall), ("t", ts)):
                x = _float(row.get(key))
                if x is not None:
                    out.append(x)
    ts.sort()
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return History(len(ts), statistics.median(train) if train else None, statistics.median(wall) if wall else None,
                   statistics.median(gaps) if gaps else None, ts[-1] - ts[0] if len(ts) > 1 else None)
