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
         ``u:<unit>`` -> token of the merge that applied ``unit`` to this shard
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


# Read one shard: its tag, version, this unit's mark, and its bytes unless the caller's
# cached copy carries the current tag (then the bytes are not sent).
READ_SHARD = """
local m = redis.call('HMGET', KEYS[2], 'tag', 'v', ARGV[1])
if m[1] and m[1] == ARGV[2] then return {m[1], m[2], m[3], false} end
return {m[1], m[2], m[3], redis.call('GET', KEYS[1])}
"""

# Write of one shard and its "unit applied" mark, atomically (eventual mode; strict
# merges use WATCH/MULTI instead, which copy the bytes fewer times). ARGV: expected
# tag ('' in eventual mode: no check, the paper's lossy merge), new tag, mark field,
# token, bytes. Returns {1, v} applied, {0, token} already applied, {-1} conflict.
CAS_SHARD = """
local prev = redis.call('HGET', KEYS[2], ARGV[3])
if prev then return {0, prev} end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[2], 'tag') ~= ARGV[1] then return {-1} end
redis.call('SET', KEYS[1], ARGV[5])
redis.call('HSET', KEYS[2], 'tag', ARGV[2], ARGV[3], ARGV[4])
return {1, redis.call('HINCRBY', KEYS[2], 'v', 1)}
"""

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
