"""The fleet controller's Redis state: every key it owns and every command it sends.

Keys of fleet F (``P`` = ``bdl:fleet:{F}``; the braces put them in one slot of a Redis
Cluster, so one script may change several atomically):

==========================  =====================================================
``P:fence``                 fencing counter: +1 each time a controller takes the lease
``P:lease``                 ``owner|token`` of the controller acting now (expires)
``P:meta``                  hash: ``created`` (the first watch: time is charged from it)
``P:inst``                  hash uid -> JSON :class:`~.records.InstanceRecord`
``P:reclaims``              zset uid -> time of the cloud's reclaim (each instance once)
``P:sizes``                 hash uid -> hosts alive when it was reclaimed (rate denominator)
``P:fallback``              JSON :class:`~.records.FallbackState`
``P:cost:J``                hash: job J's ledger (integers: ms, nano-dollars, counts)
``P:jobs``                  set of the jobs this fleet has charged
``P:requested``             zset workunit -> time filed for re-issue (for a week)
``P:status``                hash: the last period, for ``boinc-dl fleet status``
``P:once:T``                a commit's token (an hour): a re-sent commit is a no-op
==========================  =====================================================

Outside ``P``: ``bdl:fleets`` (the fleets' names), ``bdl:J:cost_summary`` (job J's cost
in words, which the admin page reads), and the BOINC backend's re-issue set of a job
(:class:`~boinc_dl.server.backends.boinc.registry.BoincRegistry`).

**One actor.** A controller acts only while it holds the lease; taking it increments the
fence, and every write that changes the fleet's books is one Lua script that first
checks the fence still equals the taker's token, so a controller that stalled past its
lease (and was replaced) can no longer change anything: it gets :class:`LeaseLost`.

**Idempotent.** A commit (records, ledger increments, reclaims, fallback) is one
script, atomic in memory and in the append-only file, and carries a random token: a
commit re-sent after a lost reply finds its token and does nothing. Filing re-issue
requests is idempotent by itself (a set add; the backend honours a request once).
Every call retries while Redis is unreachable, as :meth:`JobStore.call
<boinc_dl.server.assimilator.store.JobStore.call>` does.
"""

from __future__ import annotations

import os
import re
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from boinc_dl.server.assimilator.retry import Backoff, is_transient
from boinc_dl.server.assimilator.store import DEFAULT_RETRY_S, PREFIX, JobStore
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.errors import BoincDLError
from boinc_dl.server.fleet.records import FallbackState, InstanceRecord

FLEETS_KEY = f"{PREFIX}:fleets"
#: A fleet's name becomes part of its keys (and a hash tag): letters, digits, . _ -
FLEET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: Re-issue requests are remembered (not filed twice) this long.
REQUEST_TTL_S = 7 * 86400
#: Reclaims older than this are dropped from the rate's window keys.
RECLAIM_HORIZON_S = 86400
COMMIT_TOKEN_TTL_S = 3600


class LeaseLost(BoincDLError):
    """Another controller holds this fleet's lease (or took it over): stop acting."""


def summary_key(job: str) -> str:
    """``bdl:J:cost_summary``: a job's cloud cost in words (the admin page reads it)."""
    return f"{PREFIX}:{job}:cost_summary"


def legacy_cost_key(job: str) -> str:
    """Where releases before per-fleet ledgers kept a job's cost (read, never written)."""
    return f"{PREFIX}:{job}:cost"


_LEASE = """
-- KEYS: lease, fence; ARGV: owner, ttl_ms, token held ('' if none)
local cur = redis.call('GET', KEYS[1])
if cur then
  if ARGV[3] ~= '' and cur == ARGV[1] .. '|' .. ARGV[3] and redis.call('GET', KEYS[2]) == ARGV[3] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, ARGV[3]}
  end
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
local token = tostring(redis.call('INCR', KEYS[2]))
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {1, token}
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_COMMIT = """
-- KEYS: fence, inst, reclaims, sizes, fallback, jobs, once, then one ledger key per job
-- ARGV: token, then counted groups (see FleetState.commit)
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED') end
if not redis.call('SET', KEYS[7], '1', 'NX', 'EX', ARGV[2]) then return 0 end
local i = 3
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[2], ARGV[i])
  else redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  i = i + 2
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HINCRBY', KEYS[7 + tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
  i = i + 3
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('SADD', KEYS[6], ARGV[i])
  i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('ZADD', KEYS[3], 'NX', ARGV[i + 1], ARGV[i])
  redis.call('HSETNX', KEYS[4], ARGV[i], ARGV[i + 2])
  i = i + 3
end
if ARGV[i] ~= '' then redis.call('SET', KEYS[5], ARGV[i]) end
local old = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[i + 1])
if #old > 0 then
  redis.call('ZREM', KEYS[3], unpack(old))
  redis.call('HDEL', KEYS[4], unpack(old))
end
return 1
"""

_STATUS = """
-- KEYS: fence, status; ARGV: token, reissued, then field/value pairs
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED') end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[2], 'reissued_total', ARGV[2]) end
return 1
"""


@dataclass
class Commit:
    """One atomic change of the fleet's books."""

    #: uid -> the new record (None: forget it)
    records: dict[str, InstanceRecord | None] = field(default_factory=dict)
    #: (job, field) -> integer amount added to the job's ledger
    ledger: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: uid -> (reclaim time, hosts alive then): counted once per instance
    reclaims: dict[str, tuple[float, int]] = field(default_factory=dict)
    fallback: FallbackState | None = None

    def empty(self) -> bool:
        return not (self.records or self.ledger or self.reclaims or self.fallback is not None)


class FleetState:
    """All Redis access of one fleet's controller (see module docstring)."""

    def __init__(self, r: redis.Redis, fleet: str, retry_s: float = DEFAULT_RETRY_S,
                 owner: str | None = None):
        if not FLEET_NAME.match(fleet):
            raise BoincDLError(f"fleet name {fleet!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        self.r = r
        self.fleet = fleet
        self.retry_s = retry_s
        self.p = f"{PREFIX}:fleet:{{{fleet}}}"
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self.token = ""
        self._scripts: dict[str, Any] = {}

    # ---- plumbing --------------------------------------------------------------------------
    def k(self, *parts: str) -> str:
        return ":".join([self.p, *parts])

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (idempotent Redis commands), retrying while Redis is unreachable."""
        backoff = Backoff(self.retry_s)
        while True:
            try:
                return fn()
            except (redis.RedisError, OSError) as e:
                if isinstance(e, redis.ResponseError) and str(e).startswith("FENCED"):
                    raise LeaseLost(f"fleet {self.fleet}: another controller took the lease") from None
                if not is_transient(e) and not isinstance(e, OSError):
                    raise
                backoff.wait(f"fleet {self.fleet}", e)

    def _script(self, name: str, src: str) -> Any:
        sc = self._scripts.get(name)
        if sc is None:
            sc = self._scripts[name] = self.r.register_script(src)
        return sc

    # ---- the lease -------------------------------------------------------------------------
    def hold(self, ttl_s: float) -> tuple[bool, str, float]:
        """Take or renew the lease for ``ttl_s``: (held, holder, seconds it has left)."""
        res = self.call(lambda: self._script("lease", _LEASE)(
            keys=[self.k("lease"), self.k("fence")], args=[self.owner, int(ttl_s * 1000), self.token]))
        if int(res[0]) == 1:
            self.token = _s(res[1])
            return True, self.owner, ttl_s
        self.token = ""
        return False, _s(res[1]).rsplit("|", 1)[0], max(0, int(res[2])) / 1000

    def release(self) -> None:
        """Give the lease up (a clean stop: the next controller need not wait for it)."""
        if self.token:
            tok = f"{self.owner}|{self.token}"
            self.call(lambda: self._script("release", _RELEASE)(keys=[self.k("lease")], args=[tok]))
            self.token = ""

    def holder(self) -> tuple[str, float] | None:
        """Who holds the lease and for how long more (None: nobody)."""
        def read() -> tuple[bytes | None, int]:
            p = self.r.pipeline(transaction=False)
            p.get(self.k("lease"))
            p.pttl(self.k("lease"))
            v, ttl = p.execute()
            return v, ttl
        v, ttl = self.call(read)
        return (_s(v).rsplit("|", 1)[0], max(0, int(ttl)) / 1000) if v else None

    # ---- reads -----------------------------------------------------------------------------
    def ensure_created(self, now: float, provider: str) -> float:
        """The fleet's first watch (set once); registers the fleet's name."""
        def op() -> bytes:
            p = self.r.pipeline(transaction=False)
            p.hsetnx(self.k("meta"), "created", repr(now))
            p.hsetnx(self.k("meta"), "provider", provider)
            p.sadd(FLEETS_KEY, self.fleet)
            p.hget(self.k("meta"), "created")
            return p.execute()[-1]
        return float(self.call(op))

    def created(self) -> float | None:
        v = self.call(lambda: self.r.hget(self.k("meta"), "created"))
        return float(v) if v else None

    def records(self) -> dict[str, InstanceRecord]:
        raw = self.call(lambda: self.r.hgetall(self.k("inst")))
        return {_s(k): InstanceRecord.loads(v) for k, v in raw.items()}

    def fallback(self) -> FallbackState:
        return FallbackState.loads(self.call(lambda: self.r.get(self.k("fallback"))))

    def reclaims_since(self, t: float) -> list[tuple[str, float, int]]:
        """(uid, time, hosts alive then) of the reclaims at or after ``t``."""
        def read() -> list[tuple[str, float, int]]:
            rows = self.r.zrangebyscore(self.k("reclaims"), t, "+inf", withscores=True)
            if not rows:
                return []
            sizes = self.r.hmget(self.k("sizes"), [u for u, _ in rows])
            return [(_s(u), float(s), int(z or 0)) for (u, s), z in zip(rows, sizes, strict=True)]
        return self.call(read)

    def job_ledger(self, job: str) -> dict[str, int]:
        raw = self.call(lambda: self.r.hgetall(self.k("cost", job)))
        return {_s(k): int(v) for k, v in raw.items()}

    def status(self) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in self.call(lambda: self.r.hgetall(self.k("status"))).items()}

    def requested(self) -> dict[str, float]:
        """Workunits filed for re-issue (and when)."""
        return {_s(k): float(v) for k, v in self.call(
            lambda: self.r.zrange(self.k("requested"), 0, -1, withscores=True))}

    @staticmethod
    def fleets(r: redis.Redis) -> list[str]:
        """The names of every fleet that has watched in this Redis."""
        return sorted(_s(x) for x in _retry(lambda: r.smembers(FLEETS_KEY)))

    @staticmethod
    def known_jobs(r: redis.Redis) -> set[str]:
        return set(JobStore.list_jobs(r))

    @staticmethod
    def legacy_job_cost(r: redis.Redis, job: str) -> dict[str, int]:
        return {_s(k): int(v) for k, v in _retry(lambda: r.hgetall(legacy_cost_key(job))).items()}

    # ---- writes ----------------------------------------------------------------------------
    def commit(self, c: Commit, horizon: float) -> bool:
        """Apply ``c`` atomically if this controller still holds the fence (else
        :class:`LeaseLost`); reclaims before ``horizon`` are forgotten. False: the same
        commit had already been applied (a retry after a lost reply)."""
        if c.empty():
            return True
        jobs = sorted({j for j, _ in c.ledger})
        slot = {j: n for n, j in enumerate(jobs, start=1)}
        args: list[Any] = [self.token, COMMIT_TOKEN_TTL_S, len(c.records)]
        for uid, rec in c.records.items():
            args += [uid, rec.dumps() if rec is not None else ""]
        args.append(len(c.ledger))
        for (job, f), v in c.ledger.items():
            args += [slot[job], f, int(v)]
        args.append(len(jobs))
        args += jobs
        args.append(len(c.reclaims))
        for uid, (t, size) in c.reclaims.items():
            args += [uid, repr(t), size]
        args += [c.fallback.dumps() if c.fallback is not None else "", repr(horizon)]
        keys = [self.k("fence"), self.k("inst"), self.k("reclaims"), self.k("sizes"), self.k("fallback"),
                self.k("jobs"), self.k("once", os.urandom(8).hex())] + [self.k("cost", j) for j in jobs]
        return bool(self.call(lambda: self._script("commit", _COMMIT)(keys=keys, args=args)))

    def publish_status(self, fields: dict[str, Any], reissued: int = 0) -> None:
        """The last period for ``fleet status`` (fenced like a commit)."""
        args: list[Any] = [self.token, reissued]
        for k, v in fields.items():
            args += [k, str(v)]
        self.call(lambda: self._script("status", _STATUS)(keys=[self.k("fence"), self.k("status")], args=args))

    def file_reissue(self, by_job: dict[str, list[str]], now: float) -> list[str]:
        """File ``by_job`` (job -> workunit names) with the BOINC backend's re-issue set,
        each name once; the names filed now. A name is marked filed only after it is in
        the set: a crash between the two files it again, which the backend takes as one
        request (a set; and a request for a workunit it has already regenerated is void)."""
        fresh: list[str] = []
        for job, names in sorted(by_job.items()):
            names = sorted(set(names))
            if not names:
                continue
            key = BoincRegistry(JobStore(self.r, job)).reissue_key

            def op(key: str = key, names: list[str] = names) -> list[str]:
                p = self.r.pipeline(transaction=False)
                for n in names:
                    p.zscore(self.k("requested"), n)
                new = [n for n, sc in zip(names, p.execute(), strict=True) if sc is None]
                if new:
                    p.sadd(key, *new)
                    p.expire(key, REQUEST_TTL_S)
                    p.zadd(self.k("requested"), dict.fromkeys(new, now), nx=True)
                    p.execute()
                return new
            fresh += self.call(op)
        if fresh:
            self.call(lambda: self.r.zremrangebyscore(self.k("requested"), "-inf", now - REQUEST_TTL_S))
        return fresh

    def write_summary(self, job: str, fields: dict[str, str]) -> None:
        """A job's cost in words (a view recomputed from the ledgers: overwriting is safe)."""
        self.call(lambda: self.r.hset(summary_key(job), mapping=fields))


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


def _retry(fn: Callable[[], Any], retry_s: float = DEFAULT_RETRY_S) -> Any:
    backoff = Backoff(retry_s)
    while True:
        try:
            return fn()
        except (redis.RedisError, OSError) as e:
            if not is_transient(e) and not isinstance(e, OSError):
                raise
            backoff.wait(None, e)

