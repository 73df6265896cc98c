"""Which Redis errors are worth retrying: shared by every store call and the merges."""

from __future__ import annotations

import redis

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
