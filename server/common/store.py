"""Redis state of every job, namespaced per job (``bdl:{job}:...``).

Keys of job J:

=============================  ===================================================
``bdl:jobs``                   set of job names
``bdl:J:spec``                 the job spec (canonical JSON)
``bdl:J:meta``                 hash: status, mode, fingerprint, created_at, ...
``bdl:J:layout``               hash model -> JSON {n, shards}: how M's weights are cut
``bdl:J:s:{J/M/i}:w``          shard i of model M's server weights (float32 bytes)
``bdl:J:s:{J/M/i}:m``          hash: shard i's tag, version and per-unit "applied" marks
``bdl:J:v:M``                  weights version of model M (number of merged units)
``bdl:J:units``                hash unit -> JSON (epoch, subset/partition, model, state)
``bdl:J:assimilated``          hash unit -> JSON merge record (the idempotency mark)
``bdl:J:failed``               hash unit -> reason, units given up on for good
``bdl:J:epoch:E``              hash: created, assimilated, failed, started_at, ...
``bdl:J:epochs``               hash E -> JSON epoch summary (validation accuracy ...)
``bdl:J:metrics``              stream: one entry per merge, rejection, epoch end
``bdl:J:rejections``           stream: rejected results with their reasons
=============================  ===================================================

Weights are sharded (:mod:`server.common.shards`): a merge applies shard by shard,
each shard's bytes and its "unit applied" mark committed together in one
``MULTI``/``EXEC`` guarded by ``WATCH`` (strict mode: the loser of a race re-reads that
shard and retries), then one script sets the unit's global "assimilated" mark with the
epoch accounting (refused if the unit was given up meanwhile).
A re-run of the assimilator skips the shards already marked and finds the global
mark: nothing is applied twice, and two assimilators never overwrite each other's
update. Weights written by earlier releases as one value (``bdl:J:w:M``) are cut
into shards on first use. In a Redis Cluster (:mod:`server.common.cluster`) the
job's bookkeeping keys are ``bdl:{J}:...`` (one slot), each shard its own slot.

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

import inspect
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

from server.common import shards as sh
from server.common.cluster import cluster_client, is_cluster, is_cluster_url
from server.common.errors import StoreUnavailable, UnknownJob
from server.common.shards import ShardLayout, Snapshot
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
_TRANSIENT_REPLIES = ("LOADING", "MISCONF", "READONLY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN")


def is_transient(e: BaseException) -> bool:
    """True for Redis faults worth retrying: connection loss, timeouts, loading."""
    if isinstance(e, redis.ConnectionError | redis.TimeoutError | redis.exceptions.ClusterError
                  | redis.exceptions.SlotNotCoveredError):
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
    """Connect to Redis (``redis://``, ``unix://``, or a Redis Cluster:
    ``redis+cluster://h1:p1,h2:p2`` or a comma-separated list of ``redis://`` nodes)
    and check it answers.

    ``wait_s`` > 0 keeps trying that long (a daemon starting while Redis restarts);
    the default fails at once with one clear message (a user command)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            if is_cluster_url(url):
                r: Any = cluster_client(url, timeout)
            else:
                pool = redis.ConnectionPool.from_url(url, socket_timeout=max(timeout, 30.0),
                                                     socket_connect_timeout=timeout)
                pool.connection_class = _UnixConnection \
                    if pool.connection_class is redis.UnixDomainSocketConnection \
                    else _TCPConnection if pool.connection_class is redis.Connection else pool.connection_class
                r = redis.Redis(connection_pool=pool)
            r.ping()
            return r
        except (redis.RedisError, redis.RedisClusterException, OSError) as e:
            if not isinstance(e, redis.ConnectionError | redis.TimeoutError | redis.BusyLoadingError
                              | redis.RedisClusterException | OSError) and not is_transient(e):
                raise
            if time.monotonic() >= end:
                raise StoreUnavailable(f"Redis at {url} is unreachable: {e}") from None
            time.sleep(0.1)


# A shard read fetched ahead: (the cache entry popped for it, the read script's reply).
_ReadAhead = tuple[tuple[bytes, np.ndarray] | None, list[Any]]


@dataclass
class MergeOutcome:
    """What one call of :meth:`JobStore.merge` did."""

    applied: bool
    version: int
    retries: int = 0
    duplicate: bool = False
    given_up: bool = False  # the unit was marked failed before: never merged after that


class JobStore:
    """All Redis access for one job.

    Methods retry while Redis is unreachable, for up to ``retry_s`` seconds, then raise
    :class:`StoreUnavailable` (``retry_s=0``: a single attempt).
    """

    def __init__(self, r: redis.Redis, job: str, retry_s: float = DEFAULT_RETRY_S):
        self.r = r
        self.job = job
        self.cluster = is_cluster(r)
        # In a cluster every bookkeeping key of a job shares the hash tag {job} (one
        # slot: the Lua scripts touch several); a single server keeps the plain names.
        self.ns = f"{PREFIX}:{{{job}}}" if self.cluster else f"{PREFIX}:{job}"
        self.retry_s = float(retry_s)
        self._scripts: dict[str, Any] = {}
        # (model, shard) -> (tag, buffer): the shard this process wrote last. Every write
        # sets a fresh random tag, so a matching tag proves the cached copy is current and
        # its GET can be skipped (a Redis rollback or another writer changes the tag).
        self._cache: dict[tuple[str, int], tuple[bytes, np.ndarray]] = {}
        self._layouts: dict[str, ShardLayout] = {}
        self._fingerprints: dict[str, tuple[bytes, Fingerprint]] = {}
        # model -> True when no other process wrote its shards during this process's
        # last merge: the cached copies are then likely current (see _merge_strict).
        self._alone: dict[str, bool] = {}
        self._foreign = False

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
            except (redis.RedisError, redis.RedisClusterException, OSError) as e:
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
            # bdl:jobs lives in another slot of a cluster: added on its own (idempotent).
            self.r.sadd(f"{PREFIX}:jobs", self.job)
            p = self.r.pipeline(transaction=True)
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
        """Model ``model``'s fingerprint (parsed once per text: a 700-tensor model's
        JSON takes milliseconds to parse and every result is checked against it)."""
        v = self.call(lambda: self.r.hget(self.k("fingerprints"), model))
        if v is None:
            raise UnknownJob(f"job {self.job!r} has no model {model!r}")
        hit = self._fingerprints.get(model)
        if hit is not None and hit[0] == v:
            return hit[1]
        fp = Fingerprint.from_json(v.decode())
        self._fingerprints[model] = (v, fp)
        return fp

    def models(self) -> list[str]:
        return sorted(x.decode() for x in self.call(lambda: self.r.hkeys(self.k("fingerprints"))))

    # ---- weights ------------------------------------------------------------------------
    # Each model's weights are S shards (server.common.shards); ``layout`` records S per
    # model so that every reader and writer cuts the buffer the same way.
    def _shard_base(self, model: str, i: int) -> str:
        return f"{PREFIX}:{self.job}:s:{{{self.job}/{model}/{i}}}"

    def _shard_keys(self, model: str, i: int) -> list[str]:
        base = self._shard_base(model, i)
        return [f"{base}:w", f"{base}:m"]

    def layout(self, model: str = "0") -> ShardLayout:
        """How model ``model``'s weights are cut into shards (migrating a model still
        stored in the one-key layout of earlier releases on first use)."""
        lay = self._layouts.get(model)
        if lay is not None:
            return lay
        raw = self.call(lambda: self.r.hget(self.k("layout"), model))
        if raw is None:
            raw = self._migrate_one_key(model)
        d = json.loads(raw)
        lay = self._layouts[model] = ShardLayout(int(d["n"]), int(d["shards"]))
        return lay

    def _migrate_one_key(self, model: str) -> bytes:
        """Cut a model kept as one value (``w:M``) into shards at its current version.

        Idempotent: shards are written only where absent and the layout last (a crash
        part-way is finished by the next call); the old key is dropped after."""
        w = self.call(lambda: self.r.get(self.k("w", model)))
        if w is None:
            raise UnknownJob(f"job {self.job!r} has no weights for model {model!r}")
        flat = np.frombuffer(w, dtype=np.float32)
        v = self.version(model)
        self._write_shards(model, flat, v)
        self.call(lambda: self.r.delete(self.k("w", model), self.k("wt", model)))
        return self.call(lambda: self.r.hget(self.k("layout"), model))

    def _write_shards(self, model: str, flat: np.ndarray, version: int) -> bool:
        """Write every shard where absent, then the layout (returns True if it set it)."""
        lay = ShardLayout(int(flat.size), sh.shards_for(int(flat.size)))
        for i in range(lay.shards):
            wkey, mkey = self._shard_keys(model, i)
            part = _as_bytes(flat[lay.bounds(i)])

            def op(wkey: str = wkey, mkey: str = mkey, part: memoryview = part) -> None:
                p = self.r.pipeline(transaction=True)
                p.set(wkey, part, nx=True)
                p.hsetnx(mkey, "tag", _new_tag())
                p.hsetnx(mkey, "v", version)
                p.execute()
            self.call(op)
        return bool(self.call(lambda: self.r.hsetnx(self.k("layout"), model, json.dumps(lay.to_json()))))

    def init_weights(self, model: str, flat: np.ndarray, fingerprint: Fingerprint | None = None) -> bool:
        """Set model weights at version 0 unless they already exist (returns True if set)."""
        if self.call(lambda: self.r.hexists(self.k("layout"), model)) or \
                self.call(lambda: self.r.exists(self.k("w", model))):
            return False
        flat = np.ascontiguousarray(flat, dtype=np.float32).ravel()
        done = self._write_shards(model, flat, 0)

        def op() -> None:
            p = self.r.pipeline(transaction=True)
            p.setnx(self.k("v", model), 0)
            if fingerprint is not None:
                p.hsetnx(self.k("fingerprints"), model, fingerprint.to_json())
            p.execute()
        self.call(op)
        return done

    def snapshot(self, model: str = "0") -> Snapshot:
        """The server weights (a writable copy) with each shard's version.

        Each shard is read atomically (bytes and version together); different shards
        may stem from different moments between consecutive merges."""
        lay = self.layout(model)
        script = self._script("read_shard", sh.READ_SHARD)
        flat = np.empty(lay.n, np.float32)
        versions: list[int] = []
        cache = [self._cache.get((model, i)) for i in range(lay.shards)]

        def read_all() -> list[Any]:
            # On one Redis every shard's read rides one pipelined round trip (each read
            # still atomic on its own); a cluster reads shard by shard.
            args = [(self._shard_keys(model, i), ["tag", c[0] if c else b""]) for i, c in enumerate(cache)]
            if self.cluster:
                return [script(keys=k, args=a) for k, a in args]
            p = self.r.pipeline(transaction=False)
            for k, a in args:
                script(keys=k, args=a, client=p)
            return p.execute()
        replies = self.call(read_all)
        for i, (cached, (tag, v, _mark, w)) in enumerate(zip(cache, replies, strict=True)):
            sl = lay.bounds(i)
            if w is None:
                if tag is None or cached is None or cached[0] != tag:
                    raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
                flat[sl] = cached[1]
            else:
                flat[sl] = np.frombuffer(w, dtype=np.float32)
            versions.append(int(v or 0))
        return Snapshot(flat, versions)

    def get_weights(self, model: str = "0") -> tuple[np.ndarray, int]:
        """Current server weights (a writable copy) and their version (see :meth:`snapshot`)."""
        s = self.snapshot(model)
        return s.flat, s.version

    def version(self, model: str = "0") -> int:
        """Number of units merged into ``model`` (the global counter)."""
        return int(self.call(lambda: self.r.get(self.k("v", model))) or 0)

    def is_assimilated(self, unit: str) -> bool:
        return bool(self.call(lambda: self.r.hexists(self.k("assimilated"), unit)))

    def merge(
        self,
        model: str,
        unit: str,
        combine: Callable[..., np.ndarray | None],
        record: dict[str, Any],
        epoch: int | None,
        strict: bool = True,
        max_retries: int = 1000,
    ) -> MergeOutcome:
        """Apply ``W_s <- combine(W_s)`` shard by shard and mark ``unit`` assimilated.

        ``combine(part, sl)`` gets a writable copy of one shard (parameters ``sl`` of
        the flat buffer) and returns its new value; a one-argument ``combine(part)``
        is accepted for a one-shard model. Returning ``None`` rejects the result: only
        allowed before any shard was applied (check a result against the whole model
        first, see :meth:`snapshot`). Each shard's write and its "unit applied" mark
        commit together (a Lua check-and-set on the shard's tag); in strict mode a
        conflict re-reads the shard and retries, so no concurrent update is lost; in
        eventual mode (the paper's) the write does not check the tag and a concurrent
        update of the shard can be overwritten. Once every shard carries the unit, one
        script sets the unit's global mark and its accounting. A re-run (a crash or a
        lost reply part-way) skips the shards already marked: none is applied twice.
        """
        # Names this call's merge: a retry after a lost reply finds its own marks.
        token = os.urandom(8).hex()
        def marks() -> list[Any]:
            # One round trip: both hashes are job bookkeeping keys (one slot in a cluster).
            p = self.r.pipeline(transaction=False)
            p.hget(self.k("assimilated"), unit)
            p.hexists(self.k("failed"), unit)
            return p.execute()
        prev, failed = self.call(marks)
        if prev is not None:
            return self._outcome_of_mark(model, prev, token, 0)
        if failed:
            # Given up for good (its epoch counted it failed): a late result may not also
            # count as merged. (A give-up landing while the shards are applied is caught by
            # the final mark: see FINALIZE.)
            return MergeOutcome(False, self.version(model), 0, given_up=True)
        lay = self.layout(model)
        one_arg = _arity(combine) == 1
        if one_arg and lay.shards > 1:
            raise TypeError(f"model {model!r} has {lay.shards} shards: combine must take (part, slice)")
        kill_after = sh.fault_kill_after_shards()
        # Start at a random shard: concurrent merges of one model then mostly touch
        # different shards at any moment instead of queueing on shard 0.
        start = int.from_bytes(os.urandom(2), "big") % lay.shards
        order = [(start + j) % lay.shards for j in range(lay.shards)]

        def fn_for(i: int) -> Callable[[np.ndarray], np.ndarray | None]:
            sl = lay.bounds(i)
            return (lambda part: combine(part)) if one_arg else (lambda part: combine(part, sl))
        if strict:
            retries, applied_here = self._merge_strict(model, order, unit, token, fn_for, max_retries, kill_after)
            if applied_here < 0:
                return MergeOutcome(False, self.version(model), retries)
            return self._finalize(model, unit, token, record, epoch, retries)
        retries, applied_here = 0, 0
        ahead: _ReadAhead | None = None
        for j, i in enumerate(order):
            nxt = order[j + 1] if j + 1 < len(order) else None
            status, r, ahead = self._merge_shard(model, i, unit, token, fn_for(i), strict, max_retries, ahead, nxt)
            retries += r
            if status == "rejected":
                if applied_here or j:
                    raise ValueError(f"merge of {unit}: combine rejected shard {i} after others were applied")
                return MergeOutcome(False, self.version(model), retries)
            if status == "applied":
                applied_here += 1
                if kill_after is not None and applied_here >= kill_after:
                    sh.die_now()
        return self._finalize(model, unit, token, record, epoch, retries)

    # ---- strict merges: WATCH/MULTI on one held connection ------------------------------
    # A shard's bytes go to Redis as a plain SET inside MULTI/EXEC, guarded by WATCH on
    # the shard's keys: Redis stores the received bulk string as the value itself and
    # appends it to the AOF once, where a Lua check-and-set copies it twice more (into
    # the Lua VM, back out of it) and a Lua read copies it once more. With Redis busy
    # mostly moving bytes, that is the difference between ~15 and ~20+ merges/s.
    def _merge_strict(self, model: str, order: list[int], unit: str, token: str,
                      fn_for: Callable[[int], Callable[[np.ndarray], np.ndarray | None]],
                      max_retries: int, kill_after: int | None) -> tuple[int, int]:
        """Apply every shard not yet carrying ``unit`` (strict: no update lost).

        Returns (conflicts retried, shards applied here); -1 applied: rejected before
        any shard was written. A lone assimilator whose cached copies are all current
        commits every shard in one MULTI/EXEC; otherwise shard by shard, each shard's
        read of the next riding in the same round trip as this one's commit."""
        field = f"u:{unit}"
        retries, applied, left = 0, 0, list(order)
        deadline: float | None = None
        delay = 0.05
        while left:
            held: _Held | None = None
            try:
                if not self.cluster and len(left) > 1 and self._alone.get(model) and \
                        all((model, i) in self._cache for i in left):
                    held = _Held(self.r)
                    got = self._commit_all_cached(held, model, left, field, token, fn_for)
                    held.release()
                    held = None
                    if got is None:
                        return retries, -1
                    self._alone[model] = bool(got)
                    left = [i for i in left if i not in got]
                    applied += len(got)
                    if kill_after is not None and applied >= kill_after:
                        sh.die_now()
                    if not left:
                        break
                i = left[0]
                held = _Held(self._client_for(self._shard_keys(model, i)[0]))
                pending: list[Any] | None = None
                self._foreign = False
                while left:
                    i = left[0]
                    nxt = left[1] if len(left) > 1 and not self.cluster else None
                    status, pending = self._commit_shard(held, model, i, field, token, fn_for(i), pending, nxt)
                    if status == "rejected":
                        if applied or len(left) < len(order):
                            raise ValueError(f"merge of {unit}: combine rejected shard {i} after others were applied")
                        held.release()
                        return retries, -1
                    if status == "conflict":
                        retries += 1
                        if retries > max_retries:
                            raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts on shard {i}")
                        continue
                    left.pop(0)
                    if status == "applied":
                        applied += 1
                        if kill_after is not None and applied >= kill_after:
                            sh.die_now()
                    if self.cluster and left:
                        held.release()
                        held = _Held(self._client_for(self._shard_keys(model, left[0])[0]))
                held.release()
                held = None
                # Nobody else wrote any shard since this process did: the next merge can
                # take the cached fast path (and skip reading the bytes).
                self._alone[model] = not self._foreign
            except BaseException as e:
                if held is not None:
                    held.discard()
                    held = None
                if not isinstance(e, redis.RedisError | redis.RedisClusterException | OSError):
                    raise
                if not (isinstance(e, OSError) or is_transient(e) or _is_redirect(e)):
                    raise
                # Connection lost (a reply may be lost after Redis applied a commit): the
                # retry re-reads every shard left, and one carrying the unit is skipped.
                if self.cluster and _is_redirect(e):
                    self.r.nodes_manager.initialize()  # a slot moved (failover, resharding)
                now = time.monotonic()
                deadline = now + self.retry_s if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(f"Redis unreachable during merge of {unit}: {e}") from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)
        return retries, applied

    def _client_for(self, key: str) -> redis.Redis:
        """The server holding ``key``: this Redis, or the cluster master of its slot."""
        if not self.cluster:
            return self.r
        node = self.r.get_node_from_key(key)
        if node.redis_connection is None:
            self.r.nodes_manager.initialize()
            node = self.r.get_node_from_key(key)
        return node.redis_connection

    def _read_cmds(self, model: str, i: int, field: str) -> list[tuple[Any, ...]]:
        """Watch shard ``i`` and read its tag and mark, and its bytes unless this process
        is alone on the model and holds a copy (then they are read only if stale)."""
        wkey, mkey = self._shard_keys(model, i)
        cmds: list[tuple[Any, ...]] = [("WATCH", wkey, mkey), ("HMGET", mkey, "tag", field)]
        if not (self._alone.get(model) and (model, i) in self._cache):
            cmds.append(("GET", wkey))
        return cmds

    def _commit_shard(self, held: _Held, model: str, i: int, field: str, token: str,
                      combine: Callable[[np.ndarray], np.ndarray | None], pending: list[Any] | None,
                      next_shard: int | None) -> tuple[str, list[Any] | None]:
        """One attempt at shard ``i``: ``applied``, ``skipped`` (it carries the unit),
        ``conflict`` (written by another merge meanwhile: retry) or ``rejected``; with
        the replies of the next shard's read when it rode along."""
        wkey, mkey = self._shard_keys(model, i)
        cached = self._cache.pop((model, i), None)  # combine works in place
        if pending is None:
            pending = held.run(self._read_cmds(model, i, field))
        (tag, mark), w = pending[1], (pending[2] if len(pending) > 2 else None)
        if mark is not None:
            held.run([("UNWATCH",)])
            if cached is not None:
                self._cache[(model, i)] = cached
            return "skipped", None
        if tag is None:
            held.run([("UNWATCH",)])
            raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
        if cached is None or cached[0] != tag:
            self._foreign = True  # written by another process (or not cached here)
        if w is None and (cached is None or cached[0] != tag):
            w = held.run([("GET", wkey)])[0]  # still under the WATCH
            if w is None:
                raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
        ws = cached[1] if w is None else np.frombuffer(w, dtype=np.float32).copy()
        new = combine(ws)
        if new is None:
            held.run([("UNWATCH",)])
            return "rejected", None
        new_tag = _new_tag()
        cmds: list[tuple[Any, ...]] = [("MULTI",), ("SET", wkey, _as_bytes(new)),
                                       ("HSET", mkey, "tag", new_tag, field, token), ("HINCRBY", mkey, "v", 1),
                                       ("EXEC",)]
        if next_shard is not None:
            cmds += self._read_cmds(model, next_shard, field)
        res = held.run(cmds)
        ahead = res[5:] if next_shard is not None else None
        if res[4] is None:
            # Aborted: another merge wrote the shard after our WATCH. The next shard's
            # read-ahead is dropped: re-watching this shard on the same connection would
            # tie the two shards' commits together.
            if next_shard is not None:
                held.run([("UNWATCH",)])
            return "conflict", None
        self._cache[(model, i)] = (new_tag, new)
        return "applied", ahead

    def _commit_all_cached(self, held: _Held, model: str, shards: list[int], field: str, token: str,
                           fn_for: Callable[[int], Callable[[np.ndarray], np.ndarray | None]]) -> set[int] | None:
        """Lone-assimilator fast path: every listed shard's cached copy current and none
        carrying the unit -> all merged from the cache and committed in one MULTI/EXEC
        (one round trip to check, one to commit; no shard bytes read).

        Returns the shards now done (applied here, or already carrying the unit), an
        empty set when the per-shard path must take over, None when rejected."""
        keys = [k for i in shards for k in self._shard_keys(model, i)]
        heads = held.run([("WATCH", *keys), *[("HMGET", self._shard_keys(model, i)[1], "tag", field)
                                               for i in shards]])[1:]
        if any(mark is not None or tag != self._cache[(model, i)][0]
               for i, (tag, mark) in zip(shards, heads, strict=True)):
            held.run([("UNWATCH",)])
            return set()
        news: list[tuple[int, np.ndarray, bytes]] = []
        for i in shards:
            _tag, buf = self._cache.pop((model, i))  # combine works in place
            new = fn_for(i)(buf)
            if new is None:
                held.run([("UNWATCH",)])
                return None
            news.append((i, new, _new_tag()))
        cmds: list[tuple[Any, ...]] = [("MULTI",)]
        for i, new, new_tag in news:
            wkey, mkey = self._shard_keys(model, i)
            cmds += [("SET", wkey, _as_bytes(new)), ("HSET", mkey, "tag", new_tag, field, token),
                     ("HINCRBY", mkey, "v", 1)]
        res = held.run([*cmds, ("EXEC",)])
        if res[-1] is None:
            return set()  # another writer came in: the per-shard path re-reads every shard
        for i, new, new_tag in news:
            self._cache[(model, i)] = (new_tag, new)
        return set(shards)

    def _merge_shard(self, model: str, i: int, unit: str, token: str,
                     combine: Callable[[np.ndarray], np.ndarray | None], strict: bool,
                     max_retries: int, ahead: _ReadAhead | None = None,
                     next_shard: int | None = None) -> tuple[str, int, _ReadAhead | None]:
        """Apply ``combine`` to shard ``i`` once: ``applied``, ``skipped`` (already
        carries the unit) or ``rejected``; with the number of conflicts retried.

        On one Redis the read of ``next_shard`` rides in the same round trip as this
        shard's check-and-set (returned as a read-ahead for the next call): half the
        round trips, and the next shard's conflict window is unchanged."""
        keys = self._shard_keys(model, i)
        read = self._script("read_shard", sh.READ_SHARD)
        cas = self._script("cas_shard", sh.CAS_SHARD)
        field = f"u:{unit}"
        retries = 0
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                if ahead is not None:
                    cached, (tag, _v, mark, w) = ahead
                    ahead = None
                else:
                    # Popped: combine works in place, so a failed attempt must not leave
                    # a half-merged buffer in the cache.
                    cached = self._cache.pop((model, i), None)
                    tag, _v, mark, w = read(keys=keys, args=[field, cached[0] if cached else b""])
                if mark is not None:
                    if cached is not None:
                        self._cache[(model, i)] = cached
                    return "skipped", retries, None
                if w is None:
                    if tag is None or cached is None:
                        raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
                    ws = cached[1]
                else:
                    ws = np.frombuffer(w, dtype=np.float32).copy()
                new = combine(ws)
                if new is None:
                    return "rejected", retries, None
                new_tag = _new_tag()
                cas_args = [tag if strict else b"", new_tag, field, token, _as_bytes(new)]
                nxt: _ReadAhead | None = None
                if next_shard is not None and not self.cluster:
                    nxt_cached = self._cache.pop((model, next_shard), None)
                    p = self.r.pipeline(transaction=False)
                    cas(keys=keys, args=cas_args, client=p)
                    read(keys=self._shard_keys(model, next_shard),
                         args=[field, nxt_cached[0] if nxt_cached else b""], client=p)
                    res, nxt_read = p.execute()
                    nxt = (nxt_cached, nxt_read)
                else:
                    res = cas(keys=keys, args=cas_args)
                if int(res[0]) == 1:
                    self._cache[(model, i)] = (new_tag, new)
                    return "applied", retries, nxt
                if int(res[0]) == 0:
                    return "skipped", retries, nxt  # another merge of this unit got there first
                if nxt is not None and nxt[0] is not None:
                    self._cache[(model, next_shard)] = nxt[0]  # type: ignore[index]
                retries += 1
                if retries > max_retries:
                    raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts on shard {i}")
            except (redis.RedisError, redis.RedisClusterException, OSError) as e:
                if not (isinstance(e, OSError) or is_transient(e)):
                    raise
                now = time.monotonic()
                deadline = now + self.retry_s if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(f"Redis unreachable during merge of {unit}: {e}") from None
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)

    def _finalize(self, model: str, unit: str, token: str, record: dict[str, Any], epoch: int | None,
                  retries: int) -> MergeOutcome:
        """Set the unit's global mark once every shard carries it (idempotent)."""
        script = self._script("finalize", sh.FINALIZE)
        rec = json.dumps({**record, "t": time.time(), "token": token})[:-1]
        keys = [self.k("assimilated"), self.k("unit_state"),
                self.k("epoch", epoch if epoch is not None else "none"), self.k("metrics"), self.k("v", model),
                self.k("failed")]
        args = [unit, rec, "1" if epoch is not None else "0", model]
        res = self.call(lambda: script(keys=keys, args=args))
        if int(res[0]) == 1:
            return MergeOutcome(True, int(res[1]), retries)
        if int(res[0]) == -1:
            return MergeOutcome(False, self.version(model), retries, given_up=True)
        return self._outcome_of_mark(model, res[1], token, retries)

    def _outcome_of_mark(self, model: str, prev: bytes, token: str, retries: int) -> MergeOutcome:
        """The outcome for a unit already marked: our own merge (a lost reply) or another."""
        if _record_token(prev) == token:
            return MergeOutcome(True, int(json.loads(prev).get("version", 0)), retries)
        return MergeOutcome(False, self.version(model), retries, duplicate=True)

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
            patterns = {f"{self.ns}:*", f"{PREFIX}:{self.job}:s:*"}
            keys = {k for pat in patterns for k in self.r.scan_iter(match=pat, count=1000)}
            for k in keys:  # one by one: a cluster refuses a DEL across slots
                self.r.delete(k)
            self.r.srem(f"{PREFIX}:jobs", self.job)
            self._cache.clear()
            self._layouts.clear()
        self.call(op)


class _Held:
    """One connection taken from a client's pool for a run of commands that must share
    it (WATCH state lives on a connection). Replies come back in order; error replies
    are read to the end (the connection stays in step) and the first one is raised."""

    def __init__(self, client: redis.Redis):
        self.pool = client.connection_pool
        self.conn = self.pool.get_connection()

    def run(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        c = self.conn
        c.send_packed_command(_pack(cmds), check_health=False)
        out: list[Any] = []
        err: redis.ResponseError | None = None
        for _ in cmds:
            try:
                out.append(c.read_response())
            except redis.ResponseError as e:
                err = err or e
                out.append(e)
        if err is not None:
            raise err
        return out

    def release(self) -> None:
        self.pool.release(self.conn)

    def discard(self) -> None:
        """Give the connection back closed: it may be mid-WATCH or mid-reply."""
        self.conn.disconnect()
        self.pool.release(self.conn)


def _pack(cmds: list[tuple[Any, ...]]) -> list[bytes | memoryview]:
    """RESP requests for ``cmds``, shard bytes passed through as they are: hiredis'
    packer copies every argument into one buffer (20 MB per merge, for nothing)."""
    out: list[bytes | memoryview] = []
    head = bytearray()
    for cmd in cmds:
        head += b"*%d\r\n" % len(cmd)
        for a in cmd:
            if isinstance(a, memoryview):
                head += b"$%d\r\n" % a.nbytes
                out += [bytes(head), a]
                head = bytearray(b"\r\n")
                continue
            b = a if isinstance(a, bytes) else str(a).encode()
            head += b"$%d\r\n%s\r\n" % (len(b), b)
    if head:
        out.append(bytes(head))
    return out


def _is_redirect(e: BaseException) -> bool:
    """A cluster's MOVED/ASK: the slot lives elsewhere now (refresh the map, retry)."""
    return isinstance(e, redis.ResponseError) and str(e).startswith(("MOVED", "ASK"))


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


def _arity(fn: Callable[..., Any]) -> int:
    """Number of positional parameters ``fn`` takes (2 when it cannot be told)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.default is p.empty)


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
