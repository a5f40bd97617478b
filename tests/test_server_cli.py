"""`kvblend serve` as a user runs it: a subprocess on a loopback port, a model folder, an API key."""

import httpx
from serving import default_tokenizer, serve_process, stop, wait_healthy
from tiny_models import tiny_hf


def test_kvblend_serve_runs_a_model_folder(tmp_path, warm_python):
    tok = default_tokenizer()
    folder = tmp_path / "tiny-llama"
    tiny_hf("llama", vocab_size=len(tok), max_position_embeddings=1024).save_pretrained(folder)
    tok.save_pretrained(folder)
    proc, url = serve_process(warm_python, folder, "--api-key", "sk-1")
    try:
        wait_healthy(proc, url)
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sk-1"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # The page's link form carries the key in the URL: the access log shows the request, not the key.
        assert httpx.get(url + "/?key=sk-1&question=hi").status_code == 200
    finally:
        stop(proc)
    log = proc.stdout.read()
    assert "GET /?key=***&question=hi" in log, log
    assert "sk-1" not in log
