"""A real Redis Cluster on loopback: three masters with a replica each, started by the tests with
`redis-cli --cluster create` and stopped (every process, every file) however they end."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from redis_server import RedisServer

NODE_TIMEOUT_MS = 1000  # how long a master may be silent before its replica takes over


def free_node_port() -> int:
    """A loopback port free for a node and for its cluster bus (the port + 10000, so below 55536)."""
    for _ in range(200):
        port = random.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port pair for a cluster node")


def require_binaries() -> None:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the Redis Cluster tests need them "
                    "(`make setup` installs redis-server, which brings redis-cli)")


class RedisClusterNodes:
    def __init__(self, masters: int = 3, replicas: int = 1):
        require_binaries()
        self.ports = [free_node_port() for _ in range(masters * (1 + replicas))]
        self.masters, self.replicas = masters, replicas
        self.dir = Path(tempfile.mkdtemp(prefix="kvblend-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """What a user gives kvblend: any one node; the client finds the rest."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _start_node(self, port: int) -> None:
        folder = self.dir / str(port)
        folder.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
             # A replica that lost its master for a while may still take over: the tests kill masters.
             "--cluster-replica-validity-factor", "0", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> RedisClusterNodes:
        try:
            for port in self.ports:
                self._start_node(port)
            for port in self.ports:
                self._wait_answers(port)
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_answers(self, port: int) -> None:
        client = redis.Redis(port=port)
        for _ in range(250):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.procs[port].poll() is not None:
                    raise RuntimeError(f"redis-server on {port} exited with {self.procs[port].returncode}")
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {port} did not answer")

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Until every live node says the cluster is ok and it has `masters` masters."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [p for p in self.ports if self.procs[p].poll() is None]
            try:
                states = [redis.Redis(port=p).cluster("info")["cluster_state"] for p in live]
                if all(s == "ok" for s in states) and len(self.master_ports()) == self.masters:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become healthy")
            time.sleep(0.05)

    def client(self) -> RedisCluster:
        live = next(p for p in self.ports if self.procs[p].poll() is None)
        return RedisCluster(host="127.0.0.1", port=live)

    def master_ports(self) -> list[int]:
        """The live masters' ports, as the live nodes see them."""
        live = [p for p in self.ports if self.procs[p].poll() is None]
        nodes = redis.Redis(port=live[0]).cluster("nodes")
        return sorted(int(addr.split(":")[1].split("@")[0]) for addr, n in nodes.items()
                      if "master" in n["flags"] and "fail" not in n["flags"] and n["connected"]
                      and int(addr.split(":")[1].split("@")[0]) in live)

    def master_of(self, key: str) -> int:
        """The port of the master that holds `key` now."""
        node = self.client().get_node_from_key(key)
        return int(node.port)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, port: int) -> None:
        """A killed node back (it rejoins as a replica of whoever took over its slots)."""
        self._start_node(port)
        self._wait_answers(port)

    def flush(self) -> None:
        """Empty masters (a test before may have killed one: its replica has taken over by now)."""
        self.wait_healthy()
        for port in self.master_ports():
            redis.Redis(port=port).flushall()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster():
    """One cluster for the session (starting one takes a few seconds); each test that uses it
    starts from empty masters."""
    nodes = RedisClusterNodes().start()
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
