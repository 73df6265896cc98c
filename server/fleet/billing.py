"""How a cloud bills one instance's life: increment, minimum, and the reclaim waiver.

Each provider states its rules (:data:`boinc_dl.server.fleet.aws.BILLING`,
:data:`boinc_dl.server.fleet.gcp.BILLING`); the ledger applies them when an instance's
life ends. Times are integer milliseconds here, so a bill is exact.

* **increment and minimum**: Linux instances are billed per second with a minimum of
  60 s on both AWS and GCP. A second begun is billed in full (the clouds do not say how
  they round; this reading never under-counts).
* **reclaim waiver** (AWS): a spot instance that *EC2 interrupts* within its first
  instance hour is not billed at all; one its owner stops or terminates in that hour is
  billed as usual. GCP has no such rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BillingRules:
    """One cloud's billing of an instance's life (see module docstring)."""

    increment_ms: int = 1000
    minimum_ms: int = 60_000
    #: a spot instance the cloud itself reclaims within this long of its launch is free
    reclaim_waiver_ms: int = 0

    def billed_end_ms(self, launched_ms: int, end_ms: int) -> int:
        """The end of the billed time of a life [launched, end): rounded up to the
        increment, at least the minimum; a life of no length is not billed."""
        life = end_ms - launched_ms
        if life <= 0:
            return launched_ms
        billed = -(-life // self.increment_ms) * self.increment_ms
        return launched_ms + max(billed, self.minimum_ms)

    def provisional(self, market: str, launched_ms: int, now_ms: int) -> bool:
        """Whether a charge at ``now`` may still be waived (the instance is inside the
        waiver window): such charges wait until the window has passed."""
        return market == "spot" and self.reclaim_waiver_ms > 0 and now_ms < launched_ms + self.reclaim_waiver_ms

    def waived(self, market: str, launched_ms: int, end_ms: int, by_cloud: bool) -> bool:
        """Whether a life that ended at ``end`` is not billed at all."""
        return by_cloud and self.provisional(market, launched_ms, end_ms)
