"""Redis state of every job, namespaced per job (``bdl:{job}:...``).

Keys of job J:

=============================  ===================================================
``bdl:jobs``                   set of job names
``bdl:J:spec``                 the job spec (canonical JSON)
``bdl:J:meta``                 hash: status, mode, fingerprint, created_at, ...
``bdl:J:w:M``                  server weights of model M: one float32 buffer
``bdl:J:v:M``                  weights version of model M (number of merges)
``bdl:J:units``                hash unit -> JSON (epoch, subset/partition, model, state)
``bdl:J:assimilated``          hash unit -> JSON merge record (the idempotency mark)
``bdl:J:failed``               hash unit -> reason, units given up on for good
``bdl:J:epoch:E``              hash: created, assimilated, failed, started_at, ...
``bdl:J:epochs``               hash E -> JSON epoch summary (validation accuracy ...)
``bdl:J:metrics``              stream: one entry per merge, rejection, epoch end
``bdl:J:rejections``           stream: rejected results with their reasons
=============================  ===================================================

A merge and its "unit assimilated" mark are committed in one MULTI/EXEC guarded by
WATCH on the weights and the mark (strict mode): a re-run of the assimilator finds
the mark and does nothing, and two assimilators never overwrite each other's
update (the loser of a race retries on the new weights).

Reconnection: every :class:`JobStore` call retries while Redis is unreachable (a
restart reloading its append-only file, a dropped socket) for up to ``retry_s``
seconds before raising :class:`StoreUnavailable`, so daemons ride through a Redis
restart. A retried call may re-send a command whose reply was lost after Redis had
applied it, so every write is idempotent or made so:

* multi-key updates guarded by a "first time" test (``register_unit``,
  ``mark_failed``, ``finish_epoch``) are single Lua scripts, atomic in memory and
  in the append-only file, and a re-run finds their guard already set;
* plain increments (``incr_counter``, ``record_rejection``) carry a random
  idempotency token, stored with a one-hour expiry: a re-sent call finds its token
  and does nothing;
* a merge carries a token in its record: a retry that finds the unit already
  marked by *its own* token reports the merge as applied, not as a duplicate.

Kept as one module (about 600 lines): every Redis key of a job and the Lua scripts that
change them together are one contract, read best whole.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from server.common.errors import StoreUnavailable, UnknownJob
from server.common.weights import Fingerprint

PREFIX = "bdl"

#: How long a JobStore call retries while Redis is unreachable. Long enough to ride
#: through a Redis restart (reloading the append-only file takes about a second per
#: GB), short enough that a daemon whose Redis is gone for good says so.
DEFAULT_RETRY_S = 30.0
#: Lifetime of an idempotency token: far longer than any retry window.
TOKEN_TTL_S = 3600
# Error replies Redis gives while it cannot serve writes for a while (loading the
# AOF, AOF write failing, failover): transient, like a dropped connection.
_TRANSIENT_REPLIES = ("LOADING", "MISCONF", "READONLY", "TRYAGAIN", "MASTERDOWN")


def is_transient(e: BaseException) -> bool:
    """True for Redis faults worth retrying: connection loss, timeouts, loading."""
    if isinstance(e, redis.ConnectionError | redis.TimeoutError):
        return True
    return isinstance(e, redis.ResponseError) and str(e).startswith(_TRANSIENT_REPLIES)


class _BigBufferMixin:
    """Larger socket buffers: a 20 MB weights value crosses in far fewer wake-ups."""

    def _connect(self):  # type: ignore[no-untyped-def]
        sock = super()._connect()  # type: ignore[misc]
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 8 * 1024 * 1024)
            except OSError:
                pass
        return sock


class _UnixConnection(_BigBufferMixin, redis.UnixDomainSocketConnection):
    pass


class _TCPConnection(_BigBufferMixin, redis.Connection):
    pass


def connect(url: str, timeout: float = 10.0, wait_s: float = 0.0) -> redis.Redis:
    """Connect to Redis (``redis://`` or ``unix://``) and check it answers.

    ``wait_s`` > 0 keeps trying that long (a daemon starting while Redis restarts);
    the default fails at once with one clear message (a user command)."""
    pool = redis.ConnectionPool.from_url(url, socket_timeout=max(timeout, 30.0), socket_connect_timeout=timeout)
    pool.connection_class = _UnixConnection if pool.connection_class is redis.UnixDomainSocketConnection \
        else _TCPConnection if pool.connection_class is redis.Connection else pool.connection_class
    r = redis.Redis(connection_pool=pool)
    end = time.monotonic() + wait_s
    while True:
        try:
            r.ping()
            return r
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) as e:
            if time.monotonic() >= end:
                raise StoreUnavailable(f"Redis at {url} is unreachable: {e}") from None
            time.sleep(0.1)


@dataclass
class MergeOutcome:
    """What one call of :meth:`JobStore.merge` did."""

    applied: bool
    version: int
    retries: int = 0
    duplicate: bool = False


class JobStore:
    """All Redis access for one job.

    Methods retry while Redis is unreachable, for up to ``retry_s`` seconds, then raise
    :class:`StoreUnavailable` (``retry_s=0``: a single attempt).
    """

    def __init__(self, r: redis.Redis, job: str, retry_s: float = DEFAULT_RETRY_S):
        self.r = r
        self.job = job
        self.ns = f"{PREFIX}:{job}"
        self.retry_s = float(retry_s)
        self._scripts: dict[str, Any] = {}
        # model -> (tag, buffer): the server weights this process wrote last. Every write
        # sets a fresh random tag, so a matching tag proves the cached copy is current and
        # the 20 MB GET can be skipped (a Redis rollback or another writer changes the tag).
        self._cache: dict[str, tuple[bytes, np.ndarray]] = {}

    # ---- keys -------------------------------------------------------------------------
    def k(self, *parts: object) -> str:
        return ":".join([self.ns, *map(str, parts)])

    # ---- reconnection -----------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (Redis commands), retrying it while Redis is unreachable.

        ``fn`` must be idempotent (a retry may follow a reply lost after Redis applied
        the commands). Raises :class:`StoreUnavailable` once ``retry_s`` has passed.
        """
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                return fn()
            except (redis.RedisError, OSError) as e:
                if not is_transient(e) and not isinstance(e, OSError):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.retry_s
                if now >= deadline:
                    raise StoreUnavailable(f"Redis unreachable: {e}") from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)

    def _script(self, name: str, src: str) -> Any:
        """A registered Lua script (EVALSHA, reloaded by redis-py after a restart)."""
        sc = self._scripts.get(name)
        if sc is None:
            sc = self._scripts[name] = self.r.register_script(src)
        return sc

    def _token_key(self) -> str:
        return self.k("once", os.urandom(8).hex())

    # ---- job lifecycle ----------------------------------------------------------------
    @staticmethod
    def list_jobs(r: redis.Redis) -> list[str]:
        return sorted(x.decode() for x in _guard(lambda: r.smembers(f"{PREFIX}:jobs")))

    def exists(self) -> bool:
        return bool(self.call(lambda: self.r.exists(self.k("spec"))))

    def require(self) -> JobStore:
        if not self.exists():
            raise UnknownJob(f"no job named {self.job!r} in this Redis")
        return self

    def create(self, spec_json: str, mode: str, fingerprints: dict[str, Fingerprint], meta: dict[str, Any]) -> None:
        """Record a new job and its models' fingerprints (weights are set separately)."""
        def op() -> None:
            p = self.r.pipeline(transaction=True)
            p.sadd(f"{PREFIX}:jobs", self.job)
            p.set(self.k("spec"), spec_json)
            fields = {"status": "running", "mode": mode, "created_at": time.time(), **meta}
            fields = {k: (json.dumps(v) if isinstance(v, dict | list) else v) for k, v in fields.items()}
            p.hset(self.k("meta"), mapping=fields)
            for m, fp in fingerprints.items():
                p.hset(self.k("fingerprints"), m, fp.to_json())
            p.execute()
        self.call(op)

    def spec_json(self) -> str:
        v = self.call(lambda: self.r.get(self.k("spec")))
        if v is None:
            raise UnknownJob(f"no job named {self.job!r} in this Redis")
        return v.decode()

    def meta(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.call(lambda: self.r.hgetall(self.k("meta"))).items()}

    def set_meta(self, **fields: Any) -> None:
        fields = {k: (json.dumps(v) if isinstance(v, dict | list) else v) for k, v in fields.items()}
        self.call(lambda: self.r.hset(self.k("meta"), mapping=fields))

    def fingerprint(self, model: str = "0") -> Fingerprint:
        v = self.call(lambda: self.r.hget(self.k("fingerprints"), model))
        if v is None:
            raise UnknownJob(f"job {self.job!r} has no model {model!r}")
        return Fingerprint.from_json(v.decode())

    def models(self) -> list[str]:
        return sorted(x.decode() for x in self.call(lambda: self.r.hkeys(self.k("fingerprints"))))

    # ---- weights ------------------------------------------------------------------------
    def init_weights(self, model: str, flat: np.ndarray, fingerprint: Fingerprint | None = None) -> bool:
        """Set model weights at version 0 unless they already exist (returns True if set)."""
        def op() -> bool:
            p = self.r.pipeline(transaction=True)
            p.set(self.k("w", model), _as_bytes(flat), nx=True)
            p.set(self.k("wt", model), _new_tag(), nx=True)
            p.setnx(self.k("v", model), 0)
            if fingerprint is not None:
                p.hsetnx(self.k("fingerprints"), model, fingerprint.to_json())
            return bool(p.execute()[0])
        return self.call(op)

    def get_weights(self, model: str = "0") -> tuple[np.ndarray, int]:
        """Current server weights (a writable copy) and their version, read atomically."""
        def op() -> tuple[bytes | None, bytes | None]:
            p = self.r.pipeline(transaction=True)
            p.get(self.k("w", model))
            p.get(self.k("v", model))
            return tuple(p.execute())  # type: ignore[return-value]
        w, v = self.call(op)
        if w is None:
            raise UnknownJob(f"job {self.job!r} has no weights for model {model!r}")
        return np.frombuffer(w, dtype=np.float32).copy(), int(v or 0)

    def version(self, model: str = "0") -> int:
        return int(self.call(lambda: self.r.get(self.k("v", model))) or 0)

    def is_assimilated(self, unit: str) -> bool:
        return bool(self.call(lambda: self.r.hexists(self.k("assimilated"), unit)))

    def merge(
        self,
        model: str,
        unit: str,
        combine: Callable[[np.ndarray], np.ndarray | None],
        record: dict[str, Any],
        epoch: int | None,
        strict: bool = True,
        max_retries: int = 1000,
    ) -> MergeOutcome:
        """Apply ``W_s <- combine(W_s)`` and mark ``unit`` assimilated, atomically.

        ``combine`` gets a writable copy of the server buffer and returns the new one
        (or ``None`` to reject, which raises nothing and applies nothing). In strict mode
        the read-modify-write is guarded with WATCH and retried on conflict, so no
        concurrent update is lost; in eventual mode (the paper's) the read and the write
        are not tied and a concurrent update can be overwritten.
        """
        # Names this call's merge: after a reply lost in a Redis crash, the retry finds
        # the mark and tells its own merge (applied) from another one (duplicate).
        token = os.urandom(8).hex()
        lock = self._lock_merges(model) if strict else None
        released = [False]
        try:
            return self._merge_loop(model, unit, combine, record, epoch, strict, max_retries, token,
                                    lock, released)
        finally:
            if lock is not None and not released[0]:
                self._unlock_merges(model, lock)

    # Serialises strict merges of one model across assimilator processes. Only an
    # optimisation: WATCH/MULTI alone is correct, but under contention it lets every
    # loser read 20 MB, merge and retry; the lock makes waiters wait instead. The TTL
    # bounds the damage of a holder that dies; a waiter that gives up goes on unlocked.
    _LOCK_TTL_MS = 10_000
    _UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

    def _lock_merges(self, model: str, wait_s: float = 15.0) -> bytes | None:
        key, me = self.k("mlock", model), os.urandom(8).hex().encode()
        end, pause = time.monotonic() + wait_s, 0.001
        while time.monotonic() < end:
            try:
                if self.r.set(key, me, nx=True, px=self._LOCK_TTL_MS):
                    return me
            except (redis.RedisError, OSError):
                return None  # Redis trouble: the merge loop's own retries take over
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return None

    def _unlock_merges(self, model: str, me: bytes) -> None:
        try:
            self.r.eval(self._UNLOCK, 1, self.k("mlock", model), me)
        except (redis.RedisError, OSError):
            pass  # the TTL releases it

    def _merge_loop(self, model: str, unit: str, combine: Callable[[np.ndarray], np.ndarray | None],
                    record: dict[str, Any], epoch: int | None, strict: bool, max_retries: int,
                    token: str, lock: bytes | None = None, released: list[bool] | None = None) -> MergeOutcome:
        wkey, vkey, akey = self.k("w", model), self.k("v", model), self.k("assimilated")
        tkey = self.k("wt", model)
        retries = 0
        deadline: float | None = None
        delay = 0.05
        while True:
            cached = self._cache.pop(model, None)
            try:
                with self.r.pipeline(transaction=True) as p:
                    reader: Any = p if strict else self.r
                    if strict:
                        p.watch(wkey, akey)
                    prev = reader.hget(akey, unit)
                    if prev is not None:
                        if cached is not None:
                            self._cache[model] = cached
                        mine = _record_token(prev) == token
                        v_now = int(reader.get(vkey) or 0)
                        if mine:
                            return MergeOutcome(True, int(json.loads(prev).get("version", v_now)), retries)
                        return MergeOutcome(False, v_now, retries, duplicate=True)
                    tag = reader.get(tkey)
                    v = int(reader.get(vkey) or 0)
                    if cached is not None and tag is not None and cached[0] == tag:
                        ws = cached[1]
                    else:
                        w = reader.get(wkey)
                        if w is None:
                            raise UnknownJob(f"job {self.job!r} has no weights for model {model!r}")
                        ws = np.frombuffer(w, dtype=np.float32).copy()
                    new = combine(ws)
                    if new is None:
                        return MergeOutcome(False, v, retries)
                    new_tag = _new_tag()
                    rec = {**record, "version": v + 1, "base_version_seen": v, "t": time.time(), "token": token}
                    p.multi()
                    p.set(wkey, _as_bytes(new))
                    p.set(tkey, new_tag)
                    p.incr(vkey)
                    p.hset(akey, unit, json.dumps(rec))
                    self._unit_state_cmds(p, unit, "assimilated")
                    if epoch is not None:
                        p.hincrby(self.k("epoch", epoch), "assimilated", 1)
                    p.xadd(self.k("metrics"), {"kind": "merge", "unit": unit, "model": model, "data": json.dumps(rec)})
                    if lock is not None:
                        # Release the advisory lock in the same round trip (saves one under load).
                        p.eval(self._UNLOCK, 1, self.k("mlock", model), lock)
                    res = p.execute()
                    if released is not None and lock is not None:
                        released[0] = True
                    self._cache[model] = (new_tag, new)
                    return MergeOutcome(True, int(res[2]), retries)
            except redis.WatchError:
                # A concurrent write, or (redis-py's report of) a connection lost while
                # watching: either way, read again. The token makes the re-read exact.
                retries += 1
                if retries > max_retries:
                    raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts") from None
            except (redis.RedisError, OSError) as e:
                if not (isinstance(e, OSError) or is_transient(e)):
                    raise
                now = time.monotonic()
                deadline = now + self.retry_s if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(f"Redis unreachable during merge of {unit}: {e}") from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)

    # ---- units --------------------------------------------------------------------------
    def _unit_state_cmds(self, p: redis.client.Pipeline, unit: str, state: str) -> None:
        p.hset(self.k("unit_state"), unit, state)

    _REGISTER = """
    if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
    redis.call('HSET', KEYS[2], ARGV[1], 'created')
    if ARGV[3] == '1' then
      redis.call('HINCRBY', KEYS[3], 'created', 1)
      redis.call('HSETNX', KEYS[3], 'started_at', ARGV[4])
    end
    return 1
    """

    def register_unit(self, unit: str, info: dict[str, Any], epoch: int | None) -> bool:
        """Record a created unit (returns False if it already existed: no double count).

        One Lua script: the record, its state and the epoch's ``created`` count change
        together or not at all, so a crash in between cannot desynchronise them.
        """
        script = self._script("register", self._REGISTER)
        keys = [self.k("units"), self.k("unit_state"), self.k("epoch", epoch if epoch is not None else "none")]
        args = [unit, json.dumps(info), "1" if epoch is not None else "0", time.time()]
        return bool(self.call(lambda: script(keys=keys, args=args)))

    _SET_IF = (
        "local cur = redis.call('HGET', KEYS[1], ARGV[1]) "
        "if cur == ARGV[2] then redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) return 1 end return 0"
    )

    def transition_unit(self, unit: str, from_state: str, to_state: str) -> bool:
        """Set a unit's state only if it is still ``from_state`` (never undo an assimilation)."""
        script = self._script("set_if", self._SET_IF)
        return bool(self.call(lambda: script(keys=[self.k("unit_state")], args=[unit, from_state, to_state])))

    def unit_info(self, unit: str) -> dict[str, Any] | None:
        v = self.call(lambda: self.r.hget(self.k("units"), unit))
        return json.loads(v) if v else None

    def units(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in self.call(lambda: self.r.hgetall(self.k("units"))).items()}

    def unit_states(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.call(lambda: self.r.hgetall(self.k("unit_state"))).items()}

    def unit_states_of(self, units: list[str]) -> list[str | None]:
        """The states of the given units, in order (None for an unknown unit)."""
        if not units:
            return []
        raw = self.call(lambda: self.r.hmget(self.k("unit_state"), units))
        return [v.decode() if v is not None else None for v in raw]

    _MARK_FAILED = """
    if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
    if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
    redis.call('HSET', KEYS[3], ARGV[1], 'failed')
    if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[4], 'failed', 1) end
    redis.call('XADD', KEYS[5], '*', 'kind', 'failed', 'unit', ARGV[1], 'data', ARGV[4])
    return 1
    """

    def mark_failed(self, unit: str, reason: str, epoch: int | None) -> bool:
        """Give up on a unit for good (BOINC's ``--error`` call); idempotent and atomic."""
        script = self._script("mark_failed", self._MARK_FAILED)
        keys = [self.k("assimilated"), self.k("failed"), self.k("unit_state"),
                self.k("epoch", epoch if epoch is not None else "none"), self.k("metrics")]
        args = [unit, reason, "1" if epoch is not None else "0", json.dumps({"reason": reason})]
        return bool(self.call(lambda: script(keys=keys, args=args)))

    _REJECT = """
    if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', '10000', '*', 'data', ARGV[2])
    redis.call('HINCRBY', KEYS[3], 'rejected', 1)
    return 1
    """

    def record_rejection(self, unit: str, result: str, reason: str) -> None:
        """A result that failed validation (the unit itself may still succeed later).

        Recorded once even if a lost reply makes the call retry (idempotency token).
        """
        entry = {"unit": unit, "result": result, "reason": reason, "t": time.time()}
        script = self._script("reject", self._REJECT)
        keys = [self._token_key(), self.k("rejections"), self.k("counters")]
        self.call(lambda: script(keys=keys, args=[TOKEN_TTL_S, json.dumps(entry)]))

    def rejections(self, count: int = 20) -> list[dict[str, Any]]:
        rows = self.call(lambda: self.r.xrevrange(self.k("rejections"), count=count))
        return [json.loads(f[b"data"]) for _id, f in rows]

    _INCR_ONCE = """
    if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
    redis.call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])
    return 1
    """

    def incr_counter(self, name: str, by: int = 1) -> None:
        """Add ``by`` to a counter, exactly once even when the call is retried."""
        script = self._script("incr_once", self._INCR_ONCE)
        keys = [self._token_key(), self.k("counters")]
        self.call(lambda: script(keys=keys, args=[TOKEN_TTL_S, name, int(by)]))

    def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.call(lambda: self.r.hgetall(self.k("counters"))).items()}

    def assimilated(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v) for k, v in self.call(lambda: self.r.hgetall(self.k("assimilated"))).items()}

    def failed(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.call(lambda: self.r.hgetall(self.k("failed"))).items()}

    # ---- epochs -------------------------------------------------------------------------
    def epoch_counts(self, epoch: int) -> dict[str, float]:
        raw = self.call(lambda: self.r.hgetall(self.k("epoch", epoch)))
        return {k.decode(): float(v) for k, v in raw.items()}

    _FINISH_EPOCH = """
    if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
    redis.call('XADD', KEYS[2], '*', 'kind', 'epoch', 'data', ARGV[3])
    return 1
    """

    def finish_epoch(self, epoch: int, summary: dict[str, Any]) -> bool:
        """Record an epoch's summary once (returns False if it was already recorded)."""
        script = self._script("finish_epoch", self._FINISH_EPOCH)
        keys = [self.k("epochs"), self.k("metrics")]
        args = [epoch, json.dumps(summary), json.dumps({"epoch": epoch, **summary})]
        return bool(self.call(lambda: script(keys=keys, args=args)))

    def epochs(self) -> dict[int, dict[str, Any]]:
        raw = self.call(lambda: self.r.hgetall(self.k("epochs")))
        return dict(sorted((int(k), json.loads(v)) for k, v in raw.items()))

    def metrics(self, kind: str | None = None) -> Iterator[dict[str, Any]]:
        """All metric stream entries (optionally of one kind), oldest first."""
        last = "-"
        while True:
            rows = self.call(lambda last=last: self.r.xrange(self.k("metrics"), min=last, count=1000))
            if last != "-":
                rows = rows[1:]
            if not rows:
                return
            for _rid, f in rows:
                k = f[b"kind"].decode()
                if kind is None or k == kind:
                    d = json.loads(f.get(b"data", b"{}"))
                    d.setdefault("unit", f.get(b"unit", b"").decode())
                    yield {"kind": k, **d}
            last = rows[-1][0].decode()

    def delete(self) -> None:
        """Remove every key of this job."""
        def op() -> None:
            keys = list(self.r.scan_iter(match=f"{self.ns}:*", count=1000))
            if keys:
                self.r.delete(*keys)
            self.r.srem(f"{PREFIX}:jobs", self.job)
        self.call(op)


def _new_tag() -> bytes:
    return os.urandom(12).hex().encode()


def _as_bytes(a: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return memoryview(a).cast("B")


def _record_token(raw: bytes) -> str | None:
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec.get("token") if isinstance(rec, dict) else None


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"Redis unreachable: {e}") from None


@contextmanager
def retrying(timeout: float = 60.0, delay: float = 0.2) -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Context giving ``call(fn)`` that retries ``fn`` while Redis is unreachable."""
    def call(fn: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fn()
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(delay)
    yield call
