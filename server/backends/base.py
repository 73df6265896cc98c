"""The one small interface between the work generator and a job system.

A job system takes a workunit (its description plus physical input files and a
deadline), runs it somewhere, re-issues it when a result is late or invalid (up to
the unit's limits), and hands each returned result to the validator and then the
assimilator, BOINC's way. The work generator never sees hosts or results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from boinc_dl.server.common.workunit import Workunit


@dataclass(frozen=True)
class RetryLimits:
    """BOINC's per-workunit limits (create_work flags of the same names)."""

    delay_bound_s: float
    max_error_results: int
    max_total_results: int


class JobSystem(ABC):
    """Submit and cancel workunits; results flow to the validator and assimilator."""

    #: How many units the system can run at once (slots); None if unknown.
    capacity: int | None = None

    def live_capacity(self) -> int | None:
        """Units the hosts asking for work right now can take (slots plus what keeps them
        fed), for a job system whose hosts come and go; None if it cannot tell."""
        return None

    @abstractmethod
    def submit(self, wu: Workunit, limits: RetryLimits) -> None:
        """Create the workunit; ``wu.files`` maps logical input names to physical paths."""

    @abstractmethod
    def cancel(self, unit: str) -> None:
        """Cancel a workunit (its unsent and running instances are dropped)."""

    def start(self) -> None:  # noqa: B027 - optional hook
        """Start daemons/workers (no-op for systems that run elsewhere)."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Stop daemons/workers started by :meth:`start`."""
