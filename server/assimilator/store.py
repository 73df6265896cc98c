"""Redis state of every job, namespaced per job (``bdl:{job}:...``).

Keys of job J:

=============================  ===================================================
``bdl:jobs``                   set of job names
``bdl:J:spec``                 the job spec (canonical JSON)
``bdl:J:meta``                 hash: status, mode, fingerprint, created_at, ...
``bdl:J:layout``               hash model -> JSON {n, shards}: how M's weights are cut
``bdl:J:s:{J/M/i}:w``          shard i of model M's server weights (float32 bytes)
``bdl:J:s:{J/M/i}:m``          hash: shard i's tag, version and per-unit "applied" marks
``bdl:J:mlog:M``               hash unit -> the intent of a durable merge of M (merge log)
``bdl:J:mrec:M``               hash: M's commit records (``<shard>:<unit>`` -> ``i:v,...``)
                               and its inputs' SHA-256 (``s:<unit>``): the merge log, one Redis
``bdl:J:v:M``                  weights version of model M (number of merged units)
``bdl:J:units``                hash unit -> JSON (epoch, subset/partition, model, state)
``bdl:J:assimilated``          hash unit -> JSON merge record (the idempotency mark)
``bdl:J:failed``               hash unit -> reason, units given up on for good
``bdl:J:epoch:E``              hash: created, assimilated, failed, started_at, ...
``bdl:J:epochs``               hash E -> JSON epoch summary (validation accuracy ...)
``bdl:J:metrics``              stream: one entry per merge (its record: ``assimilated``),
                               give-up, epoch end
``bdl:J:rejections``           stream: rejected results with their reasons
``bdl:J:rejected_results``     set: the job system's names of the results recorded there (each once)
``bdl:J:host_demotions``       hash result -> JSON: the job system's host whose trust a refusal of
                               that result withdrew (BOINC's ``consecutive_valid`` reset), or why not yet
``bdl:J:host_demotions:pending``  set: refused results whose host is still to be demoted (DB unreachable)
``bdl:J:unit_state``           hash unit -> created, in_progress, assimilated, failed, cancelled
``bdl:J:counters``             hash: counters (rejected, superseded calls, ...)
``bdl:J:fingerprints``         hash model -> its fingerprint (tensor names, shapes, dtypes)
``bdl:J:opt:M``                MOP: the optimizer state hopping with model M (its version)
``bdl:J:trusted:S:M``          list: trusted values [epoch, value(, base loss)] of statistic S
``bdl:J:trusted_frozen:S:M``   hash epoch -> the value of S frozen for that epoch
``bdl:J:once:<token>``         idempotency tokens of retried increments (expire in an hour)
``bdl:J:losscheck:queue``      list: ids of results waiting for the held-out loss check (each once)
``bdl:J:losscheck:pending``    hash id -> the check request (JSON, with its stamp) until answered
``bdl:J:losscheck:observe``    list: trusted results to measure for the check's statistic (bounded)
``bdl:J:losscheck:v:<id>``     a result's loss-check verdict (JSON; set once, expires in a week)
``bdl:J:losscheck:done:<id>``  list: notice that the verdict is set, for a waiting assimilator (1 min)
``bdl:J:losscheck:alive``      the loss checker's heartbeat (expires unless refreshed)
``bdl:J:losscheck:ledger:M``   hash host id -> its loss ledger balance (written with its verdicts)
``bdl:J:losscheck:stale``      hash model -> results judged against trusted changes from worse models
=============================  ===================================================

Other owners keep their own keys in the job's namespace: BOINC's workunit records
(:mod:`boinc_dl.server.backends.boinc.registry`), MOP's search state
(:mod:`boinc_dl.server.work_generator.mop.state`); the fleet controller keeps its state
under ``bdl:fleet:{F}:...`` (:mod:`boinc_dl.server.fleet.state`).

Weights are sharded (:mod:`boinc_dl.server.assimilator.shards`) and merged by
:class:`~boinc_dl.server.assimilator.merging.ShardMerging` (mixed in): shard by shard, each shard's
bytes and its "unit applied" mark committed together, then one script sets the unit's
global "assimilated" mark with the epoch accounting. Weights written by earlier
releases as one value (``bdl:J:w:M``) are cut into shards on first use. In a Redis
Cluster (:mod:`boinc_dl.server.assimilator.connection`) the job's bookkeeping keys are ``bdl:{J}:...``
(one slot), each shard its own slot.

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

Every Redis key of a job and the Lua scripts that change them together are one
contract, kept in this module; the merge protocol is in :mod:`boinc_dl.server.assimilator.merging`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import redis

from boinc_dl.server.assimilator import shards as sh
from boinc_dl.server.assimilator.connection import is_cluster
from boinc_dl.server.assimilator.merging import ShardMerging
from boinc_dl.server.assimilator.retained import RetainedInput
from boinc_dl.server.assimilator.retry import Backoff, is_transient
from boinc_dl.server.assimilator.shards import ShardLayout, Snapshot
from boinc_dl.server.common.errors import StoreUnavailable, UnknownJob
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.common.weights import Fingerprint

PREFIX = "bdl"

#: How long a JobStore call retries while Redis is unreachable. Long enough to ride
#: through a Redis restart (reloading the append-only file takes about a second per
#: GB), short enough that a daemon whose Redis is gone for good says so.
DEFAULT_RETRY_S = 30.0
#: Lifetime of an idempotency token: far longer than any retry window.
TOKEN_TTL_S = 3600


class JobStore(ShardMerging):
    """All Redis access for one job.

    Methods retry while Redis is unreachable, for up to ``retry_s`` seconds, then raise
    :class:`StoreUnavailable` (``retry_s=0``: a single attempt).
    """

    def __init__(self, r: redis.Redis, job: str, retry_s: float = DEFAULT_RETRY_S,
                 on_shard_applied: Callable[[int], None] | None = None,
                 on_merge_step: Callable[[str], None] | None = None):
        self.r = r
        self.on_shard_applied = on_shard_applied
        #: Called with ``retained``, ``intent`` and ``finalized`` as a logged merge passes
        #: those steps (fault injection for crash tests; None in production).
        self.on_merge_step = on_merge_step
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
        self._from_snapshot: set[tuple[str, int]] = set()  # cache entries a snapshot read
        self._foreign = False
        # Durable merges (mergelog): result files retained ahead of their merge, and the
        # job's durable dir (False: not looked up yet; None: the job has none).
        self._prefetched: dict[tuple[str, str], RetainedInput] = {}
        self._durable_dir: Path | None | bool = False

    # ---- keys -------------------------------------------------------------------------
    def k(self, *parts: object) -> str:
        return ":".join([self.ns, *map(str, parts)])

    # ---- reconnection -----------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (Redis commands), retrying it while Redis is unreachable.

        ``fn`` must be idempotent (a retry may follow a reply lost after Redis applied
        the commands). Raises :class:`StoreUnavailable` once ``retry_s`` has passed.
        """
        backoff = Backoff(self.retry_s)
        while True:
            try:
                return fn()
            except (redis.RedisError, redis.RedisClusterException, OSError) as e:
                if not is_transient(e) and not isinstance(e, OSError):
                    raise
                backoff.wait(None, e)

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

    # Cancelling is a compare-and-set: a job that finished meanwhile (the run's last epoch
    # closing as the user cancels) keeps its status.
    _CANCEL = """
    local status = redis.call('HGET', KEYS[1], 'status')
    for i = 3, #ARGV do if status == ARGV[i] then return status end end
    redis.call('HSET', KEYS[1], 'status', 'cancelled', 'stopping', 1, 'finished_at', ARGV[1], 'reason', ARGV[2])
    return ''
    """

    def cancel(self, reason: str = "cancelled by the user") -> str | None:
        """End the job as cancelled unless it has finished already; returns the status it
        had finished with (``done``, ``failed``, ``cancelled``), or ``None`` when this call
        cancelled it."""
        script = self._script("cancel", self._CANCEL)
        was = self.call(lambda: script(keys=[self.k("meta")], args=[time.time(), reason, *FINISHED]))
        was = was.decode() if isinstance(was, bytes) else str(was or "")
        return was or None

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
            part = sh.as_bytes(flat[lay.bounds(i)])

            def op(wkey: str = wkey, mkey: str = mkey, part: memoryview = part) -> None:
                p = self.r.pipeline(transaction=True)
                # Logged in full (bytes, tag, v and bv): the starting point of every
                # replay, whatever the merges after it log.
                p.set(wkey, part, nx=True)
                p.hsetnx(mkey, "tag", sh.new_tag())
                p.hsetnx(mkey, "v", version)
                p.hsetnx(mkey, "bv", version)
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

    def recover(self, model: str = "0") -> None:
        """Rebuild the shards of ``model`` whose bytes Redis lost in a restart (from the
        newest snapshot and the merge log), or wait for the process doing it."""
        from boinc_dl.server.assimilator.recovery import ensure_live

        ensure_live(self, model)

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
        if not all(int(rep[4]) for rep in replies):
            # Redis restarted since these shards were merged: rebuild them from the
            # snapshot and the merge log, then read again.
            self.recover(model)
            return self.snapshot(model)
        for i, (cached, (tag, v, _mark, w, _live)) in enumerate(zip(cache, replies, strict=True)):
            sl = lay.bounds(i)
            if w is None:
                if tag is None or cached is None or cached[0] != tag:
                    raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
                flat[sl] = cached[1]
            else:
                part = np.frombuffer(w, dtype=np.float32)  # read-only, over the reply's bytes
                flat[sl] = part
                # Kept for a merge that follows (the assimilator reads a snapshot to check
                # a result's distance, then merges it): its read of this shard then skips
                # the bytes while the tag is unchanged.
                self._cache[(model, i)] = (tag, part)
                self._from_snapshot.add((model, i))
            versions.append(int(v or 0))
        return Snapshot(flat, versions)

    def get_weights(self, model: str = "0") -> tuple[np.ndarray, int]:
        """Current server weights (a writable copy) and their version (see :meth:`snapshot`)."""
        s = self.snapshot(model)
        return s.flat, s.version

    def version(self, model: str = "0") -> int:
        """Number of units merged into ``model`` (the global counter)."""
        return int(self.call(lambda: self.r.get(self.k("v", model))) or 0)

    def progress(self) -> tuple[int, int]:
        """(units merged, units given up): one round trip; it changes exactly when a
        merge or a give-up lands (both hashes only grow)."""
        def read() -> tuple[int, int]:
            p = self.r.pipeline(transaction=False)
            p.hlen(self.k("assimilated"))
            p.hlen(self.k("failed"))
            n_ok, n_failed = p.execute()
            return int(n_ok), int(n_failed)
        return self.call(read)

    def is_assimilated(self, unit: str) -> bool:
        return bool(self.call(lambda: self.r.hexists(self.k("assimilated"), unit)))

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
    if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[4], ARGV[5], 1) end
    return 1
    """

    def register_unit(self, unit: str, info: dict[str, Any], epoch: int | None,
                      issued_from: tuple[str, int] | None = None) -> bool:
        """Record a created unit (returns False if it already existed: no double count).

        One Lua script: the record, its state, the epoch's ``created`` count and, with
        ``issued_from`` (model, weights version), that version's count of units issued
        from it (:meth:`issued_from`) change together or not at all, so a crash in between
        cannot desynchronise them.
        """
        script = self._script("register", self._REGISTER)
        model, version = issued_from if issued_from is not None else ("0", None)
        keys = [self.k("units"), self.k("unit_state"), self.k("epoch", epoch if epoch is not None else "none"),
                self.k("issued", model)]
        args = [unit, json.dumps(info), "1" if epoch is not None else "0", time.time(),
                str(int(version)) if version is not None else ""]
        return bool(self.call(lambda: script(keys=keys, args=args)))

    def count_issued(self, model: str, version: int) -> None:
        """One more unit issued from ``model``'s weights ``version`` (a regenerated unit)."""
        self.call(lambda: self.r.hincrby(self.k("issued", model), str(int(version)), 1))

    def issued_from(self, model: str, version: int) -> int:
        """Units the work generator issued from ``model``'s weights ``version`` (0: none
        recorded, a job created before the count was kept)."""
        raw = self.call(lambda: self.r.hget(self.k("issued", model), str(int(version))))
        try:
            return max(0, int(raw)) if raw is not None else 0
        except ValueError:
            return 0

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
    if ARGV[3] ~= '' and redis.call('SADD', KEYS[4], ARGV[3]) == 0 then return 0 end
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', '10000', '*', 'data', ARGV[2])
    redis.call('HINCRBY', KEYS[3], 'rejected', 1)
    return 1
    """

    def record_rejection(self, unit: str, result: str, reason: str, host: str | None = None) -> None:
        """A result that failed validation (the unit itself may still succeed later);
        ``host``: the job system's id of the host that computed it (BOINC's
        ``result.hostid``), when it named one.

        Recorded once even if a lost reply makes the call retry (idempotency token), and
        once per named result: BOINC re-runs an assimilator killed after its work, and the
        refused result's unit may still be open (issued again), so it is refused again.
        """
        entry = {"unit": unit, "result": result, "reason": reason, "t": time.time()}
        if host:
            entry["host_id"] = str(host)[:64]
        script = self._script("reject", self._REJECT)
        keys = [self._token_key(), self.k("rejections"), self.k("counters"), self.k("rejected_results")]
        self.call(lambda: script(keys=keys, args=[TOKEN_TTL_S, json.dumps(entry), result or ""]))

    # A demotion's record replaces the result's earlier one (a retry's outcome is the
    # latest word); ``hosts_demoted`` counts a result once, the first time its host's
    # trust is withdrawn.
    _DEMOTE = """
    local old = redis.call('HGET', KEYS[1], ARGV[1])
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[3] == '1' then
      redis.call('SREM', KEYS[2], ARGV[1])
      if ARGV[4] == '1' and not (old and cjson.decode(old)['demoted']) then
        redis.call('HINCRBY', KEYS[3], 'hosts_demoted', 1)
      end
    else
      redis.call('SADD', KEYS[2], ARGV[1])
      redis.call('HINCRBY', KEYS[3], 'host_demotions_failed', 1)
    end
    return 1
    """

    def record_host_demotion(self, result: str, entry: dict[str, Any], done: bool, demoted: bool) -> None:
        """Record what became of the host of refused result ``result``: handled (``done``;
        ``demoted`` when its trust was withdrawn, counted once per result in
        ``hosts_demoted``), or still to do (kept in the pending set for a later try;
        ``host_demotions_failed`` counts the failed tries). Recording the same outcome
        again changes nothing but the record's time and the failure count."""
        data = json.dumps({**entry, "result": result, "done": bool(done), "demoted": bool(done and demoted),
                           "t": time.time()})
        script = self._script("demote", self._DEMOTE)
        keys = [self.k("host_demotions"), self.k("host_demotions", "pending"), self.k("counters")]
        self.call(lambda: script(keys=keys, args=[result, data, "1" if done else "0", "1" if demoted else "0"]))

    def host_demotion(self, result: str) -> dict[str, Any] | None:
        """The record of the demotion of refused result ``result``'s host, if any."""
        raw = self.call(lambda: self.r.hget(self.k("host_demotions"), result))
        return json.loads(raw) if raw else None

    def host_demotions(self) -> dict[str, dict[str, Any]]:
        """Result name -> the record of its host's demotion (see :meth:`record_host_demotion`)."""
        rows = self.call(lambda: self.r.hgetall(self.k("host_demotions")))
        return {k.decode(): json.loads(v) for k, v in rows.items()}

    def pending_host_demotions(self, count: int = 8) -> list[str]:
        """Up to ``count`` refused results whose host is still to be demoted."""
        rows = self.call(lambda: self.r.srandmember(self.k("host_demotions", "pending"), count))
        return sorted(r.decode() for r in rows or [])

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

    def register_units(self, items: list[tuple[str, dict[str, Any], int]],
                       also: Callable[[Any], None] | None = None) -> None:
        """Record several created units ``(unit, info, epoch)`` in one transaction, with
        the caller's own commands (``also(pipeline)``, e.g. its scheduler's state) in the
        same MULTI/EXEC: all of it lands, or none. Not retried (a lost reply could count
        a unit twice): a StoreUnavailable leaves the caller to recover from its state."""
        def op() -> None:
            with self.r.pipeline(transaction=True) as p:
                for unit, info, epoch in items:
                    p.hsetnx(self.k("units"), unit, json.dumps(info))
                    p.hset(self.k("unit_state"), unit, "created")
                    p.hincrby(self.k("epoch", epoch), "created", 1)
                    p.hsetnx(self.k("epoch", epoch), "started_at", time.time())
                if also is not None:
                    also(p)
                p.execute()
        _guard(op)

    def update_unit_info(self, unit: str, info: dict[str, Any]) -> None:
        """Replace a registered unit's record (e.g. its files after a regeneration)."""
        self.call(lambda: self.r.hset(self.k("units"), unit, json.dumps(info)))

    def settled_of(self, units: list[str]) -> list[tuple[dict[str, Any] | None, str | None]]:
        """For each unit (in order): its merge record if merged, and its give-up reason if
        failed (one round trip)."""
        if not units:
            return []

        def read() -> list[Any]:
            p = self.r.pipeline(transaction=False)
            p.hmget(self.k("assimilated"), units)
            p.hmget(self.k("failed"), units)
            return p.execute()
        done, failed = self.call(read)
        return [(json.loads(d) if d is not None else None, f.decode() if f is not None else None)
                for d, f in zip(done, failed, strict=True)]

    # ---- per-model state beside the weights ---------------------------------------------
    def optimizer_state(self, model: str) -> bytes | None:
        """The optimizer state MOP hops with model ``model`` (tagged with its version)."""
        return self.call(lambda: self.r.get(self.k("opt", model)))

    def set_optimizer_state(self, model: str, blob: bytes) -> None:
        self.call(lambda: self.r.set(self.k("opt", model), blob))

    def clear_optimizer_state(self, model: str) -> None:
        self.call(lambda: self.r.delete(self.k("opt", model)))

    # ---- trusted statistics (the clip radius: server.assimilator.policy) ------------------
    def trusted_values(self, model: str, name: str, window: int) -> list[tuple[int, float]]:
        """The newest ``window`` trusted values of statistic ``name``, oldest first, each
        with its epoch."""
        return [(e, x) for e, x, _ in self.trusted_entries(model, name, window)]

    def trusted_entries(self, model: str, name: str, window: int) -> list[tuple[int, float, float | None]]:
        """:meth:`trusted_values` with what each was measured against (the held-out loss
        of the result's base, for the loss check; None where not recorded)."""
        raw = self.call(lambda: self.r.lrange(self.k("trusted", name, model), 0, window - 1))
        out: list[tuple[int, float, float | None]] = []
        for v in reversed(raw):
            e, x, *rest = json.loads(v)
            out.append((int(e), float(x), float(rest[0]) if rest and rest[0] is not None else None))
        return out

    def trusted_count(self, model: str, name: str) -> int:
        """How many trusted values of statistic ``name`` are kept (at most its window)."""
        return int(self.call(lambda: self.r.llen(self.k("trusted", name, model))))

    def push_trusted_value(self, model: str, name: str, epoch: int, value: float, window: int,
                           base_loss: float | None = None) -> None:
        """Add a trusted value (after the merge of the result it comes from); ``base_loss``:
        the held-out loss of the result's base, for a loss change."""
        key = self.k("trusted", name, model)
        entry = [int(epoch), float(value)] + ([float(base_loss)] if base_loss is not None else [])

        def op() -> None:
            p = self.r.pipeline(transaction=True)
            p.lpush(key, json.dumps(entry))
            p.ltrim(key, 0, window - 1)
            p.execute()
        self.call(op)

    def trusted_frozen(self, model: str, name: str, epoch: int) -> float | None:
        """The value of statistic ``name`` frozen for ``epoch``, if any."""
        v = self.call(lambda: self.r.hget(self.k("trusted_frozen", name, model), epoch))
        return float(v) if v is not None else None

    def freeze_trusted(self, model: str, name: str, epoch: int, value: float) -> float:
        """Freeze ``value`` for ``epoch`` unless another process froze one first; the
        value in force."""
        key = self.k("trusted_frozen", name, model)

        def op() -> Any:
            p = self.r.pipeline(transaction=True)
            p.hsetnx(key, epoch, repr(float(value)))
            p.hget(key, epoch)
            return p.execute()[1]
        return float(self.call(op))

    # ---- the held-out loss check (server.assimilator.losscheck) --------------------------
    # An assimilator asks, the work generator's checker answers; see losscheck.py for the
    # protocol. The queue holds request ids, each at most once; the request itself (with
    # the stamp of its latest queuing) is in the pending hash until its verdict is set.
    # Every write is a single command or script, safe to re-send.
    _LOSS_REQUEST = """
    if redis.call('EXISTS', KEYS[1]) == 1 then return 'verdict' end
    local cur = redis.call('HGET', KEYS[2], ARGV[1])
    if cur and (redis.call('LPOS', KEYS[3], ARGV[1]) or
                tonumber(ARGV[2]) - tonumber(cjson.decode(cur)['stamp']) < tonumber(ARGV[3])) then
      return 'pending'
    end
    if not cur and redis.call('LLEN', KEYS[3]) >= tonumber(ARGV[4]) then return 'full' end
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
    redis.call('LREM', KEYS[3], 0, ARGV[1])
    redis.call('LPUSH', KEYS[3], ARGV[1])
    if cur then
      local f = cjson.decode(cur)['file']
      if type(f) == 'string' and f ~= '' then return 'requeued ' .. f end
      return 'requeued'
    end
    return 'queued'
    """

    def _loss_verdict_key(self, rid: str) -> str:
        return self.k("losscheck", "v", rid)

    def loss_verdict(self, rid: str) -> dict[str, Any] | None:
        """The verdict on request ``rid``, once the checker (or the assimilator) set it."""
        v = self.call(lambda: self.r.get(self._loss_verdict_key(rid)))
        return json.loads(v) if v is not None else None

    def request_loss_check(self, rid: str, request: dict[str, Any], stamp: str, stale_s: float,
                           max_queue: int) -> str:
        """Queue the check of request ``rid``; what happened: ``verdict`` (answered: nothing
        queued), ``pending`` (still in the queue, or taken by the checker less than
        ``stale_s`` ago: left alone, its place in the queue kept), ``full``
        (``max_queue`` requests wait: nothing queued), ``queued``, or ``requeued <file>``
        (its earlier request, which named ``file``, is presumed lost: replaced, still
        queued once). ``stamp`` is a clock reading (seconds) of the caller's."""
        script = self._script("loss_request", self._LOSS_REQUEST)
        keys = [self._loss_verdict_key(rid), self.k("losscheck", "pending"), self.k("losscheck", "queue")]
        args = [rid, stamp, float(stale_s), int(max_queue), json.dumps({**request, "id": rid, "stamp": stamp})]
        return self.call(lambda: script(keys=keys, args=args)).decode()

    _LOSS_OBSERVE = """
    if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
    redis.call('LPUSH', KEYS[1], ARGV[2])
    return 1
    """

    def post_loss_observation(self, request: dict[str, Any], max_queue: int) -> bool:
        """Queue a trusted result for the checker to measure (no verdict, nobody waits);
        False when ``max_queue`` observations wait already (it is dropped: a sample of a
        statistic, not a result). Not retried: a lost reply could queue it twice."""
        script = self._script("loss_observe", self._LOSS_OBSERVE)
        return bool(_guard(lambda: script(keys=[self.k("losscheck", "observe")],
                                          args=[int(max_queue), json.dumps({**request, "kind": "observe"})])))

    def pop_loss_request(self, timeout_s: float) -> dict[str, Any] | None:
        """The next request for the checker, waiting up to ``timeout_s`` (None: none):
        checks before observations. A queued id whose request is answered already
        (replayed) comes back as ``{"kind": "answered", "id": ...}``."""
        queue, observe = self.k("losscheck", "queue"), self.k("losscheck", "observe")
        got = self.call(lambda: self.r.brpop([queue, observe], timeout=timeout_s))
        if not got:
            return None
        key, value = got[0].decode(), got[1]
        if key == observe:
            return json.loads(value)
        rid = value.decode()
        req = self.call(lambda: self.r.hget(self.k("losscheck", "pending"), rid))
        return json.loads(req) if req is not None else {"kind": "answered", "id": rid}

    def drop_loss_requests(self) -> int:
        """Forget every request not answered yet (verdicts stay): only for a job no checker
        serves and no assimilator waits on, as when ``boinc-dl run`` starts (a request
        taken by the checker of a run that was killed would otherwise wait out its stale
        time before it is queued again). How many were dropped."""
        queue, pending = self.k("losscheck", "queue"), self.k("losscheck", "pending")

        def op() -> int:
            p = self.r.pipeline(transaction=True)
            p.hlen(pending)
            p.delete(queue, pending)
            return int(p.execute()[0])
        return int(self.call(op))

    def loss_queue_length(self) -> int:
        """Checks queued (observations not counted)."""
        return int(self.call(lambda: self.r.llen(self.k("losscheck", "queue"))))

    def checker_load(self) -> tuple[int, float | None]:
        """Requests queued for the checker (checks and step searches) and the seconds its
        recent step searches took (None: none measured yet), in one round trip."""
        def read() -> list[Any]:
            p = self.r.pipeline(transaction=False)
            p.llen(self.k("losscheck", "queue"))
            p.get(self.k("losscheck", "step_s"))
            return p.execute()
        n, t = self.call(read)
        try:
            secs = float(t) if t is not None else None
        except ValueError:
            secs = None
        return int(n), secs if secs is not None and math.isfinite(secs) and secs >= 0 else None

    def note_step_seconds(self, seconds: float) -> None:
        """The checker's running mean of a step search's seconds (its answer time, queue
        not counted), which assimilators read to tell whether a search would come in time."""
        key = self.k("losscheck", "step_s")
        script = self._script("step_s", """
        local cur = tonumber(redis.call('GET', KEYS[1]))
        local x = tonumber(ARGV[1])
        if cur then x = 0.8 * cur + 0.2 * x end
        redis.call('SET', KEYS[1], tostring(x), 'EX', 86400)
        return 1
        """)
        self.call(lambda: script(keys=[key], args=[repr(float(seconds))]))

    _LOSS_VERDICT = """
    if redis.call('EXISTS', KEYS[1]) == 0 then
      if ARGV[4] ~= '' then
        -- the host's ledger moves with the verdict, once: only from the balance it was
        -- computed from (another verdict of the host landed meanwhile: compute again)
        local cur = redis.call('HGET', KEYS[4], ARGV[4]) or ''
        if cur ~= ARGV[5] then return {'conflict'} end
        redis.call('HSET', KEYS[4], ARGV[4], ARGV[6])
      end
      if ARGV[7] ~= '' then
        -- judged against trusted changes from worse models: counted with the verdict, once
        redis.call('HINCRBY', KEYS[5], ARGV[7], 1)
      end
      redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    end
    local req = redis.call('HGET', KEYS[2], ARGV[3])
    redis.call('HDEL', KEYS[2], ARGV[3])
    redis.call('RPUSH', KEYS[3], '1')
    redis.call('EXPIRE', KEYS[3], 60)
    return {redis.call('GET', KEYS[1]), req or ''}
    """

    def _ledger_key(self, model: str) -> str:
        return self.k("losscheck", "ledger", model)

    def ledger_balance(self, model: str, host: str) -> str | None:
        """Host ``host``'s loss ledger balance for ``model``, as stored (None: none yet)."""
        v = self.call(lambda: self.r.hget(self._ledger_key(model), host))
        return v.decode() if v is not None else None

    def ledger_balances(self, model: str = "0") -> dict[str, float]:
        """Every host's loss ledger balance for ``model``."""
        raw = self.call(lambda: self.r.hgetall(self._ledger_key(model)))
        return {k.decode(): float(v) for k, v in raw.items()}

    def loss_checks_stale(self) -> dict[str, int]:
        """Per model: untrusted results judged against trusted changes measured from much
        worse models (no comparable ones: the project replicates too little for the loss
        check and the ledger to follow the model; docs/merge-rules.md)."""
        raw = self.call(lambda: self.r.hgetall(self.k("losscheck", "stale")))
        return {k.decode(): int(v) for k, v in raw.items()}

    def set_loss_verdict(self, rid: str, verdict: dict[str, Any], ttl_s: int,
                         stale_model: str | None = None) -> tuple[dict[str, Any], str | None]:
        """Record the verdict on ``rid`` unless one exists (the first verdict wins: a
        replayed or re-queued request never flips it) and retire its request; returns the
        verdict in force and the file of the request retired (it may be a later one than
        the caller judged: the caller removes it). ``stale_model``: the verdict was judged
        against trusted changes from worse models; :meth:`loss_checks_stale` counts it with
        the verdict's write, once."""
        got = self._set_verdict(rid, verdict, ttl_s, None, stale_model)
        assert got is not None  # only a ledger step can conflict
        return got

    def set_loss_verdict_with_ledger(self, rid: str, verdict: dict[str, Any], ttl_s: int, model: str, host: str,
                                     expected: str | None, balance: float,
                                     stale_model: str | None = None) -> tuple[dict[str, Any], str | None] | None:
        """:meth:`set_loss_verdict`, and host ``host``'s ledger balance for ``model`` set to
        ``balance`` in the same script, only if no verdict exists yet and the balance is
        still ``expected`` (what :meth:`ledger_balance` gave when the verdict was
        computed). None when the balance changed meanwhile (nothing written: judge again)."""
        return self._set_verdict(rid, verdict, ttl_s, (model, host, expected, balance), stale_model)

    def _set_verdict(self, rid: str, verdict: dict[str, Any], ttl_s: int,
                     ledger: tuple[str, str, str | None, float] | None,
                     stale_model: str | None) -> tuple[dict[str, Any], str | None] | None:
        script = self._script("loss_verdict", self._LOSS_VERDICT)
        model = ledger[0] if ledger is not None else (stale_model or "0")
        keys = [self._loss_verdict_key(rid), self.k("losscheck", "pending"), self.k("losscheck", "done", rid),
                self._ledger_key(model), self.k("losscheck", "stale")]
        args: list[Any] = [json.dumps(verdict), int(ttl_s), rid]
        if ledger is not None:
            _, host, expected, new = ledger
            args += [host, expected if expected is not None else "", repr(float(new))]
        else:
            args += ["", "", ""]
        args.append(stale_model or "")
        got = self.call(lambda: script(keys=keys, args=args))
        if len(got) == 1:
            return None
        out, req = got
        retired = json.loads(req).get("file") if req else None
        return json.loads(out), retired if isinstance(retired, str) else None

    def wait_loss_notice(self, rid: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the notice that ``rid``'s verdict was set (a waiting
        assimilator wakes at once instead of polling); True if one came. A notice nobody
        takes expires after a minute; callers look the verdict up, notice or not."""
        got = self.call(lambda: self.r.blpop([self.k("losscheck", "done", rid)], timeout=timeout_s))
        return got is not None

    _LOSS_DROP = """
    local cur = redis.call('HGET', KEYS[1], ARGV[1])
    if cur and cjson.decode(cur)['stamp'] == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) return 1 end
    return 0
    """

    def drop_loss_request(self, rid: str, stamp: str) -> bool:
        """Retire the request ``stamp`` of ``rid`` without a verdict (its file is gone, or
        its base: the result's next delivery queues a fresh one at once); a request
        queued again since is left alone."""
        script = self._script("loss_drop", self._LOSS_DROP)
        return bool(self.call(lambda: script(keys=[self.k("losscheck", "pending")], args=[rid, stamp])))

    def loss_pending_count(self) -> int:
        """Requests not answered yet (queued, or lost with a checker that died)."""
        return int(self.call(lambda: self.r.hlen(self.k("losscheck", "pending"))))

    def mark_loss_checker_alive(self, ttl_s: float) -> None:
        """The checker's heartbeat for this job (expires ``ttl_s`` after its last beat)."""
        self.call(lambda: self.r.set(self.k("losscheck", "alive"), time.time(), px=int(ttl_s * 1000)))

    def loss_checker_alive(self) -> bool:
        return bool(self.call(lambda: self.r.exists(self.k("losscheck", "alive"))))

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
        """All metric stream entries (optionally of one kind), oldest first. A merge's
        entry names its unit; its record is the unit's in ``assimilated`` (entries of
        earlier releases carry it themselves)."""
        last = "-"
        while True:
            rows = self.call(lambda last=last: self.r.xrange(self.k("metrics"), min=last, count=1000))
            if last != "-":
                rows = rows[1:]
            if not rows:
                return
            wanted = [(rid, f) for rid, f in rows if kind is None or f[b"kind"].decode() == kind]
            refs = sorted({f[b"unit"] for _rid, f in wanted
                           if f[b"kind"] == b"merge" and b"data" not in f and b"unit" in f})
            records = dict(zip(refs, self.call(lambda refs=refs: self.r.hmget(self.k("assimilated"), refs)),
                               strict=True)) if refs else {}
            for _rid, f in wanted:
                raw = f.get(b"data") or records.get(f.get(b"unit", b"")) or b"{}"
                d = json.loads(raw)
                d.setdefault("unit", f.get(b"unit", b"").decode())
                yield {"kind": f[b"kind"].decode(), **d}
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
