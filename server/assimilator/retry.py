"""Which Redis errors are worth retrying: shared by every store call and the merges."""

from __future__ import annotations

import time

import redis

from boinc_dl.server.common.errors import StoreUnavailable

# Error replies Redis gives while it cannot serve writes for a while (loading the
# AOF, AOF write failing, failover): transient, like a dropped connection.
_TRANSIENT_REPLIES = ("LOADING", "MISCONF", "READONLY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN")


def is_transient(e: BaseException) -> bool:
    """True for Redis faults worth retrying: connection loss, timeouts, loading."""
    if isinstance(e, redis.ConnectionError | redis.TimeoutError | redis.exceptions.ClusterError
                  | redis.exceptions.SlotNotCoveredError):
        return True
    return isinstance(e, redis.ResponseError) and str(e).startswith(_TRANSIENT_REPLIES)


def is_redirect(e: BaseException) -> bool:
    """A cluster's MOVED/ASK: the slot lives elsewhere now (refresh the map, retry)."""
    return isinstance(e, redis.ResponseError) and str(e).startswith(("MOVED", "ASK"))


class Backoff:
    """One operation's retry window while Redis is unreachable: sleeps doubling from
    50 ms to 1 s, then :class:`StoreUnavailable` once ``retry_s`` has passed since the
    first failure."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self.deadline: float | None = None
        self.delay = 0.05

    def wait(self, what: str | None, e: BaseException) -> None:
        """Sleep before the next try, or raise when the window is over."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.retry_s
        if now >= self.deadline:
            during = f" during {what}" if what else ""
            raise StoreUnavailable(f"Redis unreachable{during}: {e}") from None
        time.sleep(min(self.delay, max(0.0, self.deadline - now)))
        self.delay = min(self.delay * 2, 1.0)
