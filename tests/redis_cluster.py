"""A real Redis Cluster on loopback for the tests: three masters with a replica each, one for the
session (benchmarks/local_servers.py starts it with `redis-cli --cluster create`), stopped with
every process and file however the session ends."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from redis_server import RedisServer

# The benchmarks' launcher, registered under its name so a benchmark loaded by a test finds it too.
if "local_servers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "local_servers", Path(__file__).parent.parent / "benchmarks" / "local_servers.py")
    sys.modules["local_servers"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["local_servers"])
local_servers = sys.modules["local_servers"]
LocalCluster = local_servers.LocalCluster


def skip_without_binaries() -> None:
    missing = local_servers.missing_binaries()
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the Redis Cluster tests need them "
                    "(`make setup` installs redis-server, which brings redis-cli)")


def start_cluster() -> LocalCluster:
    """A cluster on fresh ports, not started yet."""
    skip_without_binaries()
    return LocalCluster()


@pytest.fixture(scope="session")
def redis_cluster():
    """One cluster for the session (starting one takes a few seconds); each test that uses it
    starts from empty masters."""
    skip_without_binaries()
    nodes = local_servers.start_cluster()
    yield nodes
    nodes.stop()


@pytest.fixture(params=["server", "cluster"])
def any_redis(request):
    """What a storage test runs against: one Redis server, or the session's cluster (emptied).
    Either has `url` (a cluster's says redis+cluster://) and `client()`."""
    if request.param == "server":
        server = RedisServer().start()
        yield server
        server.kill()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield cluster
