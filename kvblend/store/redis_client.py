"""How the shared tier reaches Redis: one server through redis-py's client, or a Redis Cluster
(Valkey too) through redis-py's cluster client, which routes each key to the master of its slot,
follows MOVED and ASK, and relearns the slot map when a node fails."""

from __future__ import annotations

from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterError, RedisCluster, RedisClusterException
from redis.exceptions import TryAgainError
from redis.retry import Retry

from ..config import REMOTE_SCHEMES

# What a node that is down, or a cluster between masters, raises: the tier reads as empty there.
FAULTS = (redis.ConnectionError, redis.TimeoutError, ClusterError, TryAgainError, RedisClusterException, OSError)


def parse_url(url: str, cluster: bool = False) -> tuple[str, bool]:
    """(the URL redis-py takes, whether it names a cluster): a redis+cluster:// URL is a cluster's,
    as is any URL where the setting says so. A clear error for anything else."""
    if not url.startswith(REMOTE_SCHEMES):
        raise ValueError(f"remote_url {url!r}: kvblend's remote tier is Redis; give a redis://host:port[/db] "
                         f"(or rediss://, unix://) URL, or redis+cluster://host:port for a Redis Cluster")
    for scheme in ("redis", "rediss"):
        if url.startswith(f"{scheme}+cluster://"):
            url, cluster = f"{scheme}://" + url.removeprefix(f"{scheme}+cluster://"), True
    if cluster and url.startswith("unix://"):
        raise ValueError(f"remote_url {url!r}: a Redis Cluster is reached over TCP, not a unix socket")
    if cluster and urlparse(url).path.strip("/") not in ("", "0"):
        raise ValueError(f"remote_url {url!r}: a Redis Cluster has database 0 only")
    return url, cluster


def connect(url: str, cluster: bool, timeout_s: float) -> redis.Redis | RedisCluster:
    """A client of `url` (as parse_url gives it). A cluster's client asks a node for the slot map as
    it is made, so this raises one of FAULTS when none answers; a server's connects on first use."""
    # One quick retry covers a connection that went stale across a restart or a failover; no
    # backoff, so a dead node costs a request one refused connect, not seconds.
    options = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s, "retry": Retry(NoBackoff(), 1)}
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)
