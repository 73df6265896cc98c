"""Durable merges: the parameter server logs what it did, not the bytes it wrote.

A strict merge whose rule is replayable (:mod:`boinc_dl.server.assimilator.rules`)
and whose input file is given (``JobStore.merge(..., source=path)``), in a job with a
durable dir (``<job_dir>/durable``), is made durable by a small log instead of by its
20 MB of shard bytes in Redis's append-only file:

1. **retain** the result's weights file in the job's retained area (a hard link:
   :mod:`boinc_dl.server.assimilator.retained`), hashed and synced in the background;
2. **intent** (before any shard changes): ``bdl:J:mlog:M`` hash, unit -> JSON {rule,
   its parameters, the retained file (``inputs/M/<unit>.<f>.h5``: ``f``) and its size};
   logged. The first intent of a unit wins: a second result of the same unit finishes
   the first one's merge;
3. **shards**: each shard is committed by ``COMMIT_LOGGED`` (a Lua script, strict:
   the tag it read must still be there): the new bytes, tag and ``bv`` are written
   with replication off, so they stay out of the AOF; the shard's version and the
   unit's mark ``u:<unit> -> version`` are logged in the same atomic script. That mark
   is the shard's log entry, and the version the merge produced in that shard: the
   order of the merges into a shard is the order of its versions, what a replay needs;
4. **finalize**: once the input is on disk, ``FINALIZE`` sets the unit's global mark
   (as for every merge). The input's SHA-256, computed off the critical path, is added
   to the intent when ready (``RECORD_SHA``).

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

# Record the intent of a merge unless the unit has one: nil when recorded, else the
# existing intent (the first result of a unit to reach the log is the unit's input).
BEGIN = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return false end
return redis.call('HGET', KEYS[1], ARGV[1])
"""

# Add the input's SHA-256 to an intent, if the intent is still the one the merge read
# (not truncated, not completed already). A string edit, not a JSON re-encoding: the
# rule's parameters keep their exact digits. ARGV: unit, intent as stored, SHA-256.
RECORD_SHA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], string.sub(ARGV[2], 1, -2) .. ', "sha256": "' .. ARGV[3] .. '"}')
return 1
"""


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

    def sha256(self) -> str:
        """The SHA-256, once the file is hashed (waits for that)."""
        if self.sha is None:
            self.sha = self.retained.sha256() if self.retained is not None else sha256_of(self.path)
        return self.sha

    def wait_synced(self) -> None:
        if self.retained is not None:
            self.retained.wait_synced()

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
        return self.k("mlog", model)  # type: ignore[attr-defined]

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
        from boinc_dl.server.assimilator.merging import MergeOutcome

        token = os.urandom(8).hex()
        d = self.durable_dir()
        assert d is not None
        try:
            inp = self._input_for(unit, model, source)
        except OSError as e:
            # A full or failing disk: not the result's fault. Transient for the job
            # system (it keeps the result and tries again), as an unreachable Redis is.
            raise StoreUnavailable(f"merge of {unit}: cannot retain its input in {d}: {e}") from None
        self._step("retained")
        intent = {"rule": record["rule"], "params": record.get("rule_params") or {},
                  "f": inp.path.name[len(unit) + 1:-len(".h5")], "bytes": inp.size}
        begin = self._script("mlog_begin", BEGIN)  # type: ignore[attr-defined]
        text = json.dumps(intent)
        prev = self.call(lambda: begin(keys=[self.mlog_key(model)], args=[unit, text]))  # type: ignore[attr-defined]
        # Ours also when a retried BEGIN finds what its first try wrote (a lost reply).
        ours = prev is None or json.loads(prev).get("f") == intent["f"]
        self._step("intent")
        if not ours:
            text = prev.decode()
            first = json.loads(prev)
            if first.get("f") != intent["f"]:
                # Another result of this unit reached the log first (a crash part-way, or
                # a late original and its re-issue at once): its input is the unit's.
                rel = input_rel(model, unit, first)
                other = LoggedInput(rel, d / rel, int(first.get("bytes", 0)))
                if other.sha256() != inp.sha256():
                    from boinc_dl.server.assimilator.recovery import rule_combine

                    combine_for = rule_combine(self, model, unit, first, other.path)  # type: ignore[arg-type]
                    record = {**record, "rule": first["rule"], "rule_params": first.get("params") or {},
                              "helped": True}
                inp.discard()
                inp = other
        if '"sha256"' not in text:
            record_sha = self._script("mlog_sha", RECORD_SHA)  # type: ignore[attr-defined]
            key = self.mlog_key(model)

            def add_sha(h: str) -> None:
                self.call(lambda: record_sha(keys=[key], args=[unit, text, h]))  # type: ignore[attr-defined]
            if inp.retained is not None:
                inp.retained.then_record(add_sha)  # from the hashing thread, once hashed
            else:
                add_sha(inp.sha256())  # another result's input, hashed above
        versions, retries, applied = self._logged_shards(model, order, unit, combine_for, max_retries)
        if versions is None:
            if ours:
                self.call(lambda: self.r.hdel(self.mlog_key(model), unit))  # type: ignore[attr-defined]
                inp.discard()
            return MergeOutcome(False, self.version(model), retries)  # type: ignore[attr-defined]
        try:
            inp.wait_synced()  # acknowledged only with its input on disk
        except OSError as e:
            raise StoreUnavailable(f"merge of {unit}: its retained input could not be synced: {e}") from None
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
                i = left[0]
                status, v = self._logged_shard(model, i, field, combine_for(i))
                if status == "rejected":
                    if versions:
                        raise ValueError(f"merge of {unit}: combine rejected shard {i} after others were applied")
                    return None, retries, applied
                if status == "dead":
                    self.recover(model)  # type: ignore[attr-defined]
                    continue
                if status == "conflict":
                    retries += 1
                    self._alone[model] = False
                    if retries > max_retries:
                        raise StoreUnavailable(f"merge of {unit}: gave up after {retries} conflicts on shard {i}")
                    continue
                versions[i] = v
                left.pop(0)
                if status == "applied":
                    applied += 1
                    self._shard_applied(applied)  # type: ignore[attr-defined]
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

    def _commit_script(self, held: Any, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run ``COMMIT_LOGGED`` for each (keys, args) on ``held``'s connection, in one
        round trip (loading the script first where Redis lost it in a restart)."""
        sha = self._script("commit_logged", sh.COMMIT_LOGGED).sha  # type: ignore[attr-defined]
        cmds = [("EVALSHA", sha, len(k), *k, *a) for k, a in calls]
        try:
            return held.run(cmds)
        except redis.exceptions.NoScriptError:
            held.run([("SCRIPT", "LOAD", sh.COMMIT_LOGGED)])
            return held.run(cmds)

    def _logged_shard(self, model: str, i: int, field: str,
                      combine: Callable[[np.ndarray], np.ndarray | None]) -> tuple[str, int]:
        """One attempt at shard ``i``: (``applied`` | ``skipped`` | ``conflict`` |
        ``dead`` (not live: rebuild it) | ``rejected``, the version it carries the unit at)."""
        from boinc_dl.server.assimilator.merging import _Held, _writable

        wkey, mkey = self._shard_keys(model, i)  # type: ignore[attr-defined]
        held = _Held(self._client_for(wkey))  # type: ignore[attr-defined]
        ok = False
        try:
            cached, _ = self._take_cached(model, i)  # type: ignore[attr-defined]
            if cached is None:
                rep = held.run([("MULTI",), ("HMGET", mkey, "tag", "v", "bv", field), ("GET", wkey), ("EXEC",)])[3]
                (tag, v, bv, mark), w = rep
            else:
                tag, v, bv, mark = held.run([("HMGET", mkey, "tag", "v", "bv", field)])[0]
                w = None
            if mark is not None:
                if cached is not None:
                    self._cache[(model, i)] = cached
                ok = True
                return "skipped", int(mark)
            if not sh.is_live(tag, v, bv):
                ok = True
                return "dead", 0
            if cached is not None and cached[0] != tag:
                # Written by another process since this one cached it: read the bytes (the
                # commit's tag check catches a write in between).
                w = held.run([("GET", wkey)])[0]
                cached = None
                self._foreign = True
            if w is None and cached is None:
                raise UnknownJob(f"job {self.job!r}: shard {i} of model {model!r} is missing")
            ws = _writable(cached[1]) if cached is not None else np.frombuffer(w, dtype=np.float32).copy()
            new = combine(ws)
            if new is None:
                ok = True
                return "rejected", 0
            new_tag = sh.new_tag()
            res = self._commit_script(held, [([wkey, mkey], [tag, new_tag, field, sh.as_bytes(new)])])[0]
            ok = True
        finally:
            held.release() if ok else held.discard()
        code = int(res[0])
        if code == 1:
            self._cache[(model, i)] = (new_tag, new)
            return "applied", int(res[1])
        if code == 0:
            return "skipped", int(res[1])
        return ("dead", 0) if code == -2 else ("conflict", 0)

    def _commit_cached_logged(self, model: str, shards: list[int], field: str,
                              combine_for: Callable[[int], Callable[[np.ndarray], Any]]
                              ) -> tuple[dict[int, tuple[str, int]] | None, bool]:
        """Lone-assimilator fast path (one Redis): every shard merged from its cached
        copy and all committed in one round trip, each commit checking its own tag.
        Returns (shard -> (applied | skipped, version) for the shards done, or None when
        rejected; whether a shard was found not live)."""
        from boinc_dl.server.assimilator.merging import _Held, _writable

        # The tags first (a few bytes per shard): with another writer about, computing
        # and sending 20 MB only to have every commit refused would cost more than this.
        held = _Held(self.r)
        ok = False
        try:
            heads = held.run([("HMGET", self._shard_keys(model, i)[1], "tag", "v", "bv", field)  # type: ignore[attr-defined]
                              for i in shards])
            ok = True
        finally:
            held.release() if ok else held.discard()
        if any(mark is not None or tag != self._cache[(model, i)][0] or not sh.is_live(tag, v, bv)
               for i, (tag, v, bv, mark) in zip(shards, heads, strict=True)):
            # Not alone after all: the per-shard path takes over (it reads what changed).
            self._alone[model] = False
            self._from_snapshot.difference_update((model, i) for i in shards)
            return {}, False
        news: list[tuple[int, np.ndarray, bytes, bytes]] = []
        for i in shards:
            (tag, buf), _ = self._take_cached(model, i)  # type: ignore[attr-defined]
            new = combine_for(i)(_writable(buf))
            if new is None:
                if news:
                    raise ValueError(f"combine rejected shard {i} after others were computed")
                return None, False
            news.append((i, new, tag, sh.new_tag()))
        held = _Held(self.r)
        ok = False
        try:
            replies = self._commit_script(held, [(self._shard_keys(model, i), [tag, new_tag, field, sh.as_bytes(new)])  # type: ignore[attr-defined]
                                                 for i, new, tag, new_tag in news])
            ok = True
        finally:
            held.release() if ok else held.discard()
        done: dict[int, tuple[str, int]] = {}
        dead = False
        for (i, new, _tag, new_tag), res in zip(news, replies, strict=True):
            code = int(res[0])
            if code == 1:
                self._cache[(model, i)] = (new_tag, new)
                done[i] = ("applied", int(res[1]))
            elif code == 0:
                done[i] = ("skipped", int(res[1]))
            dead = dead or code == -2
        return done, dead
