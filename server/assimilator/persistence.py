"""Does a Redis keep boinc-dl's promises when it crashes? Its persistence settings, checked.

boinc-dl's guarantee "no acknowledged merge is lost when Redis dies" (docs/fault-tolerance.md)
holds only with an append-only file written before each reply: it holds the merge log
(each merge's intent, its input's SHA-256 and its commit records, or on a cluster each
shard's version and marks; the shard bytes themselves are rebuilt from snapshots and
retained inputs) and the job's bookkeeping. So ``appendonly
yes`` with ``appendfsync no`` (plus :mod:`boinc_dl.server.assimilator.aof_sync` flushing
it once a second) or ``always``, which the log's small writes now make affordable.
Redis's usual ``everysec`` replies before it writes while its previous fsync is slow, and
a Redis without an AOF loses everything since its last snapshot. The private Redis of
``boinc-dl run`` and the docker stack are set up right; a Redis of the admin's own is
checked here, by ``boinc-dl redis check`` and by the BOINC work generator when it
connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import redis

_MIN_REWRITE_PERCENTAGE = 400
_MIN_REWRITE_BYTES = 1 << 30

#: What boinc-dl runs its own Redis with (``EmbeddedRedis``, ``docker/redis/redis.conf``).
#: The rewrite thresholds matter for byte-logged merges (eventual mode, jobs without a
#: directory), which append the whole model to the AOF: Redis's defaults (rewrite at 2x,
#: at least 64 MB) then rewrite it every two or three merges of a large model. A logged
#: merge appends a few KB, and a rewrite every tens of thousands of merges costs nothing.
RECOMMENDED: dict[str, str] = {
    "appendonly": "yes",
    "appendfsync": "no",
    "auto-aof-rewrite-percentage": str(_MIN_REWRITE_PERCENTAGE),
    "auto-aof-rewrite-min-size": f"{_MIN_REWRITE_BYTES >> 30}gb",
}
#: The settings read from each node: the recommended ones and where the AOF lives.
SETTINGS = (*RECOMMENDED, "dir")

Severity = Literal["error", "warning", "note"]


@dataclass(frozen=True)
class Finding:
    """One thing to fix or know about one Redis node (``node`` is ``host:port``)."""

    node: str
    severity: Severity
    message: str


def _nodes(client: Any) -> list[tuple[str, redis.Redis]]:
    """Every master of a cluster client, or the one server of a plain client."""
    if isinstance(client, redis.RedisCluster):
        return [(f"{n.host}:{n.port}", client.get_redis_connection(n)) for n in client.get_primaries()]
    kw = client.connection_pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    return [(str(where), client)]


def read_settings(client: Any) -> dict[str, dict[str, str] | str]:
    """Per node, its persistence settings (one ``CONFIG GET``), or why they could not be
    read (a ``CONFIG`` renamed away or not permitted to this user: common on managed Redis)."""
    out: dict[str, dict[str, str] | str] = {}
    for name, node in _nodes(client):
        try:
            raw = node.config_get("*")  # Redis 6 takes one pattern per call: one call for all
        except redis.ResponseError as e:
            out[name] = str(e)
            continue
        out[name] = {k: _text(raw.get(k, "")) for k in SETTINGS}
    return out


def data_dir(client: Any) -> str | None:
    """The directory the (first) Redis node writes its append-only file and snapshots in
    (``CONFIG GET dir``), or None when it cannot be read: where a "cannot write its AOF"
    fault is, for the message that says how much space is free there."""
    # Best effort, called while handling another fault: whatever goes wrong here (Redis
    # down as well, CONFIG renamed away, a cluster that cannot list its nodes) is None.
    try:
        for _, node in _nodes(client):
            return _text(node.config_get("dir").get("dir", "")) or None
    except Exception:  # noqa: BLE001
        return None
    return None


def script_access(client: Any) -> dict[str, str | None]:
    """Per node, None when a Lua script may call ``INFO`` there, else the error. boinc-dl's
    shard scripts read the server's run id with it (a shard whose bytes are not in the
    AOF is tagged with the run id that wrote it: a restarted Redis has a new one), so
    a Redis that renames ``INFO`` away or denies it to this user fails every merge."""
    from boinc_dl.server.assimilator.shards import RUN_ID_SCRIPT

    out: dict[str, str | None] = {}
    for name, node in _nodes(client):
        try:
            rid = node.eval(RUN_ID_SCRIPT, 0)
            out[name] = None if rid else "INFO gave no run_id"
        except redis.ResponseError as e:
            out[name] = str(e)
    return out


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def check_node(name: str, s: dict[str, str]) -> list[Finding]:
    """What is wrong with one node's settings (all of it at once, so that one round of
    changes fixes everything)."""
    found: list[Finding] = []
    sync_cmd = f"`boinc-dl redis sync-aof {s.get('dir') or 'DIR'}`"
    if s.get("appendonly") != "yes":
        found.append(Finding(name, "error", "no append-only file (appendonly no): a crash of Redis loses the merge "
                                            "log and every mark since its last RDB snapshot, while BOINC has "
                                            "already counted those units as assimilated. Set appendonly yes"))
    fsync = s.get("appendfsync")
    if fsync == "everysec":
        found.append(Finding(name, "error", "appendfsync everysec can acknowledge a merge and then lose it when the "
                                            "Redis process crashes (it postpones the AOF write while a slow fsync "
                                            f"runs). Set appendfsync no and run {sync_cmd} beside Redis, or "
                                            "appendfsync always"))
    elif fsync == "no":
        found.append(Finding(name, "note", "appendfsync no: nothing acknowledged is lost when Redis crashes; make "
                                           f"sure {sync_cmd} runs beside Redis, or an OS crash can lose "
                                           "up to the kernel's writeback delay (about 30 s) of merges. "
                                           "appendfsync always loses none: the merge log's writes are small"))
    try:
        pct = int(s.get("auto-aof-rewrite-percentage") or 0)
        min_size = int(s.get("auto-aof-rewrite-min-size") or 0)
    except ValueError:
        pct, min_size = _MIN_REWRITE_PERCENTAGE, _MIN_REWRITE_BYTES
    if pct and (pct < _MIN_REWRITE_PERCENTAGE or min_size < _MIN_REWRITE_BYTES):
        rewrite = " and ".join(f"{k} {v}" for k, v in RECOMMENDED.items() if k.startswith("auto-aof"))
        found.append(Finding(name, "note", f"the AOF is rewritten at {pct}% growth, {min_size >> 20} MB at least: "
                                           "fine for logged merges (2-3 KB each); byte-logged ones (eventual "
                                           "mode, jobs without a directory) append the whole model, and then "
                                           f"that is a rewrite every few merges. Set {rewrite} for those"))
    return found


def findings(settings: dict[str, dict[str, str] | str],
             scripts: dict[str, str | None] | None = None) -> list[Finding]:
    """Findings for every node of :func:`read_settings`' answer (and of
    :func:`script_access`'s, when given); a node whose settings could not be read gives a
    warning that says what to check by hand."""
    found: list[Finding] = []
    for name, err in (scripts or {}).items():
        if err is not None:
            found.append(Finding(name, "error", f"a script cannot call INFO here ({err}): boinc-dl's merges read "
                                                "the server's run id in their scripts (to tell the shards a "
                                                "restart emptied), so every merge fails. Let scripts run INFO "
                                                "(do not rename it; an ACL user needs +info)"))
    for name, s in settings.items():
        if isinstance(s, str):
            found.append(Finding(name, "warning", f"could not read the persistence settings ({s}); check by hand "
                                                  "that appendonly is yes and appendfsync is no (with `boinc-dl "
                                                  "redis sync-aof`) or always"))
        else:
            found.extend(check_node(name, s))
    return found


def check_persistence(client: Any) -> list[Finding]:
    """Findings for every node of ``client`` (a plain or a cluster client)."""
    return findings(read_settings(client), script_access(client))
