"""Snapshots of a model's weights for the merge log: bounded replays, a truncated log.

A durable merge (:mod:`boinc_dl.server.assimilator.mergelog`) keeps its shard bytes
out of Redis's append-only file and its input file in the job's retained area. A
snapshot writes the weights to ``<durable dir>/snapshots/<model>/`` with each shard's
version (each shard read atomically; shards may stem from different moments, which a
per-shard replay does not mind), ``fdatasync``\\ s it, records it in Redis
(``bdl:J:snapshots``: model -> manifest), and then truncates the log behind it: the
intent of every settled merge (merged or given up) whose every shard the snapshot
covers is deleted, with its retained input file. Recovery starts from the newest
snapshot (:mod:`boinc_dl.server.assimilator.recovery`).

When: after a durable merge, :func:`after_merge` starts one in a background thread of
the merging process when the model's log holds :data:`EVERY_MERGES` merges or the last
snapshot is :data:`EVERY_S` seconds old (``BDL_SNAPSHOT_EVERY``,
``BDL_SNAPSHOT_EVERY_S``). One process at a time takes it (a lock in Redis). The thread
is not a daemon: a short-lived assimilator (BOINC's script) finishes it before exiting.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from boinc_dl.server.assimilator.mergelog import input_rel, parse_records
from boinc_dl.server.assimilator.retained import sha256_of, sync_dir
from boinc_dl.server.common.paths import confined

if TYPE_CHECKING:
    from boinc_dl.server.assimilator.store import JobStore

log = logging.getLogger(__name__)

#: A snapshot is due once the model's log holds this many merges...
EVERY_MERGES = 200
#: ...or the last one is this old (and the log is not empty).
EVERY_S = 600.0
#: Retained files no intent names (a merge that died before its intent, a rejected
#: result) are removed by a snapshot once they are this old.
ORPHAN_AGE_S = 3600.0
_LOCK_MS = 120_000


def every_merges() -> int:
    try:
        return max(1, int(os.environ.get("BDL_SNAPSHOT_EVERY", EVERY_MERGES)))
    except ValueError:
        return EVERY_MERGES


def every_s() -> float:
    try:
        return max(0.0, float(os.environ.get("BDL_SNAPSHOT_EVERY_S", EVERY_S)))
    except ValueError:
        return EVERY_S


@dataclass
class Manifest:
    """One snapshot of a model: the file (relative to the durable dir), its layout,
    each shard's version, the file's SHA-256 and when it was taken."""

    file: str
    n: int
    shards: int
    versions: list[int]
    sha256: str
    t: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Manifest:
        d = json.loads(raw)
        return cls(str(d["file"]), int(d["n"]), int(d["shards"]), [int(v) for v in d["versions"]],
                   str(d["sha256"]), float(d["t"]))


def manifest(store: JobStore, model: str) -> Manifest | None:
    """The newest snapshot of ``model`` recorded in Redis (None if none was taken)."""
    raw = store.call(lambda: store.r.hget(store.k("snapshots"), model))
    return Manifest.from_json(raw) if raw else None


def load(store: JobStore, m: Manifest) -> np.ndarray:
    """A snapshot's weights (read-only memory map), checked against its SHA-256."""
    d = store.durable_dir()
    assert d is not None
    path = confined(d, *Path(m.file).parts)
    if path.stat().st_size != 4 * m.n:
        raise OSError(f"snapshot {path} has {path.stat().st_size} bytes, expected {4 * m.n}")
    if sha256_of(path) != m.sha256:
        raise OSError(f"snapshot {path} does not match its SHA-256")
    return np.memmap(path, dtype=np.float32, mode="r", shape=(m.n,))


def take(store: JobStore, model: str) -> Manifest | None:
    """Take a snapshot of ``model`` and truncate the log behind it (None when another
    process holds the snapshot lock or the job has no durable dir)."""
    d = store.durable_dir()
    if d is None:
        return None
    lock, token = store.k("lock", "snapshot", model), os.urandom(8).hex()
    if not store.call(lambda: store.r.set(lock, token, nx=True, px=_LOCK_MS)):
        return None
    try:
        snap = store.snapshot(model)
        lay = store.layout(model)
        area = confined(d, "snapshots", model)
        area.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns()}.f32"
        tmp = confined(area, f"tmp-{name}")
        with open(tmp, "wb") as f:
            f.write(memoryview(np.ascontiguousarray(snap.flat, np.float32)).cast("B"))
            f.flush()
            os.fdatasync(f.fileno())
        digest = sha256_of(tmp)
        os.replace(tmp, confined(area, name))
        sync_dir(area)
        m = Manifest(f"snapshots/{model}/{name}", lay.n, lay.shards, list(snap.shard_versions), digest, time.time())
        store.call(lambda: store.r.hset(store.k("snapshots"), model, m.to_json()))
        for old in area.iterdir():
            if old.name != name and not old.name.startswith("tmp-"):
                old.unlink(missing_ok=True)
        dropped = truncate(store, model, m)
        sweep_orphans(store, model)
        log.info("snapshot of %s/%s at shard versions %s..%s; %d merge(s) dropped from the log",
                 store.job, model, min(m.versions), max(m.versions), dropped)
        return m
    finally:
        store.call(lambda: store.r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            1, lock, token))


def truncate(store: JobStore, model: str, m: Manifest) -> int:
    """Delete from ``model``'s log every settled merge that snapshot ``m`` covers on every
    shard, and its retained input. Returns how many were dropped."""
    key = store.mlog_key(model)
    intents = {k.decode(): json.loads(v) for k, v in store.call(lambda: store.r.hgetall(key)).items()}
    if not intents:
        return 0
    units = sorted(intents)

    def settled() -> list[Any]:
        p = store.r.pipeline(transaction=False)
        p.hmget(store.k("assimilated"), units)
        p.hmget(store.k("failed"), units)
        return p.execute()
    done, failed = store.call(settled)
    candidates = [u for u, a, f in zip(units, done, failed, strict=True) if a is not None or f is not None]
    if not candidates:
        return 0
    covered = set(candidates)
    rec_raw = store.call(lambda: store.r.hgetall(store.mrec_key(model)))
    records, _shas = parse_records(rec_raw)
    for i, by_version in records.items():
        # One Redis: a commit record names each version it produced.
        for v, u in by_version.items():
            if v > m.versions[i]:
                covered.discard(u)
    if store.cluster:
        # A cluster's log entries are the marks in each shard's own hash.
        fields = [f"u:{u}" for u in candidates]
        for i in range(m.shards):
            mkey = store._shard_keys(model, i)[1]
            marks = store.call(lambda mkey=mkey: store.r.hmget(mkey, fields))
            for u, v in zip(candidates, marks, strict=True):
                if v is not None and _int(v) > m.versions[i]:
                    covered.discard(u)
    if not covered:
        return 0
    drop = sorted(covered)
    # Their commit records and input hashes go with their intents (the records first: a
    # record whose intent is gone would stop a replay, an intent without records is only
    # a merge that committed nothing yet).
    rec_fields = [k for k in rec_raw if k.decode().partition(":")[2] in covered]
    if rec_fields:
        store.call(lambda: store.r.hdel(store.mrec_key(model), *rec_fields))
    store.call(lambda: store.r.hdel(key, *drop))
    d = store.durable_dir()
    assert d is not None
    for u in drop:
        try:
            confined(d, *Path(input_rel(model, u, intents[u])).parts).unlink(missing_ok=True)
        except (OSError, ValueError):
            pass
    return len(drop)


def sweep_orphans(store: JobStore, model: str, older_than_s: float = ORPHAN_AGE_S) -> int:
    """Remove retained files of ``model`` that no intent names and that are older than
    ``older_than_s`` (a merge that died before logging its intent, a rejected result)."""
    d = store.durable_dir()
    if d is None:
        return 0
    area = d / "inputs" / model
    if not area.is_dir():
        return 0
    named = {Path(input_rel(model, k.decode(), json.loads(v))).name
             for k, v in store.call(lambda: store.r.hgetall(store.mlog_key(model))).items()}
    now, n = time.time(), 0
    for f in area.iterdir():
        try:
            # ctime, not mtime: a hard link keeps the upload's mtime, but link() sets ctime.
            if f.name not in named and now - f.stat().st_ctime > older_than_s:
                f.unlink()
                n += 1
        except OSError:
            pass
    return n


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


# ---- the background trigger -------------------------------------------------------------
_running: dict[tuple[str, str], threading.Thread] = {}
_merges: dict[tuple[str, str], int] = {}  # logged merges this process made, per (job, model)
_running_lock = threading.Lock()


def due(store: JobStore, model: str) -> bool:
    """Whether ``model``'s log is long or old enough for a snapshot (one round trip)."""
    def read() -> list[Any]:
        p = store.r.pipeline(transaction=False)
        p.hlen(store.mlog_key(model))
        p.hget(store.k("snapshots"), model)
        return p.execute()
    n, raw = store.call(read)
    if not n:
        return False
    if int(n) >= every_merges():
        return True
    # By age only once there is a snapshot to measure it from (the first one comes with
    # the log's length).
    return raw is not None and time.time() - Manifest.from_json(raw).t >= every_s()


def after_merge(store: JobStore, model: str) -> threading.Thread | None:
    """Start a snapshot of ``model`` in the background if one is due and none runs in
    this process. Returns the thread (tests join it).

    Whether one is due is asked of Redis at this process's first merge and then at every
    (threshold / 20)-th: every tenth with the default 200 (a round trip saved on the
    others; the log grows by a twentieth of its bound more at most per process, and the
    age trigger fires a few merges late)."""
    key = (store.job, model)
    with _running_lock:
        t = _running.get(key)
        if t is not None and t.is_alive():
            return None
        _merges[key] = _merges.get(key, 0) + 1
        if _merges[key] % max(1, every_merges() // 20) and _merges[key] > 1:
            return None
        if not due(store, model):
            return None
        from boinc_dl.server.assimilator.store import JobStore

        own = JobStore(store.r, store.job, retry_s=store.retry_s)  # its caches are its own

        def run() -> None:
            try:
                take(own, model)
            except Exception:  # noqa: BLE001 - a snapshot is retried at the next merge
                log.exception("snapshot of %s/%s failed", store.job, model)
        t = threading.Thread(target=run, name=f"bdl-snapshot-{model}", daemon=False)
        _running[key] = t
        t.start()
        return t


@dataclass
class LogStatus:
    """Where one model's merge log stands (``boinc-dl redis check``)."""

    job: str
    model: str
    merges: int              # merges in the log (since the snapshot that truncated it)
    input_bytes: int         # their retained inputs: what a rebuild reads
    snapshot_age_s: float | None
    not_live: int            # shards whose bytes Redis lost (rebuilt at the next read or merge)


def status(store: JobStore) -> list[LogStatus]:
    """The merge log of every model of ``store``'s job (empty for a job without a durable dir)."""
    from boinc_dl.server.assimilator.recovery import dead_shards

    if store.durable_dir() is None:
        return []
    out = []
    for model in store.models():
        entries = [json.loads(v) for v in store.call(lambda m=model: store.r.hvals(store.mlog_key(m)))]
        m = manifest(store, model)
        try:
            dead = len(dead_shards(store, model))
        except Exception:  # noqa: BLE001 - a model without weights yet
            dead = 0
        out.append(LogStatus(store.job, model, len(entries), sum(int(e.get("bytes", 0)) for e in entries),
                             time.time() - m.t if m else None, dead))
    return out
