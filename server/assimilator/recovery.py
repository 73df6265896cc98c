"""Rebuilding shards after a restart of Redis: newest snapshot + the merge log, replayed.

A durable merge (:mod:`boinc_dl.server.assimilator.mergelog`) keeps a shard's bytes out
of the append-only file, so a Redis that restarts has each such shard's log (commit
records on one Redis, logged marks and version on a cluster) but not its bytes. Such a
shard is "not live" (``shards.is_live``: an epoch tag of another server process, or
``bv < v``): every read and merge that meets one calls :func:`ensure_live`, which, under
a lock in Redis (one process rebuilds, the others wait), for every shard not live:

1. takes the newest base: the snapshot's copy of the shard at its version (a file,
   :mod:`~boinc_dl.server.assimilator.snapshot`), or the bytes Redis loaded itself (an
   AOF rewrite's copy, or the logged bytes of a merge of the old kind) at ``bv``;
2. lists the merges the shard's log holds after the base (the commit records' versions
   for this shard, or its marks ``u:<unit> -> version``), which must be every version from
   the base's to the newest the log names;
3. replays them in version order: each merge's input is read from its retained file
   (SHA-256 checked against the one its intent records; the size where the process
   that hashed it died first), and its registered rule (:mod:`~boinc_dl.server.assimilator.rules`)
   recomputes the shard with the same float ops in the same order: the bytes are
   identical to the ones that were lost;
4. writes the shard back (unlogged, only if its version did not move), with the marks of
   every merge the records list for it (a merge interrupted before the restart must find
   the shards it committed).

Each input file is read once and kept while a shard still needs it, so a replay reads
the log's inputs once. In a Redis Cluster a restarted master's shards are rebuilt from
its own log (the marks live with the shard, hash tags), the intents come from the
job's slot. What a replay cannot do (a missing input, a gap in a log) raises
:class:`RecoveryError`, a :class:`StoreUnavailable`: the merges wait, nothing is
rejected or overwritten, until an administrator restores the file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from boinc_dl.server.assimilator import rules
from boinc_dl.server.assimilator import shards as sh
from boinc_dl.server.assimilator import snapshot as snaps
from boinc_dl.server.assimilator.mergelog import input_rel, parse_records
from boinc_dl.server.assimilator.retained import sha256_of
from boinc_dl.server.common.errors import StoreUnavailable
from boinc_dl.server.common.paths import confined
from boinc_dl.server.common.weights import read_weights

if TYPE_CHECKING:
    from boinc_dl.server.assimilator.store import JobStore

log = logging.getLogger(__name__)

_LOCK_MS = 30_000
#: Seconds a rebuild takes per GB of retained inputs replayed (read, SHA-256 check, the
#: rule on every shard), measured by ``bench/bench_redis_restart.py --recovery-merges``
#: (bench/README.md); ``boinc-dl redis check`` estimates rebuild times with it.
REPLAY_S_PER_GB = 3.1
#: How long a process waits for another one's rebuild before it gives up (the
#: rebuilding process renews its lock as it goes; a dead one's lock lapses in 30 s).
WAIT_S = 1800.0


class RecoveryError(StoreUnavailable):
    """A shard cannot be rebuilt (an input or a snapshot is missing or damaged)."""


@dataclass
class Report:
    """What one rebuild did."""

    shards: list[int] = field(default_factory=list)
    merges: int = 0          # distinct merges replayed
    applied: int = 0         # shard updates replayed
    input_bytes: int = 0     # bytes of retained inputs read
    seconds: float = 0.0
    bases: dict[int, str] = field(default_factory=dict)  # shard -> "snapshot@v" | "redis@v"


def dead_shards(store: JobStore, model: str) -> list[int]:
    """The shards of ``model`` whose bytes in Redis are not current."""
    lay = store.layout(model)
    keys = [store._shard_keys(model, i)[1] for i in range(lay.shards)]

    def read() -> list[Any]:
        if store.cluster:
            # A cluster writes no epoch tags (its shards' logged ``v`` marks them instead).
            return [(*store.r.hmget(k, "tag", "v", "bv"), None) for k in keys]
        p = store.r.pipeline(transaction=False)
        p.eval(sh.RUN_ID_SCRIPT, 0)
        for k in keys:
            p.hmget(k, "tag", "v", "bv")
        rid, *heads = p.execute()
        return [(*h, rid) for h in heads]
    return [i for i, (tag, v, bv, rid) in enumerate(store.call(read)) if not store._live(tag, v, bv, rid)]


def ensure_live(store: JobStore, model: str) -> Report | None:
    """Rebuild every shard of ``model`` that is not live (or wait for the process that
    does); None when all were live."""
    if not dead_shards(store, model):
        return None
    lock, token = store.k("lock", "recover", model), os.urandom(8).hex()
    deadline = time.monotonic() + WAIT_S
    while not store.call(lambda: store.r.set(lock, token, nx=True, px=_LOCK_MS)):
        if not dead_shards(store, model):
            return None
        if time.monotonic() > deadline:
            raise RecoveryError(f"shards of {store.job}/{model} still not rebuilt after {WAIT_S:.0f} s")
        time.sleep(0.05)

    def renew() -> None:
        store.call(lambda: store.r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end "
            "return 0", 1, lock, token, _LOCK_MS))
    try:
        dead = dead_shards(store, model)
        if not dead:
            return None
        report = rebuild(store, model, dead, renew)
        log.warning("rebuilt %d shard(s) of %s/%s from %s: %d merge(s) replayed (%.1f MB of inputs) in %.2f s",
                    len(report.shards), store.job, model, sorted(set(report.bases.values()))[:3], report.merges,
                    report.input_bytes / 1e6, report.seconds)
        return report
    finally:
        store.call(lambda: store.r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            1, lock, token))


def _marks(raw: dict[bytes, bytes]) -> dict[int, str]:
    """version -> unit from a shard hash's ``u:<unit>`` fields (marks of merges of the
    oldest releases hold a token, not a version, and never lie in a replay's range)."""
    out: dict[int, str] = {}
    for k, v in raw.items():
        if k.startswith(b"u:"):
            try:
                out[int(v)] = k[2:].decode()
            except ValueError:
                continue
    return out


def rebuild(store: JobStore, model: str, dead: list[int], renew: Callable[[], None] = lambda: None) -> Report:
    """Steps 1-4 of the module doc for the shards ``dead`` (the caller holds the lock)."""
    t0 = time.perf_counter()
    lay = store.layout(model)
    rep = Report(shards=list(dead))
    m = snaps.manifest(store, model)
    snap: np.ndarray | None = None
    chains: dict[int, list[str]] = {}
    state: dict[int, np.ndarray] = {}
    target: dict[int, int] = {}
    read_v: dict[int, bytes] = {}
    # One Redis: the commit records (shard -> version -> unit) and the inputs' SHA-256;
    # a cluster keeps its records as marks in each shard's own hash (read below).
    records, rec_shas = parse_records(store.call(lambda: store.r.hgetall(store.mrec_key(model))))
    for i in dead:
        wkey, mkey = store._shard_keys(model, i)
        raw = store.call(lambda mkey=mkey: store.r.hgetall(mkey))
        read_v[i] = raw.get(b"v", b"0")
        # The shard's log: its logged marks (a cluster; on one Redis, the marks an AOF
        # rewrite's copy kept) and the commit records; both name the same unit for a version.
        log_of = {**_marks(raw), **records.get(i, {})}
        snap_v = m.versions[i] if m is not None and m.shards == lay.shards else -1
        # The version the shard reached: what its log says (a cluster logs ``v``; one Redis
        # logs a record per commit, of which those a snapshot covers may be truncated).
        v = max([int(read_v[i]), snap_v, *log_of])
        base_v, base = -1, None
        bv = raw.get(b"bv")
        if bv is not None and int(bv) <= v:
            w = store.call(lambda wkey=wkey: store.r.get(wkey))
            if w is not None:
                base_v, base, rep.bases[i] = int(bv), np.frombuffer(w, np.float32).copy(), f"redis@{int(bv)}"
        if base_v < snap_v <= v:
            if snap is None:
                try:
                    snap = snaps.load(store, m)  # type: ignore[arg-type]
                except (OSError, ValueError) as e:
                    raise RecoveryError(f"{store.job}/{model}: snapshot {m.file} unreadable: {e}") from None  # type: ignore[union-attr]
            base_v, base, rep.bases[i] = snap_v, np.array(snap[lay.bounds(i)]), f"snapshot@{snap_v}"
        if base is None:
            raise RecoveryError(f"{store.job}/{model}: shard {i} has neither a snapshot nor bytes in Redis to "
                                "start from")
        missing = [x for x in range(base_v + 1, v + 1) if x not in log_of]
        if missing:
            raise RecoveryError(f"{store.job}/{model}: shard {i}'s log lacks version(s) {missing[:5]} between "
                                f"its base {base_v} and {v}")
        chains[i] = [log_of[x] for x in range(base_v + 1, v + 1)]
        state[i], target[i] = base, v
    units = sorted({u for c in chains.values() for u in c})
    intents, shas = _intents(store, model, units)
    shas = {**rec_shas, **shas}
    fp = store.fingerprint(model)
    d = store.durable_dir()
    refs: dict[str, int] = {}
    for c in chains.values():
        for u in c:
            refs[u] = refs.get(u, 0) + 1
    pos = dict.fromkeys(chains, 0)
    loaded: dict[str, np.ndarray] = {}
    while True:
        for i, c in chains.items():
            while pos[i] < len(c) and c[pos[i]] in loaded:
                u = c[pos[i]]
                it = intents[u]
                sl = lay.bounds(i)
                state[i] = rules.apply(str(it["rule"]), state[i], loaded[u][sl], it.get("params") or {}, sl)
                pos[i] += 1
                rep.applied += 1
                refs[u] -= 1
                if refs[u] == 0:
                    del loaded[u]
        heads = [(i, c[pos[i]]) for i, c in chains.items() if pos[i] < len(c)]
        if not heads:
            break
        # The next input: the head of the shard furthest behind (its merge is the oldest
        # still waiting anywhere), read once for every shard that needs it.
        i, u = min(heads, key=lambda h: pos[h[0]] + (target[h[0]] - len(chains[h[0]])))
        if d is None:
            raise RecoveryError(f"{store.job}: no durable dir to read merge inputs from")
        loaded[u] = _load_input(d, intents[u], shas.get(u), fp, lay.n, f"{store.job}/{model}")
        rep.merges += 1
        rep.input_bytes += int(intents[u].get("bytes", 0))
        renew()
    restore = store._script("restore_shard", sh.RESTORE_SHARD)
    for i in dead:
        wkey, mkey = store._shard_keys(model, i)
        # The marks of every merge the records list for this shard (idempotency: a merge
        # interrupted before the restart must find the shards it already committed).
        marks = [a for ver, u in sorted(records.get(i, {}).items()) for a in (f"u:{u}", ver)]
        args = [read_v[i], target[i], sh.new_tag(), "0" if store.cluster else "1", sh.as_bytes(state[i]), *marks]
        if not int(store.call(lambda wkey=wkey, mkey=mkey, args=args: restore(keys=[wkey, mkey], args=args))):
            raise RecoveryError(f"{store.job}/{model}: shard {i} changed while it was rebuilt")
        store._cache.pop((model, i), None)
    rep.seconds = time.perf_counter() - t0
    return rep


def _intents(store: JobStore, model: str, units: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The intents of ``units`` (with ``unit`` and ``input``, the retained file) and the
    SHA-256 of their inputs, where recorded."""
    if not units:
        return {}, {}
    raw = store.call(lambda: store.r.hmget(store.mlog_key(model), units))
    intents: dict[str, dict[str, Any]] = {}
    shas: dict[str, str] = {}
    for u, it in zip(units, raw, strict=True):
        if it is None:
            raise RecoveryError(f"{store.job}/{model}: the log has no intent for unit {u} (dropped without a "
                                "snapshot covering it?)")
        intents[u] = {**json.loads(it), "unit": u, "input": input_rel(model, u, json.loads(it))}
        if rules.get(str(intents[u].get("rule"))) is None:
            raise RecoveryError(f"{store.job}/{model}: unit {u} was merged with rule {intents[u].get('rule')!r}, "
                                "which this process does not know")
        if intents[u].get("sha256"):
            shas[u] = str(intents[u]["sha256"])
    return intents, shas


def _load_input(d: Path, intent: dict[str, Any], sha: str | None, fp: Any, n: int, what: str) -> np.ndarray:
    """The weights of a logged merge's retained input, checked against the log."""
    try:
        path = confined(d, *Path(str(intent["input"])).parts)
        size = path.stat().st_size
        if size != int(intent.get("bytes", size)):
            raise OSError(f"{size} bytes, the log says {intent.get('bytes')}")
        if sha is not None and sha256_of(path) != sha:
            raise OSError("its SHA-256 differs from the merge record's")
        wc = read_weights(path, fp, max_bytes=size).flat
    except Exception as e:  # noqa: BLE001 - any failure to read an input stops the replay the same way
        raise RecoveryError(f"{what}: input {intent.get('input')} of unit {intent.get('unit')} "
                            f"cannot be replayed: {e}") from None
    if wc.size != n:
        raise RecoveryError(f"{what}: input of unit {intent.get('unit')} has {wc.size} values, the model {n}")
    return np.ascontiguousarray(wc, np.float32)


def rule_combine(store: JobStore, model: str, unit: str, intent: dict[str, Any], path: Path
                 ) -> Callable[[int], Callable[[np.ndarray], np.ndarray]]:
    """``combine_for(shard)`` of a logged merge, from its intent and retained input: how a
    second result of a unit finishes the merge the first one logged."""
    lay = store.layout(model)
    d = store.durable_dir()
    if d is None:
        raise RecoveryError(f"{store.job}: no durable dir to read merge inputs from")
    intent = {**intent, "unit": unit, "input": input_rel(model, unit, intent)}
    sha = intent.get("sha256") or store.call(lambda: store.r.hget(store.mrec_key(model), f"s:{unit}"))
    wc = _load_input(d, intent, sha.decode() if isinstance(sha, bytes) else sha, store.fingerprint(model), lay.n,
                     f"{store.job}/{model}")
    rule, params = str(intent["rule"]), intent.get("params") or {}

    def combine_for(i: int) -> Callable[[np.ndarray], np.ndarray]:
        sl = lay.bounds(i)
        return lambda part: rules.apply(rule, part, wc[sl], params, sl)
    return combine_for
