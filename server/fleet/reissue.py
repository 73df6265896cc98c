"""The fleet controller's one hook into re-issue: "re-issue these workunits now".

The controller adds the workunit names of a reclaimed host to the job's
``reissue_now`` set (:class:`boinc_dl.server.backends.boinc.registry.BoincRegistry`); the work
generator daemon's next pass regenerates them from the freshest weights exactly as it
does for a unit past its deadline (VC-ASGD ``reissue: fresh``). The regeneration logic
stays in one place; this module only files requests, each workunit once.
"""

from __future__ import annotations

import time

import redis

from boinc_dl.server.assimilator.store import PREFIX, JobStore
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.workunit import parse_unit_name

#: Workunit names already requested (a warning then a preemption of the same host, or
#: two controllers, must not ask twice); entries expire after a week.
REQUESTED_KEY = f"{PREFIX}:_fleet:requested"
REQUEST_TTL_S = 7 * 86400


def request_reissue(r: redis.Redis, workunits: list[str], now: float | None = None) -> list[str]:
    """File re-issue requests for ``workunits``; returns those newly requested.

    Names that are not units of a known job are ignored (another app's workunits or a
    hostile host name cannot create keys).
    """
    now = time.time() if now is None else now
    jobs = {x.decode() for x in r.smembers(f"{PREFIX}:jobs")}
    fresh: list[str] = []
    for name in dict.fromkeys(workunits):
        parsed = parse_unit_name(name)
        if parsed is None or parsed["job"] not in jobs:
            continue
        # ZADD NX: only the first request of a name counts.
        if r.zadd(REQUESTED_KEY, {name: now}, nx=True):
            key = BoincRegistry(JobStore(r, parsed["job"])).reissue_key
            p = r.pipeline()
            p.sadd(key, name)
            p.expire(key, REQUEST_TTL_S)
            p.execute()
            fresh.append(name)
    if fresh:
        r.zremrangebyscore(REQUESTED_KEY, "-inf", now - REQUEST_TTL_S)
    return fresh
