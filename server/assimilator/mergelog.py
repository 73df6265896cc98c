"""Durable merges: the parameter server logs what it did, not the bytes it wrote.

A strict merge whose rule is replayable (:mod:`boinc_dl.server.assimilator.rules`)
and whose input file is given (``JobStore.merge(..., source=path)``), in a job with a
durable dir (``<job_dir>/durable``), is made durable by a small log instead of by its
20 MB of shard bytes in Redis's append-only file:

1. **retain** the result's weights file in the job's retained area (a hard link:
   :mod:`boinc_dl.server.assimilator.retained`), hashed and synced in the background;
2. **intent** (before any shard changes): ``bdl:J:mlog:M`` hash, unit -> compact JSON
   {rule, its parameters, the retained file (``inputs/M/<unit>.<f>.h5``: ``f``) and its
   size}; logged. The first intent of a unit wins: a second result of the same unit
   finishes the first one's merge;
3. **shards** (strict: each shard's commit checks the tag the merge read). On one Redis
   ``COMMIT_MANY`` commits any number of shards in one script: their bytes, tags,
   versions and the unit's marks are written with replication off, and the AOF gets one
   *commit record* for the call, ``bdl:J:mrec:M`` ``<first shard>:<unit>`` ->
   ``"i:v,i:v,..."``: the version the merge produced in each shard it committed. A lone
   assimilator commits its shards in two pipelined calls of half each (two records per
   merge: Redis's Lua copies of the first half overlap the merge of the second);
   concurrent merges commit shard by shard (one record per shard). In a Redis Cluster, where a
   script reaches one slot, ``COMMIT_LOGGED`` commits one shard and logs its version and
   the unit's mark ``u:<unit> -> version`` in the shard's own hash, on its own master.
   Either way a shard's log entry and its commit are one atomic script, and the order of
   the merges into a shard is the order of the versions its entries name;
4. **finalize**: once the input is on disk, ``FINALIZE`` sets the unit's global mark
   (as for every merge). The input's SHA-256, computed off the critical path, is recorded
   beside the intent when ready (``RECORD_SHA``: ``bdl:J:mrec:M`` ``s:<unit>``).

The bytes are rebuilt after a restart of Redis by
:mod:`boinc_dl.server.assimilator.recovery`; snapshots bound the replay and let the
log be truncated (:mod:`boinc_dl.server.assimilator.snapshot`). Why this shape, what it
costs and what it guarantees: ``docs/parameter-server.md``, "Durability".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from boinc_dl.server.assimilator import rules
from boinc_dl.server.assimilator import shards as sh
from boinc_dl.server.assimilator.retained import RetainedInput, retain, sha256_of
from boinc_dl.server.assimilator.retry import Backoff, is_redirect, is_transient
from boinc_dl.server.common.errors import StoreUnavailable, UnknownJob

#: The subdirectory of a job's directory that holds its retained inputs and snapshots.
DURABLE_SUBDIR = "durable"

#: How many commits (each logging one record) a merge among concurrent ones makes at
#: most on one Redis: its shards are read, merged and committed in that many groups
#: (16 shards: one by one). Fewer groups log fewer bytes (4 groups: about 1.1 KB per
#: merge instead of 2.3), but a group's first shard waits longer between its read and
#: its commit, where a concurrent merge makes it conflict: measured with 4 groups,
#: 10-35% fewer merges/s and 15-20% more CPU per merge (bench/README.md, "The merge
#: log"). Throughput is what concurrent merges need; a lone assimilator commits its shards
#: in two pipelined calls anyway (:func:`pipelined_commits`).
COMMITS_PER_MERGE = 16


def pipelined_commits() -> bool:
    """Whether a lone assimilator commits its shards in two pipelined calls (default)
    rather than one (``BDL_PIPELINED_COMMITS=0``: benches compare the two)."""
    return os.environ.get("BDL_PIPELINED_COMMITS", "1") != "0"


def commits_per_merge() -> int:
    """:data:`COMMITS_PER_MERGE`, or ``BDL_COMMITS_PER_MERGE`` (benches compare settings)."""
    try:
        return max(1, int(os.environ.get("BDL_COMMITS_PER_MERGE", COMMITS_PER_MERGE)))
    except ValueError:
        return COMMITS_PER_MERGE

# Record the intent of a merge unless the unit has one: nil when recorded, else the
# existing intent (the first result of a unit to reach the log is the unit's input).
BEGIN = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return false end
return redis.call('HGET', KEYS[1], ARGV[1])
"""

# Replace an intent whose input never reached the disk (its merge committed nothing:
# commits wait for the input's sync), if it is still the one read. ARGV: unit, the
# intent read, the new one.
TAKE_OVER = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# Record the input's SHA-256 beside its intent (the record hash's ``s:<unit>``), if the
# intent is still the one the merge read (not truncated, not dropped). A field of its
# own, not the intent rewritten with it: the AOF gets the 64 digits, not the intent a
# second time. KEYS: intents, records. ARGV: unit, intent as stored, SHA-256.
RECORD_SHA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[2], 's:' .. ARGV[1], ARGV[3])
return 1
"""


def parse_records(raw: dict[bytes, bytes]) -> tuple[dict[int, dict[int, str]], dict[str, str]]:
    """A model's record hash: (shard -> {version -> unit}) from its commit records
    (``<first shard>:<unit>`` -> ``"i:v,i:v,..."``), and unit -> its input's SHA-256
    (``s:<unit>``)."""
    versions: dict[int, dict[int, str]] = {}
    shas: dict[str, str] = {}
    for k, v in raw.items():
        head, _, unit = k.decode().partition(":")
        if head == "s":
            shas[unit] = v.decode()
            continue
        for pair in v.decode().split(","):
            i, _, ver = pair.partition(":")
            versions.setdefault(int(i), {})[int(ver)] = unit
    return versions, shas


def input_rel(model: str, unit: str, entry: dict[str, Any]) -> str:
    """The retained file of a log entry, relative to the durable dir."""
    return f"inputs/{model}/{unit}.{entry['f']}.h5"


@dataclass
class LoggedInput:
    """The input a logged merge names: its path under the durable dir, size, SHA-256."""

    rel: str
    path: Path
    size: int
    retained: RetainedInput | None = None  # hashing/syncing in the background, if ours
    sha: str | None = None
    synced: bool = False

    def sha256(self) -> str:
        """The SHA-256, once the file is hashed (waits for that)."""
        if self.sha is None:
            self.sha = self.retained.sha256() if self.retained is not None else sha256_of(self.path)
        return self.sha

    def wait_synced(self) -> None:
        """Block until the file is on disk: our own retained file's background sync, or,
        for another result's file (whose merge may have died before its sync), a sync now."""
        if self.retained is not None:
            self.retained.wait_synced()
        elif not self.synced:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self.synced = True

    def sha_if_ready(self) -> str | None:
        if self.sha is None and self.retained is not None:
            self.sha = self.retained.sha_if_ready()
        return self.sha

    def discard(self) -> None:
        if self.retained is not None:
            self.retained.discard()


class LoggedMerging:
    """The durable merge path, mixed into :class:`~boinc_dl.server.assimilator.store.JobStore`
    (which provides the connection, keys, ``layout``, ``call``, ``recover`` and the
    caches of :class:`~boinc_dl.server.assimilator.merging.ShardMerging`)."""

    r: Any
    job: str
    cluster: bool
    retry_s: float
    _cache: dict[tuple[str, int], tuple[bytes, np.ndarray]]
    _alone: dict[str, bool]
    _from_snapshot: set[tuple[str, int]]
    _foreign: bool
    _prefetched: dict[tuple[str, str], RetainedInput]
    _durable_dir: Path | None | bool
    #: Called before each commit of a logged merge (waits for its input's sync).
    _before_commit: Callable[[], None] | None = None
    on_merge_step: Callable[[str], None] | None

    def _step(self, name: str) -> None:
        if self.on_merge_step is not None:
            self.on_merge_step(name)

    # ---- where the log's files live -------------------------------------------------
    def durable_dir(self) -> Path | None:
        """The job's durable dir (``meta.durable_dir``, else ``<meta.job_dir>/durable``);
        None for a job without a directory: its merges log their bytes, as before."""
        if self._durable_dir is False:
            meta = self.meta()  # type: ignore[attr-defined]
            d = meta.get("durable_dir") or (str(Path(meta["job_dir"]) / DURABLE_SUBDIR) if meta.get("job_dir") else "")
            self._durable_dir = Path(d) if d else None
        return self._durable_dir  # type: ignore[return-value]

    def mlog_key(self, model: str) -> str:
        """The model's intents: unit -> JSON {rule, params, f, bytes}."""
        return self.k("mlog", model)  # type: ignore[attr-defined]

    def mrec_key(self, model: str) -> str:
        """The model's commit records (one Redis: ``<first shard>:<unit>`` -> the versions
        a commit produced) and its inputs' SHA-256 (``s:<unit>``)."""
        return self.k("mrec", model)  # type: ignore[attr-defined]

    def committed_shards(self, model: str, unit: str) -> list[int]:
        """The shards the log says carry ``unit`` (its commit records on one Redis, its
        marks in the shards' hashes on a cluster)."""
        if not self.cluster:
            raw = self.call(lambda: self.r.hgetall(self.mrec_key(model)))  # type: ignore[attr-defined]
            records, _ = parse_records({k: v for k, v in raw.items() if k.decode().partition(":")[2] == unit})
            return sorted(records)
        lay = self.layout(model)  # type: ignore[attr-defined]
        marks = [self.call(lambda i=i: self.r.hget(self._shard_keys(model, i)[1], f"u:{unit}"))  # type: ignore[attr-defined]
                 for i in range(lay.shards)]
        return [i for i, m in enumerate(marks) if m is not None]

    @staticmethod
    def _live(tag: Any, v: Any, bv: Any, run_id: Any) -> bool:
        """Whether a shard (HMGET's tag, v, bv) holds current bytes; ``run_id``: the
        server's, read in the same round trip (``("EVAL", sh.RUN_ID_SCRIPT, 0)``), never a
        cached one: a restarted server has a new one, and a stale one would take the
        shards it lost for live."""
        return sh.is_live(tag, v, bv, run_id)

    def can_log(self, record: dict[str, Any], source: Path | None, strict: bool) -> bool:
        """Whether a merge with this record and input can be a logged (durable) one."""
        rule = record.get("rule")
        return bool(strict and source is not None and isinstance(rule, str) and rules.get(rule) is not None
                    and self.durable_dir() is not None)

    def prefetch_input(self, unit: str, model: str, source: Path, max_bytes: int | None = None) -> None:
        """Retain ``source`` now (hashing and syncing it while the caller validates it);
        the merge of ``unit`` with ``source=`` that path picks it up. A no-op for a job
        without a durable dir; a file that cannot be retained is left to the merge."""
        d = self.durable_dir()
        key = (unit, str(Path(source).resolve()))
        if d is None or key in self._prefetched:
            return
        try:
            self._prefetched[key] = retain(Path(source), d, model, unit, max_bytes)
        except (OSError, ValueError):
            return

    def release_inputs(self) -> None:
        """Drop the retained copies of prefetched inputs no merge used (a rejected result)."""
        while self._prefetched:
            _key, inp = self._prefetched.popitem()
            inp.discard()

    def _input_for(self, unit: str, model: str, source: Path) -> LoggedInput:
        d = self.durable_dir()
        assert d is not None
        ret = self._prefetched.pop((unit, str(Path(source).resolve())), None) or retain(Path(source), d, model, unit)
        return LoggedInput(ret.rel, ret.path, ret.size, ret)

    # ---- the merge --------------------------------------------------------------------
    def _merge_logged(self, model: str, unit: str, combine_for: Callable[[int], Callable[[np.ndarray], Any]],
                      order: list[int], record: dict[str, Any], epoch: int | None, source: Path,
                      max_retries: int) -> Any:
        """Steps 1-4 of the module doc; returns a MergeOutcome."""
        token = os.urandom(8).hex()
        d = self.durable_dir()
        assert d is not None
        try:
            inp = self._input_for(unit, model, source)
        except OSError as e:
            # A full or failing disk: not the result's fault. Transient for the job
            # system (it keeps the result and tries again), as an unreachable Redis is.
            raise StoreUnavailable(f"merge of {unit}: cannot retain its input in {d}: {e}") from None
        try:
            return self._merge_retained(model, unit, combine_for, order, record, epoch, max_retries, token, d, inp)
        finally:
            if inp.retained is not None:
                # Whatever happened (a failure before the merge got to hashing its input
                # too): the hashing thread does not wait for this merge any longer.
                inp.retained.release()

    def _merge_retained(self, model: str, unit: str, combine_for: Callable[[int], Callable[[np.ndarray], Any]],
                        order: list[int], record: dict[str, Any], epoch: int | None, max_retries: int,
                        token: str, d: Path, inp: LoggedInput) -> Any:
        """Steps 2-4 of the module doc, once the input is retained; returns a MergeOutcome."""
        from boinc_dl.server.assimilator.merging import MergeOutcome

        self._step("retained")
        intent = {"rule": record["rule"], "params": record.get("rule_params") or {},
                  "f": inp.path.name[len(unit) + 1:-len(".h5")], "bytes": inp.size}
        begin = self._script("mlog_begin", BEGIN)  # type: ignore[attr-defined]
        # Compact JSON: the intent is the largest entry of the log (floats keep their
        # repr, so the replay gets the very parameters).
        text = json.dumps(intent, separators=(",", ":"))
        prev = self.call(lambda: begin(keys=[self.mlog_key(model)], args=[unit, text]))  # type: ignore[attr-defined]
        # Ours also when a retried BEGIN finds what its first try wrote (a lost reply).
        ours = prev is None or json.loads(prev).get("f") == intent["f"]
        self._step("intent")
        if not ours and not (d / input_rel(model, unit, json.loads(prev))).is_file() and \
                not self.committed_shards(model, unit):
            # The first result's intent names an input that is not there, and no shard
            # carries the unit: its merge died before its input reached the disk (a crash
            # of the machine; commits wait for the sync), so it committed nothing. This
            # result's merge takes the unit over. (With shards committed, the merge waits
            # for the file instead: it is the only way to their bytes.)
            take = self._script("mlog_take_over", TAKE_OVER)  # type: ignore[attr-defined]
            ours = bool(int(self.call(lambda: take(keys=[self.mlog_key(model)],  # type: ignore[attr-defined]
                                                   args=[unit, prev, text]))))
        if not ours:
            text = prev.decode()
            first = json.loads(prev)
            if first.get("f") != intent["f"]:
                # Another result of this unit reached the log first (a crash part-way, or
                # a late original and its re-issue at once): its input is the unit's.
                rel = input_rel(model, unit, first)
                other = LoggedInput(rel, d / rel, int(first.get("bytes", 0)))
                if not other.path.is_file():
                    inp.discard()
                    raise StoreUnavailable(f"merge of {unit}: shard(s) {self.committed_shards(model, unit)} carry "
                                           f"the unit, merged from {rel} in the durable dir, which is missing: "
                                           "the merge waits until the file is back")
                if other.sha256() != inp.sha256():
                    from boinc_dl.server.assimilator.recovery import rule_combine

                    combine_for = rule_combine(self, model, unit, first, other.path)  # type: ignore[arg-type]
                    record = {**record, "rule": first["rule"], "rule_params": first.get("params") or {},
                              "helped": True}
                inp.discard()
                inp = other
        record_sha = self._script("mlog_sha", RECORD_SHA)  # type: ignore[attr-defined]
        sha_keys = [self.mlog_key(model), self.mrec_key(model)]

        def add_sha(h: str) -> None:
            self.call(lambda: record_sha(keys=sha_keys, args=[unit, text, h]))  # type: ignore[attr-defined]
        if inp.retained is None:
            add_sha(inp.sha256())  # another result's input, hashed above

        def synced() -> None:
            # A commit logs a record that names the input: the input must be on disk first,
            # or a crash of the machine could leave a log entry whose input is gone (with
            # appendfsync always the record is on disk when the commit returns). The sync
            # started before the validation; this waits for what is left of it.
            try:
                inp.wait_synced()
            except OSError as e:
                raise StoreUnavailable(f"merge of {unit}: its retained input could not be synced: {e}") from None
        self._before_commit = synced
        hashed = False
        try:
            versions, retries, applied = self._logged_shards(model, order, unit, combine_for, max_retries)
            if versions is None:
                if ours:
                    self.call(lambda: self.r.hdel(self.mlog_key(model), unit))  # type: ignore[attr-defined]
                    inp.discard()
                return MergeOutcome(False, self.version(model), retries)  # type: ignore[attr-defined]
            synced()  # acknowledged only with its input on disk (done already if a shard was committed)
            out = self._finalize(model, unit, token, record, epoch, retries)  # type: ignore[attr-defined]
            self._step("finalized")
            if out.duplicate and ours and not applied:
                # Every shard already carried the unit and its global mark was set: this
                # call changed nothing, and its intent names nothing.
                self.call(lambda: self.r.hdel(self.mlog_key(model), unit))  # type: ignore[attr-defined]
                inp.discard()
            if out.applied:
                from boinc_dl.server.assimilator.snapshot import after_merge

                after_merge(self, model)  # type: ignore[arg-type]
            if inp.retained is not None:
                # The input is hashed once the merge is done (or has failed): its SHA-256
                # (about 10-15 ms of CPU for 20 MB) then no longer competes with the
                # merge for the machine's cores. The sync, which every commit needs,
                # started before the validation; the hash only completes the log entry
                # (a replay checks the size where it is missing).
                inp.retained.then_record(add_sha)  # from the hashing thread, once hashed
            hashed = True
        finally:
            self._before_commit = None
            if inp.retained is not None and not hashed:
                inp.retained.then_record(add_sha)
        return out

    def _logged_shards(self, model: str, order: list[int], unit: str,
                       combine_for: Callable[[int], Callable[[np.ndarray], Any]],
                       max_retries: int) -> tuple[dict[int, int] | None, int, int]:
        """Commit every shard not yet carrying ``unit``: (shard -> version it has the unit
        at, or None when rejected before any shard was written; conflicts retried;
        shards applied by this call)."""
        field = f"u:{unit}"
        versions: dict[int, int] = {}
        retries = applied = 0
        left = list(order)
        self._foreign = False
        backoff = Backoff(self.retry_s)
        while left:
            try:
                if not self.cluster and len(left) > 1 and all((model, i) in self._cache for i in left) and \
                        (self._alone.get(model) or all((model, i) in self._from_snapshot for i in left)):
                    done, dead = self._commit_cached_logged(model, left, field, combine_for)
                    if done is None:
                        return None, retries, applied
                    for i, (status, v) in done.items():
                        versions[i] = v
                        applied += status == "applied"
                    if done:
                        self._shard_applied(applied)  # type: ignore[attr-defined]
                    self._alone[model] = bool(done) and len(done) == len(left)
                    left = [i for i in left if i not in done]
                    if dead:
                        self.recover(model)  # type: ignore[attr-defined]
                    continue
                group = left[:self._group_size(model)]
                got = self._logged_group(model, group, field, combine_for)
                if got is None:
                    if versions:
                        raise ValueError(f"merge of {unit}: combine rejected a shard after others were applied")
                    return None, retries, applied
                dead = False
                for i, status, v in got:
                    if status == "dead":
                        dead = True
                    elif status == "conflict":
                        retries += 1
                        self._alone[model] = False
                        if retries > max_retries:
                            raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts on shard {i}")
                    else:
                        versions[i] = v
                        left.remove(i)
                        if status == "applied":
                            applied += 1
                            self._shard_applied(applied)  # type: ignore[attr-defined]
                if dead:
                    self.recover(model)  # type: ignore[attr-defined]
                    continue
                if not left:
                    # Nobody else wrote these shards meanwhile: the next merge can commit
                    # all of them from the cache in one round trip.
                    self._alone[model] = retries == 0 and not self._foreign
            except (redis.RedisError, redis.RedisClusterException, OSError) as e:
                if not (isinstance(e, OSError) or is_transient(e) or is_redirect(e)):
                    raise
                if self.cluster and is_redirect(e):
                    self.r.nodes_manager.initialize()
                backoff.wait(f"merge of {unit}", e)
        return versions, retries, applied

    def _commit_logged(self, held: Any, model: str, unit: str, field: str,
                       items: list[tuple[int, bytes, bytes, memoryview]]) -> list[tuple[int, int, bytes | None]]:
        """Commit shards (index, expected tag, new tag, bytes) of ``unit``'s merge on
        ``held``'s connection, in one round trip: (code, version, the tag written) per
        shard; code 1 applied, 0 already carried the unit, -1 conflict, -2 not live.

        One Redis: one ``COMMIT_MANY`` for all of them, whose one logged record lists
        the versions produced. A cluster: one ``COMMIT_LOGGED`` per shard (each in its
        own slot), the shard's mark its log entry on its own master."""
        cmds = self._commit_cmds(model, unit, field, items)
        try:
            replies = held.run(cmds)
        except redis.exceptions.NoScriptError:
            held.run([("SCRIPT", "LOAD", self._commit_src())])
            replies = held.run(cmds)
        return self._commit_replies(replies, items)

    def _commit_src(self) -> str:
        """The commit script of this store: one shard per call in a cluster, many on one Redis."""
        return sh.COMMIT_LOGGED if self.cluster else sh.COMMIT_MANY

    def _commit_cmds(self, model: str, unit: str, field: str,
                     items: list[tuple[int, bytes, bytes, memoryview]]) -> list[tuple[Any, ...]]:
        """The commands of :meth:`_commit_logged` (after waiting for the input's sync)."""
        if self._before_commit is not None:
            self._before_commit()
        if self.cluster:
            return [("EVALSHA", self._script("commit_logged", sh.COMMIT_LOGGED).sha, 2,  # type: ignore[attr-defined]
                     *self._shard_keys(model, i), tag, new_tag, field, data)  # type: ignore[attr-defined]
                    for i, tag, new_tag, data in items]
        keys = [k for i, *_ in items for k in self._shard_keys(model, i)]  # type: ignore[attr-defined]
        args = [a for i, tag, new_tag, data in items for a in (i, tag, new_tag, data)]
        return [("EVALSHA", self._script("commit_many", sh.COMMIT_MANY).sha,  # type: ignore[attr-defined]
                 2 + len(keys), self.k("assimilated"), self.mrec_key(model), *keys,  # type: ignore[attr-defined]
                 unit, field, *args)]

    def _commit_replies(self, replies: list[Any],
                        items: list[tuple[int, bytes, bytes, memoryview]]) -> list[tuple[int, int, bytes | None]]:
        if self.cluster:
            return [(int(r[0]), int(r[1]) if len(r) > 1 else 0, new_tag)
                    for r, (_i, _t, new_tag, _d) in zip(replies, items, strict=True)]
        rep = replies[0]
        if rep and not isinstance(rep[0], list) and int(rep[0]) == -3:
            # Finalized: every shard carries the unit (its marks may predate a restart).
            return [(0, 0, None) for _ in items]
        return [(int(r[0]), int(r[1]) if len(r) > 1 else 0, r[2] if len(r) > 2 else None) for r in rep]

    def _group_size(self, model: str) -> int:
        """How many shards a merge among others commits per script call: one on a
        cluster (a script reaches one slot); on one Redis, enough for at most
        :func:`commits_per_merge` calls per merge (each call logs one record)."""
        if self.cluster:
            return 1
        return max(1, -(-self.layout(model).shards // commits_per_merge()))  # type: ignore[attr-defined]

    def _logged_group(self, model: str, group: list[int], field: str,
                      combine_for: Callable[[int], Callable[[np.ndarray], Any]]) -> list[tuple[int, str, int]] | None:
        """One attempt at the shards ``group``: read them (one round trip, atomic), merge
        each, commit them in one script. Per shard (index, ``applied`` | ``skipped`` |
        ``conflict`` | ``dead`` (not live: rebuild it), the version it carries the unit
        at); None when ``combine`` rejected one (nothing of the group is written then)."""
        from boinc_dl.server.assimilator.merging import _Held, _writable

        keys = {i: self._shard_keys(model, i) for i in group}  # type: ignore[attr-defined]
        held = _Held(self._client_for(keys[group[0]][0]))  # type: ignore[attr-defined]
        ok = False
        out: list[tuple[int, str, int]] = []
        todo: list[tuple[int, bytes, np.ndarray]] = []
        replies: list[tuple[int, int, bytes | None]] = []
        try:
            cached = {i: self._take_cached(model, i)[0] for i in group}  # type: ignore[attr-defined]
            cmds: list[tuple[Any, ...]] = [("EVAL", sh.RUN_ID_SCRIPT, 0), ("MULTI",)]
            for i in group:
                cmds.append(("HMGET", keys[i][1], "tag", "v", "bv", field))
                if cached[i] is None:
                    cmds.append(("GET", keys[i][0]))
            res = held.run([*cmds, ("EXEC",)])
            rid, reads = res[0], iter(res[-1])
            for i in group:
                tag, v, bv, mark = next(reads)
                w = next(reads) if cached[i] is None else None
                c = cached[i]
                if mark is not None:
                    if c is not None:
                        self._cache[(model, i)] = c
                    out.append((i, "skipped", int(mark)))
                    continue
                if not self._live(tag, v, bv, rid):
                    out.append((i, "dead", 0))
                    continue
                if c is not None and c[0] != tag:
                    # Written by another process since this one cached it: read the bytes
                    # (the commit's tag check catches a write in between).
                    w, c = held.run([("GET", keys[i][0])])[0], None
                    self._foreign = True
                if w is None and c is None:
                    raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
                ws = _writable(c[1]) if c is not None else np.frombuffer(w, dtype=np.float32).copy()
                new = combine_for(i)(ws)
                if new is None:
                    ok = True
                    return None
                todo.append((i, tag, new))
            if todo:
                replies = self._commit_logged(held, model, field[2:], field,
                                              [(i, tag, sh.new_tag(), sh.as_bytes(new)) for i, tag, new in todo])
            ok = True
        finally:
            held.release() if ok else held.discard()
        for (i, _tag, new), (code, v_new, written) in zip(todo, replies, strict=True):
            if code == 1:
                self._cache[(model, i)] = (written, new)  # type: ignore[assignment]
                out.append((i, "applied", v_new))
            elif code == 0:
                out.append((i, "skipped", v_new))
            else:
                out.append((i, "dead" if code == -2 else "conflict", 0))
        return out

    def _commit_cached_logged(self, model: str, shards: list[int], field: str,
                              combine_for: Callable[[int], Callable[[np.ndarray], Any]]
                              ) -> tuple[dict[int, tuple[str, int]] | None, bool]:
        """Lone-assimilator fast path (one Redis): every shard merged from its cached
        copy and committed in two pipelined calls (one with ``BDL_PIPELINED_COMMITS=0``),
        each commit checking its own tag.
        Returns (shard -> (applied | skipped, version) for the shards done, or None when
        rejected; whether a shard was found not live)."""
        from boinc_dl.server.assimilator.merging import _Held, _writable

        # The tags first (a few bytes per shard): with another writer about, computing
        # and sending 20 MB only to have every commit refused would cost more than this.
        held = _Held(self.r)
        ok = False
        try:
            rid, *heads = held.run([("EVAL", sh.RUN_ID_SCRIPT, 0),
                                    *[("HMGET", self._shard_keys(model, i)[1], "tag", "v", "bv", field)  # type: ignore[attr-defined]
                                      for i in shards]])
            ok = True
        finally:
            held.release() if ok else held.discard()
        if any(mark is not None or tag != self._cache[(model, i)][0] or not self._live(tag, v, bv, rid)
               for i, (tag, v, bv, mark) in zip(shards, heads, strict=True)):
            # Not alone after all: the per-shard path takes over (it reads what changed).
            self._alone[model] = False
            self._from_snapshot.difference_update((model, i) for i in shards)
            return {}, False
        news: list[tuple[int, np.ndarray, bytes, bytes]] = []
        # Two commits, pipelined: the first half's script runs in Redis (its Lua copies
        # of the bytes) while this process merges the second half (bench/README.md, "The
        # merge log"). Each logs its own record; a crash between them leaves the first
        # half committed, as between any two commits of a merge.
        cut = (len(shards) + 1) // 2 if pipelined_commits() and len(shards) >= 4 else len(shards)
        held = _Held(self.r)
        ok = False
        sent: list[tuple[list[tuple[Any, ...]], list[tuple[int, bytes, bytes, memoryview]]]] = []
        n_sent = 0  # shards of news already sent
        replies: list[tuple[int, int, bytes | None]] = []
        try:
            for j, i in enumerate(shards):
                (tag, buf), _ = self._take_cached(model, i)  # type: ignore[attr-defined]
                new = combine_for(i)(_writable(buf))
                if new is None:
                    if news:
                        raise ValueError(f"combine rejected shard {i} after others were computed")
                    ok = True
                    return None, False
                news.append((i, new, tag, sh.new_tag()))
                if j + 1 == cut or j + 1 == len(shards):
                    part = [(i, tag, new_tag, sh.as_bytes(new)) for i, new, tag, new_tag in news[n_sent:]]
                    n_sent = len(news)
                    cmds = self._commit_cmds(model, field[2:], field, part)
                    held.send(cmds)
                    sent.append((cmds, part))
            for k, (cmds, part) in enumerate(sent):
                try:
                    got = held.read(len(cmds))
                except redis.exceptions.NoScriptError:
                    # Redis lost its scripts (a restart, SCRIPT FLUSH): the parts sent after
                    # this one failed the same way (nothing loads the script in between).
                    # Their replies are read first, or the next command would read them.
                    for later, _ in sent[k + 1:]:
                        try:
                            held.read(len(later))
                        except redis.exceptions.NoScriptError:
                            pass
                    held.run([("SCRIPT", "LOAD", self._commit_src())])
                    for again, p in sent[k:]:
                        replies += self._commit_replies(held.run(again), p)
                    break
                replies += self._commit_replies(got, part)
            ok = True
        finally:
            held.release() if ok else held.discard()
        done: dict[int, tuple[str, int]] = {}
        dead = False
        for (i, new, _tag, _new_tag), (code, v_new, written) in zip(news, replies, strict=True):
            if code == 1:
                self._cache[(model, i)] = (written, new)
                done[i] = ("applied", v_new)
            elif code == 0:
                done[i] = ("skipped", v_new)
            dead = dead or code == -2
        return done, dead
