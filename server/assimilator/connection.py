"""Connections to the Redis that holds the job state: one server or a Redis Cluster.

A Redis URL names one server (``redis://host:port/db``, ``unix:///path?db=0``) or a
cluster in one of two ways:

* ``redis+cluster://host1:port1,host2:port2/`` (any reachable subset of the
  masters: the client discovers the rest), optionally ``redis+cluster://:password@...``;
* a comma-separated list of ``redis://host:port`` URLs.

Every key of a job's bookkeeping carries the hash tag ``{job}`` (one slot), every
weights shard its own tag (spread over the masters): see
:mod:`boinc_dl.server.assimilator.shards`. Which URL a command uses is decided in one
place, :func:`resolve_url`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from boinc_dl.server.assimilator.retry import is_transient
from boinc_dl.server.common.errors import BoincDLError, StoreUnavailable

#: The environment variable that names the Redis of the job state (wins over files).
ENV_URL = "BDL_REDIS_URL"
#: A file holding the Redis password (a docker/compose secret), for URLs without one.
ENV_PASSWORD_FILE = "BDL_REDIS_PASSWORD_FILE"


class NoRedisURL(BoincDLError):
    """No Redis URL was given anywhere."""


def resolve_url(explicit: str | None = None, configured: str | None = None, where: str = "") -> str:
    """The Redis URL a command uses: ``explicit`` (a command-line option), else
    ``$BDL_REDIS_URL``, else ``configured`` (a project's ``boinc-dl.yaml``); with the
    password of ``$BDL_REDIS_PASSWORD_FILE`` put in when the URL carries none.
    ``where`` says where ``configured`` would come from, for the error."""
    url = explicit or os.environ.get(ENV_URL) or configured
    if not url:
        hint = f" or 'redis_url' in {where}" if where else ""
        raise NoRedisURL(f"no Redis URL: pass --redis-url, set {ENV_URL}{hint}")
    pw_file = os.environ.get(ENV_PASSWORD_FILE)
    return with_password(url, Path(pw_file).read_text().strip()) if pw_file else url


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in it, unless it already has one (URL-encoded)."""
    parts = urlsplit(url)
    if parts.password or not password:
        return url
    if parts.scheme in ("redis", "rediss"):
        host = parts.hostname or "localhost"
        netloc = f":{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    if parts.scheme == "unix":
        sep = "&" if parts.query else ""
        return urlunsplit(("unix", "", parts.path, f"{parts.query}{sep}password={quote(password, safe='')}", ""))
    return url


CLUSTER_SCHEME = "redis+cluster://"


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster rather than one server."""
    return url.startswith(CLUSTER_SCHEME) or ("," in url and url.startswith("redis://"))


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """The startup nodes and password named by a cluster URL (see the module doc)."""
    password: str | None = None
    if url.startswith(CLUSTER_SCHEME):
        rest = url[len(CLUSTER_SCHEME):]
        if "@" in rest:
            cred, rest = rest.rsplit("@", 1)
            password = unquote(cred.split(":", 1)[-1]) or None
        parts = [f"redis://{p}" for p in rest.split("/", 1)[0].split(",") if p]
    else:
        parts = [p.strip() for p in url.split(",") if p.strip()]
    nodes: list[tuple[str, int]] = []
    for p in parts:
        u = urlsplit(p)
        if not u.hostname:
            raise ValueError(f"bad Redis Cluster node {p!r} in {url!r}")
        nodes.append((u.hostname, u.port or 6379))
        password = password or (unquote(u.password) if u.password else None)
    if not nodes:
        raise ValueError(f"no Redis Cluster nodes in {url!r}")
    return nodes, password


def cluster_client(url: str, timeout: float) -> RedisCluster:
    """A RedisCluster client for ``url`` (it reads the slot map from the first node
    that answers)."""
    nodes, password = cluster_nodes(url)
    kw: dict[str, Any] = {"socket_timeout": max(timeout, 30.0), "socket_connect_timeout": timeout,
                          "password": password}
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kw)


def is_cluster(r: Any) -> bool:
    """True for a Redis Cluster client."""
    return isinstance(r, RedisCluster)


class _BigBufferMixin:
    """Larger socket buffers: a 20 MB weights value crosses in far fewer wake-ups."""

    def _connect(self):  # type: ignore[no-untyped-def]
        sock = super()._connect()  # type: ignore[misc]
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 8 * 1024 * 1024)
            except OSError:
                pass
        return sock


class _UnixConnection(_BigBufferMixin, redis.UnixDomainSocketConnection):
    pass


class _TCPConnection(_BigBufferMixin, redis.Connection):
    pass


def connect(url: str, timeout: float = 10.0, wait_s: float = 0.0) -> redis.Redis:
    """Connect to Redis (``redis://``, ``unix://``, or a Redis Cluster:
    ``redis+cluster://h1:p1,h2:p2`` or a comma-separated list of ``redis://`` nodes)
    and check it answers.

    ``wait_s`` > 0 keeps trying that long (a daemon starting while Redis restarts);
    the default fails at once with one clear message (a user command)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            if is_cluster_url(url):
                r: Any = cluster_client(url, timeout)
            else:
                pool = redis.ConnectionPool.from_url(url, socket_timeout=max(timeout, 30.0),
                                                     socket_connect_timeout=timeout)
                pool.connection_class = _UnixConnection \
                    if pool.connection_class is redis.UnixDomainSocketConnection \
                    else _TCPConnection if pool.connection_class is redis.Connection else pool.connection_class
                r = redis.Redis(connection_pool=pool)
            r.ping()
            return r
        except (redis.RedisError, redis.RedisClusterException, OSError) as e:
            if not isinstance(e, redis.ConnectionError | redis.TimeoutError | redis.BusyLoadingError
                              | redis.RedisClusterException | OSError) and not is_transient(e):
                raise
            if time.monotonic() >= end:
                raise StoreUnavailable(f"Redis at {url} is unreachable: {e}") from None
            time.sleep(0.1)
