"""Servers a benchmark starts for itself on free loopback ports: kvblend's app in a uvicorn thread,
and a throwaway redis-server (no persistence) for runs that need the shared tier."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import uvicorn

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
        client = redis.Redis(port=port)
        for _ in range(250):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}") from None
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not answer")
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
