"""Servers a benchmark starts for itself on free loopback ports: kvblend's app in a uvicorn thread,
a throwaway redis-server (no persistence) for runs that need the shared tier, and a local Redis
Cluster (three masters, a replica each) for runs on a cluster; the tests start theirs from here too."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import uvicorn
from redis.cluster import RedisCluster

from kvblend.engine.engine import Engine
from kvblend.server.app import ServerConfig, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(engine: Engine, config: ServerConfig) -> Iterator[str]:
    """`create_app` under uvicorn on a free loopback port, in a thread; yields its base URL."""
    app = create_app(engine, config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the kvblend app did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@contextmanager
def redis_server() -> Iterator[str]:
    """A fresh redis-server on a free loopback port, killed afterwards; yields its redis:// URL."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    log = os.environ.get("KVBLEND_REDIS_LOG", "")  # its own log, to learn why it stopped
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--logfile", log], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_answers(proc, port)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def wait_answers(proc: subprocess.Popen, port: int) -> None:
    """Until the redis-server `proc` answers on `port` (5 s at most); an error if it exits first."""
    client = redis.Redis(port=port)
    for _ in range(250):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server on {port} exited with {proc.returncode}") from None
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on {port} did not answer")


NODE_TIMEOUT_MS = 1000  # how long a master may be silent before its replica takes over


def ephemeral_ports() -> range:
    """The kernel's range for outgoing connections' ports: a listener chosen there may be taken by
    a client's connection between the check and the bind."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_node_ports(count: int) -> list[int]:
    """`count` loopback ports, each free for a node and for its cluster bus (the port + 10000),
    none another's bus port, all outside the ephemeral range when it leaves room."""
    ephemeral = ephemeral_ports()
    low, high = (20000, 55000) if ephemeral.start - 10000 <= 20000 + count else (10000, ephemeral.start - 10000)
    taken: set[int] = set()
    ports: list[int] = []
    for _ in range(200 * count):
        if len(ports) == count:
            return ports
        port = random.randrange(low, high)
        if {port, port + 10000} & taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        ports.append(port)
        taken |= {port, port + 10000}
    raise RuntimeError("no free loopback port pairs for a cluster's nodes")


def missing_binaries() -> list[str]:
    """What a local cluster needs and this machine lacks."""
    return [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]


class LocalCluster:
    """A Redis Cluster on loopback: `masters` masters with `replicas` replicas each, created with
    `redis-cli --cluster create`, no persistence; stop() ends every process and removes its files."""

    def __init__(self, masters: int = 3, replicas: int = 1):
        if missing_binaries():
            raise RuntimeError(f"{' and '.join(missing_binaries())} not installed (apt-get install redis-server)")
        self.ports = free_node_ports(masters * (1 + replicas))
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
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--logfile", "redis.log",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
             # A replica that lost its master for a while may still take over: the tests kill masters.
             "--cluster-replica-validity-factor", "0", "--maxmemory-policy", "allkeys-lru",
             # A replica's first sync starts at once, not 5 s later: a master killed early has a copy.
             "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> LocalCluster:
        try:
            for port in self.ports:
                self._start_node(port)
            for port in self.ports:
                wait_answers(self.procs[port], port)
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Until every live node says the cluster is ok, it has `masters` masters and every live
        replica is in sync with its master; past `timeout_s`, an error that says what did not hold."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [p for p in self.ports if self.procs[p].poll() is None]
            try:
                states = [redis.Redis(port=p).cluster("info")["cluster_state"] for p in live]
                masters = self.master_ports()
                links = {p: redis.Redis(port=p).info("replication").get("master_link_status")
                         for p in live if p not in masters}
                if all(s == "ok" for s in states) and len(masters) == self.masters and \
                        all(link == "up" for link in links.values()):
                    return
                seen = f"states {states}, masters {masters}, replica links {links}"
            except redis.RedisError as e:
                seen = f"a node did not answer: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster did not become healthy in {timeout_s:.0f} s: {seen}; "
                                   f"dead nodes {[p for p in self.ports if p not in live]}\n{self.log_tails()}")
            time.sleep(0.05)

    def log_tails(self, lines: int = 5) -> str:
        tails = []
        for port in self.ports:
            log = self.dir / str(port) / "redis.log"
            text = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
            tails.append(f"node {port}:\n" + "\n".join(text))
        return "\n".join(tails)

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
        wait_answers(self.procs[port], port)

    def flush(self) -> None:
        """Empty masters (a test before may have killed one: its replica has taken over by now)."""
        self.wait_healthy()
        for port in self.master_ports():
            redis.Redis(port=port).flushall()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster(attempts: int = 2) -> LocalCluster:
    """A started LocalCluster; one that does not form is stopped and built again on fresh ports,
    and the last attempt's error is raised."""
    for attempt in range(attempts):
        try:
            return LocalCluster().start()
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@contextmanager
def redis_cluster() -> Iterator[str]:
    """A fresh local Redis Cluster, stopped afterwards; yields its redis+cluster:// URL."""
    cluster = start_cluster()
    try:
        yield cluster.url
    finally:
        cluster.stop()
