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


# Whether a shard's bytes in memory are current ("live"). Two ways for a shard's bytes
# to be out of the append-only file, and so lost in a restart of Redis:
#
# * ``bv`` (the version of the bytes) differs from ``v`` (the version the log says): a
#   durable merge committed by ``COMMIT_LOGGED`` (a cluster) logs ``v`` but not the bytes
#   nor ``bv``, so after a restart ``bv < v``;
# * the tag is an *epoch tag*, ``@<run id>:<random>``, written by a server whose run id is
#   not this one's: a durable merge committed by ``COMMIT_MANY`` (one Redis) logs neither
#   ``v`` nor its bytes (only one record per commit, on the model's record hash), and
#   marks the shard with the run id of the Redis process that holds its bytes in memory.
#   Redis draws a new run id at every start, so a restart (or a replica promoted, or an
#   AOF rewrite's copy reloaded) finds the tag foreign and the shard not live.
#
# Shards written in full (their bytes in the AOF: ``_write_shards``, the byte-logged
# merges) carry a plain tag with ``bv == v`` and are live after a restart. A shard not live
# is rebuilt from a snapshot and the merge log (:mod:`boinc_dl.server.assimilator.recovery`).
# Lua snippet: ``m`` holds HMGET's tag, v, bv at indexes T, V, B. ``run_id()`` is defined by
# :data:`_RUN_ID` (INFO costs about 3 us, called only for an epoch tag).
_RUN_ID = """
local function run_id()
  return string.sub(string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'), 1, 16)
end
"""
_LIVE = ("({m}[{T}] and (not {m}[{B}] or {m}[{B}] == ({m}[{V}] or '0')) and "
         "(string.byte({m}[{T}], 1) ~= 64 or string.sub({m}[{T}], 2, 17) == run_id()))")
#: The server's run id (its first :data:`RUN_ID_CHARS` hex digits), fetched in the same
#: round trip as a shard's tag (``EVAL``, not ``EVALSHA``: nothing to reload after a
#: restart): the answer comes from the very server whose tag it is checked against.
RUN_ID_SCRIPT = _RUN_ID + "return run_id()"
#: The first character of an epoch tag (``@``: a plain tag is hex).
EPOCH_TAG = b"@"
#: Hex digits of the run id an epoch tag carries.
RUN_ID_CHARS = 16

# Read one shard: its tag, version, this unit's mark, its bytes unless the caller's
# cached copy carries the current tag (then the bytes are not sent), and 1 if live
# (0: rebuild it first; no bytes then).
READ_SHARD = _RUN_ID + f"""
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
CAS_SHARD = _RUN_ID + f"""
local m = redis.call('HMGET', KEYS[2], 'tag', 'v', 'bv', ARGV[3])
if m[4] then return {{0, m[4]}} end
if not {_LIVE.format(m="m", T=1, V=2, B=3)} then return {{-2}} end
if ARGV[1] ~= '' and m[1] ~= ARGV[1] then return {{-1}} end
local v = tonumber(m[2] or '0') + 1
redis.call('SET', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[2], 'tag', ARGV[2], ARGV[3], v, 'v', v, 'bv', v)
return {{1, v}}
"""

# A durable merge's write of one shard in a Redis Cluster (strict: the tag must be the
# one the merge read). The bytes, the new tag and ``bv`` stay out of the append-only file
# and replication (``REPL_NONE``): they are rebuilt from the merge log after a restart.
# The version and the unit's mark (value: the version it produced) are logged, in the
# same atomic script: the mark is the shard's log entry, "shard i reached version v by
# merging unit u", and it lives in the shard's own slot, so each master's AOF holds the
# log of its own shards. ARGV: expected tag, new tag, mark field, bytes. Replies as
# CAS_SHARD.
COMMIT_LOGGED = _RUN_ID + f"""
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

# A durable merge's write of one or more shards on one Redis, and the one record that
# logs them. Per shard (strict: the tag must be the one the merge read; skipped when it
# carries the unit already) the bytes, an epoch tag, ``v``, ``bv`` and the unit's mark
# are written with replication off: none of it reaches the AOF. What the AOF gets is one
# command for the whole call, ``HSET <record hash> <first shard>:<unit> "i:v,i:v,..."``:
# the versions this merge produced in the shards it committed here. That record is the
# log entry of every shard it lists (a replay orders each shard's merges by these
# versions) and the durable form of their marks (recovery writes them back). The first
# commit into a shard whose tag is plain (its state last written in full) also logs its
# new epoch tag, once: from then on the logged state of the shard is "not live" and a
# restart rebuilds it. A unit already marked assimilated carries every shard (its marks
# may predate the last restart and be gone: only records of settled merges are ever
# truncated): nothing is written ({-3}).
# KEYS: assimilated, record hash, then per shard its bytes and hash keys.
# ARGV: unit, mark field, then per shard: index, expected tag, new tag's random part, bytes.
# Returns per shard {1, v, tag} applied, {0, v} already applied, {-1} conflict, {-2} not live.
COMMIT_MANY = _RUN_ID + f"""
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {{-3}} end
local rid = nil
local out, rec = {{}}, {{}}
local first = nil
for j = 0, (#KEYS - 2) / 2 - 1 do
  local wk, mk = KEYS[3 + 2 * j], KEYS[4 + 2 * j]
  local i, exp, nt = ARGV[3 + 4 * j], ARGV[4 + 4 * j], ARGV[5 + 4 * j]
  local m = redis.call('HMGET', mk, 'tag', 'v', 'bv', ARGV[2])
  if m[4] then out[j + 1] = {{0, m[4]}}
  elseif not {_LIVE.format(m="m", T=1, V=2, B=3)} then out[j + 1] = {{-2}}
  elseif m[1] ~= exp then out[j + 1] = {{-1}}
  else
    local v = tonumber(m[2] or '0') + 1
    rid = rid or run_id()
    local tag = '@' .. rid .. ':' .. nt
    if string.byte(m[1], 1) ~= 64 then
      redis.call('HSET', mk, 'tag', tag)
    end
    redis.set_repl(redis.REPL_NONE)
    redis.call('SET', wk, ARGV[6 + 4 * j])
    redis.call('HSET', mk, 'tag', tag, 'v', v, 'bv', v, ARGV[2], v)
    redis.set_repl(redis.REPL_ALL)
    first = first or i
    rec[#rec + 1] = i .. ':' .. v
    out[j + 1] = {{1, v, tag}}
  end
end
if first then redis.call('HSET', KEYS[2], first .. ':' .. ARGV[1], table.concat(rec, ',')) end
return out
"""

# Recovery's write of a rebuilt shard, unlogged like a durable merge's, only if the
# shard's version is still the one the rebuild read. ARGV: version read, version
# rebuilt to, new tag's random part, epoch tag (1) or plain tag (0: a cluster, whose
# logged ``v`` already marks the shard), bytes, then pairs of (mark field, version): the
# marks of the merges the log records for this shard. An epoch tag is logged, so that
# the logged state of the shard stays "not live" (its bytes are not in the AOF).
RESTORE_SHARD = _RUN_ID + """
local v = redis.call('HGET', KEYS[2], 'v') or '0'
if v ~= ARGV[1] then return 0 end
local tag = ARGV[3]
if ARGV[4] == '1' then
  tag = '@' .. run_id() .. ':' .. ARGV[3]
  redis.call('HSET', KEYS[2], 'tag', tag)
end
redis.set_repl(redis.REPL_NONE)
redis.call('SET', KEYS[1], ARGV[5])
redis.call('HSET', KEYS[2], 'tag', tag, 'v', ARGV[2], 'bv', ARGV[2])
for j = 6, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1]) end
redis.set_repl(redis.REPL_ALL)
return 1
"""


def is_live(tag: object, v: object, bv: object, run_id: bytes | None = None) -> bool:
    """The Python twin of the scripts' liveness test (HMGET replies, bytes or None);
    ``run_id``: the first :data:`RUN_ID_CHARS` hex digits of the server's run id, which
    an epoch tag must carry (None: an epoch tag is taken as foreign)."""
    if tag is None or not (bv is None or bv == (v if v is not None else b"0")):
        return False
    if isinstance(tag, bytes) and tag.startswith(EPOCH_TAG):
        return run_id is not None and tag[1:1 + RUN_ID_CHARS] == run_id
    return True


def epoch_run_id(tag: object) -> bytes | None:
    """The run id an epoch tag carries (None for a plain tag)."""
    if isinstance(tag, bytes) and tag.startswith(EPOCH_TAG):
        return tag[1:1 + RUN_ID_CHARS]
    return None


# The unit's global "assimilated" mark, set once every shard carries the unit, with
# the accounting it drives (version counter, unit state, epoch count, metrics entry).
# The metrics entry names the unit; its record is the one in ``assimilated`` (the stream
# does not carry it a second time: about 0.9 KB less in the AOF per merge, and
# ``JobStore.metrics`` reads it from there).
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
redis.call('XADD', KEYS[4], '*', 'kind', 'merge', 'unit', ARGV[1], 'model', ARGV[4])
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
