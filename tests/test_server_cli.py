"""`kvblend serve` as a user runs it: a subprocess on a loopback port, a model folder, an API key."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from serving import default_tokenizer
from tiny_models import tiny_hf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvblend_serve_runs_a_model_folder(tmp_path):
    tok = default_tokenizer()
    folder = tmp_path / "tiny-llama"
    tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024).save_pretrained(folder)
    tok.save_pretrained(folder)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvblend.cli", "serve", "--model", str(folder), "--dtype", "float32",
                             "--port", str(port), "--api-key", "sk-1", "--served-model-name", "tiny"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "kvblend serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sk-1"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
