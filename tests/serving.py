"""A live kvblend server on a loopback port, for tests that talk to it over real HTTP.

The model is a tiny random Llama with the default model's tokenizer (its chat template and
separator ids are real; its answers are noise, but deterministic noise, which is what tests of
the server need)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import httpx
import uvicorn
from redis_server import free_port
from tiny_models import tiny_model
from warm_python import WarmProcess

from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.model.loader import DEFAULT_MODEL, _gguf_as_folder, resolve_model_path, weights_identity
from kvblend.server.app import ServerConfig, create_app

MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 120


@lru_cache(maxsize=1)
def default_tokenizer():
    from transformers import AutoTokenizer

    path = resolve_model_path(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(_gguf_as_folder(path, weights_identity(path)))


def tiny_engine(**settings) -> Engine:
    tok = default_tokenizer()
    loaded = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=1024)
    loaded.tokenizer = tok
    # No minimum recompute budget: these few-hundred-token prompts test reuse, and the floor would
    # recompute every reused token of them; the ratio alone sets the budget, as on long prompts.
    # No loading controller: on a tiny model its choices would follow timings.
    return Engine(loaded, Settings(**{"dtype": "float32", "device": "cpu", "min_recompute_tokens": 0,
                                      "loading_controller": False, **settings}))


@contextmanager
def live_server(engine: Engine | None = None, **config):
    """Start uvicorn on a free loopback port in a thread; yields (base_url, app)."""
    app = create_app(engine or tiny_engine(), ServerConfig(model_name=MODEL_NAME, **config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def serve_process(warm_python, folder, *args: str) -> tuple[WarmProcess, str]:
    """`kvblend serve` as a user runs it (`python -m kvblend.cli serve`, in a fork of the warm python),
    a process of its own on a free loopback port: (process, base url)."""
    port = free_port()
    cmd = ["-m", "kvblend.cli", "serve", "--model", str(folder), "--dtype", "float32",
           "--device", "cpu", "--port", str(port), "--served-model-name", "tiny", *args]
    proc = warm_python.start(cmd, Path.cwd(), {**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: WarmProcess, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"kvblend serve at {url} did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def stop(proc: WarmProcess) -> None:
    """Ctrl-C, as a user stops it; killed if it has not exited in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
