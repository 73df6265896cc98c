"""Redis Cluster as the job store's engine: URL parsing and the client.

``redis_url`` names a cluster in one of two ways:

* ``redis+cluster://host1:port1,host2:port2/`` (any reachable subset of the
  masters: the client discovers the rest), optionally ``redis+cluster://:password@...``;
* a comma-separated list of ``redis://host:port`` URLs.

Every key of a job's bookkeeping carries the hash tag ``{job}`` (one slot), every
weights shard its own tag (spread over the masters): see :mod:`boinc_dl.server.common.shards`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.cluster import ClusterNode, RedisCluster

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


__all__ = ["CLUSTER_SCHEME", "cluster_client", "cluster_nodes", "is_cluster", "is_cluster_url"]
