"""Fail a job fast when no unit can succeed.

A job whose every unit fails (a learning rate that makes training diverge, data that
every client rejects, a model that breaks on every host) would otherwise re-issue each
unit up to ``max_error_results`` times, give it up, and end "done" with nothing
learned. The policy, applied while **no result of the job has been merged yet**:

* ``k`` distinct units failed (client error or rejected result), all with the same
  error once numbers are masked, -> the job fails with that error;
* ``2k`` distinct units failed with any mix of errors -> the job fails with the first.

``k`` defaults to ``min(3, units per epoch)``. One merged result turns the policy off
for good: from then on failures are per unit (re-issue, give up, ``give_up_policy``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+(\.\d+)?")


def error_key(reason: str) -> str:
    """An error message with its numbers masked: the same failure on different units
    (other unit names, sizes, addresses) compares equal."""
    return _NUMBERS.sub("#", reason.strip())[:300]


@dataclass
class FailFast:
    """Decide from the failures seen so far whether the job cannot succeed."""

    k: int = 3
    failures: dict[str, str] = field(default_factory=dict)  # unit -> its first error
    order: list[str] = field(default_factory=list)  # units in the order they first failed
    merged: bool = False

    def success(self) -> None:
        """A result was merged: the job can succeed, the policy is off."""
        self.merged = True

    def failure(self, unit: str, reason: str) -> None:
        """Unit ``unit`` failed once (client error or rejected result) with ``reason``."""
        if unit not in self.failures:
            self.failures[unit] = reason
            self.order.append(unit)

    def verdict(self) -> str | None:
        """The reason to fail the job now, or None to carry on."""
        if self.merged or not self.order:
            return None
        first = self.failures[self.order[0]]
        keys = {error_key(r) for r in self.failures.values()}
        n = len(self.order)
        if n >= self.k and len(keys) == 1:
            return f"the first {n} units all failed with the same error: {first}"
        if n >= 2 * self.k:
            return f"the first {n} units all failed (first error: {first})"
        return None


class FailFastWatch:
    """:class:`FailFast` fed from a local job system's merge counter and failure log."""

    def __init__(self, backend: object, k: int = 3):
        self.policy = FailFast(k=max(1, k))
        self.backend = backend
        self._seen = 0

    def check(self) -> str | None:
        """Read what happened since the last call; the reason to fail the job, or None."""
        snap = self.backend.snapshot()  # type: ignore[attr-defined]
        if snap.get("merged", 0) or snap.get("duplicates", 0):
            self.policy.success()
        new = self.backend.failures_since(self._seen)  # type: ignore[attr-defined]
        self._seen += len(new)
        for unit, reason in new:
            self.policy.failure(unit, reason)
        start = None if self.policy.merged else self.backend.start_failure()  # type: ignore[attr-defined]
        if start is not None:
            # No unit ever ran, so no unit failed: the slots' own error is in the backend's log.
            return f"{start}: nothing can train; the slots' error is in {self.backend.log_file}"  # type: ignore[attr-defined]
        return self.policy.verdict()
