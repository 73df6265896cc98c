"""Exact-once audit of a VC-ASGD job from its Redis state alone.

The merge log is the job's ``metrics`` stream: a merge appends its entry in the same
MULTI/EXEC as the weights, the version and the unit's "assimilated" mark, so the
stream, the marks and the version must agree, and each (epoch, subset) must appear
exactly once among the units that were merged or given up on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from boinc_dl.server.assimilator.store import JobStore


@dataclass
class Audit:
    """What :func:`audit_job` found; ``problems`` is empty for a clean job."""

    merges: int = 0
    assimilated: int = 0
    failed: int = 0
    version: int = 0
    units: int = 0
    epochs_closed: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"merges": self.merges, "assimilated": self.assimilated, "failed": self.failed,
                "version": self.version, "units": self.units, "epochs_closed": self.epochs_closed,
                "problems": self.problems[:20]}


def audit_job(store: JobStore, n_subsets: int, epochs: int | None = None, model: str = "0") -> Audit:
    """Check that every (epoch, subset) of the closed epochs was merged or given up exactly once.

    ``epochs``: how many epochs must be closed (default: whatever the job closed).
    """
    a = Audit()
    merges = Counter(m["unit"] for m in store.metrics("merge"))
    marks = store.assimilated()
    failed = store.failed()
    units = store.units()
    a.merges, a.assimilated, a.failed, a.units = sum(merges.values()), len(marks), len(failed), len(units)
    a.version = store.version(model)
    closed = sorted(store.epochs())
    a.epochs_closed = len(closed)
    twice = sorted(u for u, c in merges.items() if c > 1)
    if twice:
        a.problems.append(f"{len(twice)} unit(s) merged more than once: {twice[:5]}")
    if set(merges) != set(marks):
        a.problems.append(f"merge log and marks differ: {sorted(set(merges) ^ set(marks))[:5]}")
    if a.version != a.merges:
        a.problems.append(f"weights version {a.version} != {a.merges} merges in the log")
    both = sorted(set(marks) & set(failed))
    if both:
        a.problems.append(f"unit(s) both merged and given up: {both[:5]}")
    if epochs is not None and a.epochs_closed < epochs:
        a.problems.append(f"only {a.epochs_closed} of {epochs} epochs closed")
    per_epoch: dict[int, Counter] = {}
    for unit, info in units.items():
        if unit in marks or unit in failed:
            per_epoch.setdefault(int(info["epoch"]), Counter())[int(info["shard"])] += 1
    for e in closed:
        got = per_epoch.get(e, Counter())
        missing = sorted(set(range(n_subsets)) - set(got))
        extra = sorted(s for s, c in got.items() if c > 1)
        if missing:
            a.problems.append(f"epoch {e}: subset(s) {missing[:5]} neither merged nor given up")
        if extra:
            a.problems.append(f"epoch {e}: subset(s) {extra[:5]} merged more than once")
    return a
