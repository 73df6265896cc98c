"""Merging a result into a model's sharded weights, exactly once per shard.

The merge half of :class:`~boinc_dl.server.assimilator.store.JobStore` (mixed into it): strict merges
commit each shard with ``WATCH``/``MULTI``/``EXEC`` on one held connection, eventual
merges with the ``CAS_SHARD`` Lua script, and one ``FINALIZE`` script sets the unit's
global mark with its accounting. The protocol and its guarantees:
``docs/parameter-server.md``; the keys: :mod:`boinc_dl.server.assimilator.shards`.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from boinc_dl.server.assimilator import shards as sh
from boinc_dl.server.assimilator.mergelog import LoggedMerging
from boinc_dl.server.assimilator.retry import Backoff, is_redirect, is_transient
from boinc_dl.server.common.errors import StoreUnavailable, UnknownJob

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


class ShardMerging(LoggedMerging):
    """``merge`` and its machinery, mixed into :class:`~boinc_dl.server.assimilator.store.JobStore`,
    which provides the connection, the keys (``k``, ``_shard_keys``), ``layout``,
    ``version``, ``call`` and ``_script``, and the caches annotated here."""

    r: Any
    job: str
    cluster: bool
    retry_s: float
    # (model, shard) -> (tag, buffer) this process wrote last; model -> alone on it.
    _cache: dict[tuple[str, int], tuple[bytes, np.ndarray]]
    _alone: dict[str, bool]
    _from_snapshot: set[tuple[str, int]]
    _foreign: bool
    #: Called with the number of shards this merge call has committed so far, after
    #: each commit (a fault-injection point for crash tests; None in production).
    on_shard_applied: Callable[[int], None] | None

    def _shard_applied(self, n: int) -> None:
        if self.on_shard_applied is not None:
            self.on_shard_applied(n)

    def merge(
        self,
        model: str,
        unit: str,
        combine: Callable[..., np.ndarray | None],
        record: dict[str, Any],
        epoch: int | None,
        strict: bool = True,
        max_retries: int = 1000,
        source: Path | None = None,
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

        ``source``: the result's weights file ``combine`` takes its values from. With
        it, a strict merge whose ``record`` names a registered rule (``record["rule"]``,
        parameters in ``record["rule_params"]``: :mod:`~boinc_dl.server.assimilator.rules`)
        in a job with a durable dir is *logged*: its shard bytes stay out of Redis's
        append-only file and a small merge log makes it durable
        (:mod:`~boinc_dl.server.assimilator.mergelog`). ``combine`` must then compute
        exactly that rule on the file's values: a replay recomputes it from them.
        Otherwise the shard bytes are logged, as before.
        """
        # Names this call's merge: a retry after a lost reply finds its own marks.
        token = os.urandom(8).hex()
        # This merge's own durations, on the assimilator's clock, go into its record:
        # the whole call (``merge_s``) and its waits for Redis' commits (``commit_s``).
        _COMMIT.s, _COMMIT.t0, _COMMIT.cpu0 = 0.0, time.perf_counter(), time.thread_time()
        def marks() -> list[Any]:
            # One round trip: both hashes are job bookkeeping keys (one slot in a cluster).
            p = self.r.pipeline(transaction=False)
            p.hget(self.k("assimilated"), unit)
            p.hexists(self.k("failed"), unit)
            return p.execute()
        prev, failed = self.call(marks)
        logged = self.can_log(record, source, strict)
        if (prev is not None or failed) and source is not None:
            self.release_inputs()
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
        # Start at a random shard: concurrent merges of one model then mostly touch
        # different shards at any moment instead of queueing on shard 0.
        start = int.from_bytes(os.urandom(2), "big") % lay.shards
        order = [(start + j) % lay.shards for j in range(lay.shards)]

        def fn_for(i: int) -> Callable[[np.ndarray], np.ndarray | None]:
            sl = lay.bounds(i)
            return (lambda part: combine(part)) if one_arg else (lambda part: combine(part, sl))
        if logged:
            assert source is not None
            return self._merge_logged(model, unit, fn_for, order, record, epoch, source, max_retries)
        if strict:
            retries, applied_here = self._merge_strict(model, order, unit, token, fn_for, max_retries)
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
                self._shard_applied(applied_here)
        return self._finalize(model, unit, token, record, epoch, retries)

    # ---- strict merges: WATCH/MULTI on one held connection ------------------------------
    # A shard's bytes go to Redis as a plain SET inside MULTI/EXEC, guarded by WATCH on
    # the shard's keys: Redis stores the received bulk string as the value itself and
    # appends it to the AOF once, where a Lua check-and-set copies it twice more (into
    # the Lua VM, back out of it) and a Lua read copies it once more. With Redis busy
    # mostly moving bytes, that is the difference between ~15 and ~20+ merges/s.
    def _merge_strict(self, model: str, order: list[int], unit: str, token: str,
                      fn_for: Callable[[int], Callable[[np.ndarray], np.ndarray | None]],
                      max_retries: int) -> tuple[int, int]:
        """Apply every shard not yet carrying ``unit`` (strict: no update lost).

        Returns (conflicts retried, shards applied here); -1 applied: rejected before
        any shard was written. A lone assimilator whose cached copies are all current
        commits every shard in one MULTI/EXEC; otherwise shard by shard, each shard's
        read of the next riding in the same round trip as this one's commit."""
        field = f"u:{unit}"
        retries, applied, left = 0, 0, list(order)
        backoff = Backoff(self.retry_s)
        while left:
            held: _Held | None = None
            dead = False
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
                    self._shard_applied(applied)
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
                    if status == "dead":
                        dead = True
                        break
                    left.pop(0)
                    if status == "applied":
                        applied += 1
                        self._shard_applied(applied)
                    if self.cluster and left:
                        held.release()
                        held = _Held(self._client_for(self._shard_keys(model, left[0])[0]))
                held.release()
                held = None
                if dead:
                    # Redis restarted since the shard was merged: rebuild it, then go on.
                    self.recover(model)
                    continue
                # Nobody else wrote any shard since this process did: the next merge can
                # take the cached fast path (and skip reading the bytes).
                self._alone[model] = not self._foreign
            except BaseException as e:
                if held is not None:
                    held.discard()
                    held = None
                if not isinstance(e, redis.RedisError | redis.RedisClusterException | OSError):
                    raise
                if not (isinstance(e, OSError) or is_transient(e) or is_redirect(e)):
                    raise
                # Connection lost (a reply may be lost after Redis applied a commit): the
                # retry re-reads every shard left, and one carrying the unit is skipped.
                if self.cluster and is_redirect(e):
                    self.r.nodes_manager.initialize()  # a slot moved (failover, resharding)
                backoff.wait(f"merge of {unit}", e)
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

    def _take_cached(self, model: str, i: int) -> tuple[Any, bool]:
        """Remove shard ``i``'s cached (tag, buffer) (None when absent) and say whether a
        snapshot put it there. Taken, not read: combine works in place, so a failed
        attempt must not leave a half-merged buffer behind."""
        from_snapshot = (model, i) in self._from_snapshot
        self._from_snapshot.discard((model, i))
        return self._cache.pop((model, i), None), from_snapshot

    def _read_cmds(self, model: str, i: int, field: str) -> list[tuple[Any, ...]]:
        """Watch shard ``i`` and read its tag and mark, and its bytes unless this process
        holds a copy likely current: it is alone on the model, or a snapshot just read
        the shard (then the bytes are read only if the tag moved)."""
        wkey, mkey = self._shard_keys(model, i)
        # The server's run id rides along: an epoch tag is live only on the server it names.
        cmds: list[tuple[Any, ...]] = [("WATCH", wkey, mkey), ("EVAL", sh.RUN_ID_SCRIPT, 0),
                                       ("HMGET", mkey, "tag", field, "v", "bv")]
        key = (model, i)
        if not (key in self._cache and (self._alone.get(model) or key in self._from_snapshot)):
            cmds.append(("GET", wkey))
        return cmds

    def _commit_shard(self, held: _Held, model: str, i: int, field: str, token: str,
                      combine: Callable[[np.ndarray], np.ndarray | None], pending: list[Any] | None,
                      next_shard: int | None) -> tuple[str, list[Any] | None]:
        """One attempt at shard ``i``: ``applied``, ``skipped`` (it carries the unit),
        ``conflict`` (written by another merge meanwhile: retry), ``dead`` (not live:
        rebuild it first) or ``rejected``; with the replies of the next shard's read
        when it rode along."""
        wkey, mkey = self._shard_keys(model, i)
        if pending is None:
            pending = held.run(self._read_cmds(model, i, field))  # before the cache entry goes
        cached, from_snapshot = self._take_cached(model, i)
        rid, (tag, mark, v, bv), w = pending[1], pending[2], (pending[3] if len(pending) > 3 else None)
        if mark is not None:
            held.run([("UNWATCH",)])
            if cached is not None:
                self._cache[(model, i)] = cached
            return "skipped", None
        if not self._live(tag, v, bv, rid):
            held.run([("UNWATCH",)])
            return "dead", None
        if tag is None:
            held.run([("UNWATCH",)])
            raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
        if cached is None or cached[0] != tag or from_snapshot:
            self._foreign = True  # written by another process (or not cached here)
        if w is None and (cached is None or cached[0] != tag):
            w = held.run([("GET", wkey)])[0]  # still under the WATCH
            if w is None:
                raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
        ws = _writable(cached[1]) if w is None else np.frombuffer(w, dtype=np.float32).copy()
        new = combine(ws)
        if new is None:
            held.run([("UNWATCH",)])
            return "rejected", None
        new_tag = sh.new_tag()
        nv = int(v or 0) + 1  # v cannot move under the WATCH
        cmds: list[tuple[Any, ...]] = [("MULTI",), ("SET", wkey, sh.as_bytes(new)),
                                       ("HSET", mkey, "tag", new_tag, field, nv, "v", nv, "bv", nv),
                                       ("EXEC",)]
        if next_shard is not None:
            cmds += self._read_cmds(model, next_shard, field)
        res = held.run(cmds)
        ahead = res[4:] if next_shard is not None else None
        if res[3] is None:
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
        rid, *heads = held.run([("WATCH", *keys), ("EVAL", sh.RUN_ID_SCRIPT, 0),
                                *[("HMGET", self._shard_keys(model, i)[1], "tag", field, "v", "bv")
                                  for i in shards]])[1:]
        if any(mark is not None or tag != self._cache[(model, i)][0] or not self._live(tag, v, bv, rid)
               for i, (tag, mark, v, bv) in zip(shards, heads, strict=True)):
            held.run([("UNWATCH",)])
            return set()
        news: list[tuple[int, np.ndarray, bytes]] = []
        for i in shards:
            (_tag, buf), _ = self._take_cached(model, i)
            new = fn_for(i)(_writable(buf))
            if new is None:
                held.run([("UNWATCH",)])
                return None
            news.append((i, new, sh.new_tag()))
        cmds: list[tuple[Any, ...]] = [("MULTI",)]
        for (i, new, new_tag), (_tag, _mark, v, _bv) in zip(news, heads, strict=True):
            wkey, mkey = self._shard_keys(model, i)
            nv = int(v or 0) + 1
            cmds += [("SET", wkey, sh.as_bytes(new)), ("HSET", mkey, "tag", new_tag, field, nv, "v", nv, "bv", nv)]
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
        backoff = Backoff(self.retry_s)
        while True:
            try:
                if ahead is not None:
                    cached, (tag, _v, mark, w, live) = ahead
                    ahead = None
                else:
                    cached, _ = self._take_cached(model, i)
                    tag, _v, mark, w, live = read(keys=keys, args=[field, cached[0] if cached else b""])
                if mark is not None:
                    if cached is not None:
                        self._cache[(model, i)] = cached
                    return "skipped", retries, None
                if not int(live):
                    self.recover(model)
                    continue
                if w is None:
                    if tag is None or cached is None:
                        raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
                    ws = _writable(cached[1])
                else:
                    ws = np.frombuffer(w, dtype=np.float32).copy()
                new = combine(ws)
                if new is None:
                    return "rejected", retries, None
                new_tag = sh.new_tag()
                cas_args = [tag if strict else b"", new_tag, field, sh.as_bytes(new)]
                nxt: _ReadAhead | None = None
                if next_shard is not None and not self.cluster:
                    nxt_cached, _ = self._take_cached(model, next_shard)
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
                if int(res[0]) == -2:
                    self.recover(model)
                if nxt is not None and nxt[0] is not None:
                    self._cache[(model, next_shard)] = nxt[0]  # type: ignore[index]
                retries += 1
                if retries > max_retries:
                    raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts on shard {i}")
            except (redis.RedisError, redis.RedisClusterException, OSError) as e:
                if not (isinstance(e, OSError) or is_transient(e)):
                    raise
                backoff.wait(f"merge of {unit}", e)

    def _finalize(self, model: str, unit: str, token: str, record: dict[str, Any], epoch: int | None,
                  retries: int) -> MergeOutcome:
        """Set the unit's global mark once every shard carries it (idempotent)."""
        script = self._script("finalize", sh.FINALIZE)
        timing = {"merge_s": round(time.perf_counter() - getattr(_COMMIT, "t0", time.perf_counter()), 6),
                  "merge_cpu_s": round(time.thread_time() - getattr(_COMMIT, "cpu0", time.thread_time()), 6),
                  "commit_s": round(_commit_wait(), 6)}
        rec = json.dumps({**record, **timing, "t": time.time(), "token": token})[:-1]
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


def _writable(a: np.ndarray) -> np.ndarray:
    """``a`` itself, or a copy when it is a read-only view (a snapshot's reply bytes)."""
    return a if a.flags.writeable else a.copy()


#: Seconds this thread's current merge waited on Redis for its commits (MULTI/EXEC
#: and logged-commit scripts), measured on the assimilator's clock around each round
#: trip: the per-merge ``commit_s`` of the merge record (units.csv; the planner's
#: calibration reads it).
_COMMIT = threading.local()


def _commit_wait() -> float:
    return float(getattr(_COMMIT, "s", 0.0))


class _Held:
    """One connection taken from a client's pool for a run of commands that must share
    it (WATCH state lives on a connection). Replies come back in order; error replies
    are read to the end (the connection stays in step) and the first one is raised."""

    def __init__(self, client: redis.Redis):
        self.pool = client.connection_pool
        self.conn = self.pool.get_connection()

    def run(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        commit = any(cmd and cmd[0] in ("EXEC", "EVALSHA") for cmd in cmds)
        t0 = time.perf_counter() if commit else 0.0
        try:
            return self._run(cmds)
        finally:
            if commit:
                _COMMIT.s = _commit_wait() + time.perf_counter() - t0

    def send(self, cmds: list[tuple[Any, ...]]) -> None:
        """Send ``cmds`` without reading their replies (:meth:`read` them, in order)."""
        self.conn.send_packed_command(_pack(cmds), check_health=False)

    def read(self, n: int) -> list[Any]:
        """The replies of ``n`` commands sent by :meth:`send` (first error raised)."""
        commit_t0 = time.perf_counter()
        try:
            return self._read(n)
        finally:
            _COMMIT.s = _commit_wait() + time.perf_counter() - commit_t0

    def _run(self, cmds: list[tuple[Any, ...]]) -> list[Any]:
        self.send(cmds)
        return self._read(len(cmds))

    def _read(self, n: int) -> list[Any]:
        c = self.conn
        out: list[Any] = []
        err: redis.ResponseError | None = None
        for _ in range(n):
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
