"""A real redis-server on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None):
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed: `make setup` installs it (apt-get install redis-server)")
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.kill()
