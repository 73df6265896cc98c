"""What the MOP scheduler hands out (:class:`Assignment`), its error, and the default
placement of partitions on workers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from boinc_dl.server.common.errors import BoincDLError


class SchedulerError(BoincDLError):
    """The scheduler was asked something inconsistent (unknown model/worker, busy worker...)."""


@dataclass(frozen=True)
class Assignment:
    """One training unit handed out: train ``model`` on ``partition`` for one sub-epoch.

    ``worker`` is ``None`` for units issued in pull mode. ``attempt`` counts how many times
    this unit was handed out in this epoch (1 for the first time); pass it back to
    :meth:`MOPScheduler.complete` / :meth:`MOPScheduler.fail` to reject stale results.
    """

    model: str
    partition: int
    worker: str | None
    attempt: int
    epoch: int

    def to_json(self) -> list:
        return [self.model, self.partition, self.worker, self.attempt, self.epoch]

    @classmethod
    def from_json(cls, v: list) -> Assignment:
        return cls(str(v[0]), int(v[1]), None if v[2] is None else str(v[2]), int(v[3]), int(v[4]))


def round_robin_availability(
    workers: Iterable[str], n_partitions: int, replication: int = 1
) -> dict[str, set[int]]:
    """Place partition ``j`` on worker ``(j + r) mod n`` for ``r < replication``.

    With ``replication=1`` this is Cerebro's default (partition ``j`` on worker ``j mod n``).
    """
    ws = list(workers)
    if not ws:
        raise SchedulerError("at least one worker is needed")
    if n_partitions < 1:
        raise SchedulerError(f"n_partitions must be >= 1, got {n_partitions}")
    if not 1 <= replication <= len(ws):
        raise SchedulerError(f"replication must be in [1, {len(ws)}], got {replication}")
    avail: dict[str, set[int]] = {w: set() for w in ws}
    for j in range(n_partitions):
        for r in range(replication):
            avail[ws[(j + r) % len(ws)]].add(j)
    return avail
