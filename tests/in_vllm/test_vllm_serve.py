"""vLLM's OpenAI server (`vllm serve`'s) with kvblend's connector, as users run it: the scheduler and the worker in processes
of their own, sharing chunks through the disk tier; the official openai client, a streamed chat whose
prompt holds documents."""

import time

from conftest import SEPARATOR
from openai import OpenAI
from test_connector import documents
from vllm_server import vllm_serve

from kvblend.vllm import rag_messages


def chat(client: OpenAI, docs: list[str], **kvblend) -> str:
    extra = {"kv_transfer_params": {"kvblend": kvblend}} if kvblend else None
    stream = client.chat.completions.create(
        model="smollm2", stream=True, temperature=0, max_tokens=16, extra_body=extra,
        messages=rag_messages("Which hall has the most windows?", docs, SEPARATOR))
    return "".join(part.choices[0].delta.content or "" for part in stream if part.choices)


def test_vllm_serve_streams_a_blended_chat(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")  # the connector's counters, logged each second (10 s by default)
    config = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": {"separator": SEPARATOR, "local_disk": str(tmp_path / "kv")}}
    log = tmp_path / "serve.log"
    docs = documents("quartz")
    with vllm_serve(folder, log, config, dtype="float32", max_model_len=4096, served_name="smollm2") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        assert chat(client, docs)  # computed in the request, its chunks stored after it
        reordered = docs[3:] + docs[:3]
        blended = chat(client, reordered)
        assert blended
        # At ratio 1.0 the worker's KV is full prefill's: the same text as vLLM's own prefill.
        assert chat(client, reordered, ratio=1.0) == chat(client, reordered, mode="full")
        deadline = time.monotonic() + 30  # vLLM logs the connector's counters every few seconds, per interval
        while logged_hits(log) < len(docs) and time.monotonic() < deadline:
            time.sleep(1)
    metrics = [line for line in log.read_text().splitlines() if "KV Transfer metrics" in line]
    assert metrics, "vLLM logged no connector counters"
    assert logged_hits(log) >= len(docs)  # the reordered request read every chunk the first one stored


def logged_hits(log) -> int:
    """Chunk hits summed over the connector counters vLLM has logged so far (one line per interval)."""
    return sum(int(part.split("=")[1]) for line in log.read_text().splitlines() if "KV Transfer metrics" in line
               for part in line.split(", ") if part.startswith("chunk_hits="))
