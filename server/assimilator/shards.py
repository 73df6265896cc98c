"""Sharded server weights: the layout of a model's parameters over Redis keys.

A model's flat float32 buffer is cut into ``S`` contiguous shards of about
:data:`TARGET_SHARD_BYTES` each (a small model stays one shard). Each shard lives
under its own Redis hash tag, so in a Redis Cluster the shards of one model spread
over the masters and two assimilators on different shards never meet, while a
shard's bytes, its version and its "unit applied" marks share one slot and change
together in one transaction (strict mode: ``WATCH``/``MULTI``/``EXEC`` in
:meth:`boinc_dl.server.assimilator.store.JobStore.merge`; eventual mode: the Lua script below). The
float math runs in numpy in the assimilator; Redis only stores bytes.

Keys of shard ``i`` of model ``M`` of job ``J`` (``B = bdl:J:s:{J/M/i}``):

``B:w``  the shard's float32 bytes
``B:m``  hash: ``tag`` (random, new at every write), ``v`` (writes applied),
         ``bv`` (the version of the bytes in memory), ``u:<unit>`` -> the version
         the merge of ``unit`` produced in this shard (the shard's merge log)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Target bytes per shard: 1-4 MB keeps one shard's write short (no head-of-line
#: blocking of other clients) while the per-shard round trips stay few. Overridable
#: with ``BDL_SHARD_BYTES`` (tests and the learning comparison force several shards).
TARGET_SHARD_BYTES = 1_310_720  # 1.25 MiB: the paper's 4,972,746-parameter model -> 16 shards
MAX_SHARDS = 4096


def target_shard_bytes() -> int:
    """The shard size new models are cut at (``BDL_SHARD_BYTES`` overrides)."""
    raw = os.environ.get("BDL_SHARD_BYTES", "")
    try:
        return max(4, int(raw)) if raw else TARGET_SHARD_BYTES
    except ValueError:
        return TARGET_SHARD_BYTES


def shards_for(n_params: int, shard_bytes: int | None = None) -> int:
    """How many shards a model of ``n_params`` float32 values gets (at least 1)."""
    b = shard_bytes or target_shard_bytes()
    return int(min(MAX_SHARDS, max(1, math.ceil(n_params * 4 / b))))


@dataclass(frozen=True)
class ShardLayout:
    """``n`` parameters cut into ``shards`` contiguous ranges of near-equal size."""

    n: int
    shards: int

    def bounds(self, i: int) -> slice:
        """The parameter range of shard ``i``."""
        return slice(self.n * i // self.shards, self.n * (i + 1) // self.shards)

    def to_json(self) -> dict[str, int]:
        return {"n": self.n, "shards": self.shards}


@dataclass
class Snapshot:
    """A read of a model's weights: every shard atomic, the shards possibly from
    different moments (see ``docs/parameter-server.md``).

    ``version`` is the smallest shard version: every shard holds at least that many
    merges, so it is a valid lower bound on the snapshot's freshness."""

    flat: np.ndarray
    shard_versions: list[int]

    @property
    def version(self) -> int:
        return min(self.shard_versions) if self.shard_versions else 0


# Whether a shard's bytes in memory are current ("live"): its ``tag`` is there and
# ``bv`` (the version of the bytes) equals ``v`` (the version the log says). A durable
# merge writes the bytes, ``tag`` and ``bv`` without logging them (``COMMIT_LOGGED``),
# so after a restart of Redis the shard is not live until it is rebuilt from a
# snapshot and the merge log (:mod:`boinc_dl.server.assimilator.recovery`). Shards
# written before ``bv`` existed have none and are live. Lua snippet: ``m`` holds
# HMGET's tag, v, bv at indexes T, V, B.
_LIVE = "({m}[{T}] and (not {m}[{B}] or {m}[{B}] == ({m}[{V}] or '0')))"

# Read one shard: its tag, version, this unit's mark, its bytes unless the caller's
# cached copy carries the current tag (then the bytes are not sent), and 1 if live
# (0: rebuild it first; no bytes then).
READ_SHARD = f"""
local m = redis.call('HMGET', KEYS[2], 'tag', 'v', ARGV[1], 'bv')
if not {_LIVE.format(m="m", T=1, V=2, B=4)} then return {{m[1], m[2], m[3], false, 0}} end
if m[1] == ARGV[2] then return {{m[1], m[2], m[3], false, 1}} end
return {{m[1], m[2], m[3], redis.call('GET', KEYS[1]), 1}}
"""

# Write of one shard and its "unit applied" mark, atomically, all of it in the
# append-only file (eventual mode, and merges that cannot be replayed; strict merges of
# the old kind use WATCH/MULTI instead, which copy the bytes fewer times). ARGV:
# expected tag ('' in eventual mode: no check, the paper's lossy merge), new tag, mark
# field, bytes. The mark's value is the version the write produced. Returns {1, v}
# applied, {0, v} already applied, {-1} conflict, {-2} shard not live.
CAS_SHARD = f"""
local m = redis.call('HMGET', KEYS[2], 'tag', 'v', 'bv', ARGV[3])
if m[4] then return {{0, m[4]}} end
if not {_LIVE.format(m="m", T=1, V=2, B=3)} then return {{-2}} end
if ARGV[1] ~= '' and m[1] ~= ARGV[1] then return {{-1}} end
local v = tonumber(m[2] or '0') + 1
redis.call('SET', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[2], 'tag', ARGV[2], ARGV[3], v, 'v', v, 'bv', v)
return {{1, v}}
"""

# A durable merge's write of one shard (strict: the tag must be the one the merge
# read). The bytes, the new tag and ``bv`` stay out of the append-only file and
# replication (``REPL_NONE``): they are rebuilt from the merge log after a restart. The
# version and the unit's mark (value: the version it produced) are logged, in the same
# atomic script: the mark is the shard's log entry, "shard i reached version v by
# merging unit u". ARGV: expected tag, new tag, mark field, bytes. Replies as CAS_SHARD.
COMMIT_LOGGED = f"""
local m = redis.call('HMGET', KEYS[2], 'tag', 'v', 'bv', ARGV[3])
if m[4] then return {{0, m[4]}} end
if not {_LIVE.format(m="m", T=1, V=2, B=3)} then return {{-2}} end
if m[1] ~= ARGV[1] then return {{-1}} end
local v = tonumber(m[2] or '0') + 1
redis.set_repl(redis.REPL_NONE)
redis.call('SET', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[2], 'tag', ARGV[2], 'bv', v)
redis.set_repl(redis.REPL_ALL)
redis.call('HSET', KEYS[2], 'v', v, ARGV[3], v)
return {{1, v}}
"""

# Recovery's write of a rebuilt shard, unlogged like a durable merge's, only if the
# shard's version is still the one it was rebuilt to. ARGV: version, new tag, bytes.
RESTORE_SHARD = """
local v = redis.call('HGET', KEYS[2], 'v') or '0'
if v ~= ARGV[1] then return 0 end
redis.set_repl(redis.REPL_NONE)
redis.call('SET', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], 'tag', ARGV[2], 'bv', v)
redis.set_repl(redis.REPL_ALL)
return 1
"""


def is_live(tag: object, v: object, bv: object) -> bool:
    """The Python twin of the scripts' liveness test (HMGET replies, bytes or None)."""
    return tag is not None and (bv is None or bv == (v if v is not None else b"0"))


# The unit's global "assimilated" mark, set once every shard carries the unit, with
# the accounting it drives (version counter, unit state, epoch count, metrics entry).
# A unit given up meanwhile (its epoch already counted it failed) is not marked: its
# shards carry the update, but the accounting never counts one unit twice.
# KEYS: assimilated, unit_state, epoch hash, metrics, version counter, failed.
# ARGV: unit, record JSON without its closing brace, has-epoch flag, model.
FINALIZE = """
local prev = redis.call('HGET', KEYS[1], ARGV[1])
if prev then return {0, prev} end
if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[4], '*', 'kind', 'late_merge', 'unit', ARGV[1], 'model', ARGV[4])
  return {-1}
end
local v = redis.call('INCR', KEYS[5])
local rec = ARGV[2] .. ',"version":' .. v .. ',"base_version_seen":' .. (v - 1) .. '}'
redis.call('HSET', KEYS[1], ARGV[1], rec)
redis.call('HSET', KEYS[2], ARGV[1], 'assimilated')
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], 'assimilated', 1) end
redis.call('XADD', KEYS[4], '*', 'kind', 'merge', 'unit', ARGV[1], 'model', ARGV[4], 'data', rec)
return {1, v}
"""


def new_tag() -> bytes:
    """A fresh random tag for a shard write (a matching tag proves a cached copy current)."""
    return os.urandom(12).hex().encode()


def as_bytes(a: np.ndarray) -> memoryview:
    """A float32 array's bytes, without a copy when it is already contiguous float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return memoryview(a).cast("B")


def save_shard_versions(weights_path: Path, versions: list[int]) -> None:
    """Record next to a server weights file the shard versions of the snapshot in it
    (server side only: the workunit description carries them to the unit)."""
    tmp = weights_path.with_name(f".tmp.{weights_path.name}.shards")
    tmp.write_text(json.dumps(versions))
    tmp.replace(shard_versions_path(weights_path))


def load_shard_versions(weights_path: Path) -> list[int] | None:
    """The shard versions recorded by :func:`save_shard_versions` (None if absent)."""
    try:
        v = json.loads(shard_versions_path(weights_path).read_text())
    except (OSError, ValueError):
        return None
    return [int(x) for x in v] if isinstance(v, list) else None


def shard_versions_path(weights_path: Path) -> Path:
    return weights_path.with_name(f"{weights_path.name}.shards.json")
