"""`vllm serve` under a concurrent RAG load, with kvblend's connector and without: requests per
second and time to first token (p50, p99), from the official openai client. Run it in the vLLM
venv (.venv-vllm).

Each request is a streamed chat of one dataset record: its passages as documents, its question
(kvblend.vllm.rag_messages). The records' chunks are stored ahead, untimed, by kvblend's engine into
the disk tier the connector reads (a RAG server's steady state), and each server answers one
untimed pass of the load before the timed one. vLLM's prefix cache is off in both servers.

    .venv-vllm/bin/python benchmarks/vllm_serve_bench.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/musique_s.dev.json --requests 16 --concurrency 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Both servers on every core (vllm_bench.py says why).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")

from kvblend.config import load_settings  # noqa: E402
from kvblend.engine.engine import Engine  # noqa: E402
from kvblend.eval.datasets import load_dataset  # noqa: E402
from kvblend.vllm import rag_messages, rag_prompt_text  # noqa: E402
from blend_phases import cpu_name  # noqa: E402 - this script's folder is on sys.path
from vllm_bench import SEPARATORS  # noqa: E402
from vllm_server import vllm_serve  # noqa: E402


def question(record) -> str:
    """The user turn after the documents, as `kvblend eval` asks it."""
    return record.task.instruction + (f"\nQuestion: {record.question}" if record.question else "")


def one_request(url: str, messages: list[dict], max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) seconds of one streamed chat."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model="model", messages=messages, stream=True, temperature=0,
                                            max_tokens=max_tokens)
    for part in stream:
        if first is None and part.choices and part.choices[0].delta.content:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (first if first is not None else total), total


def load(url: str, requests: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        timings = list(pool.map(lambda m: one_request(url, m, max_tokens), requests))
    wall = time.perf_counter() - t0
    ttft = sorted(t for t, _ in timings)
    return dict(requests=len(requests), wall_s=wall, requests_per_s=len(requests) / wall,
                ttft_p50_s=statistics.median(ttft), ttft_p99_s=percentile(ttft, 0.99), ttft_s=ttft)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (as numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=Path("results/vllm_serve_bench.json"))
    args = ap.parse_args(argv)

    store = tempfile.mkdtemp(prefix="kvblend-vllm-serve-")
    from kvblend.model.loader import hf_folder

    folder = hf_folder(args.model)
    from transformers import AutoConfig

    separator = SEPARATORS.get(AutoConfig.from_pretrained(folder).model_type, load_settings().separator)
    engine = Engine.from_settings(load_settings(model=args.model, dtype=args.dtype, separator=separator,
                                                local_disk=store), progress=False)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    records = load_dataset(args.data, limit=args.requests)
    requests = [rag_messages(question(r), r.passages, separator, r.task.system) for r in records]
    for r in records:  # the chunks stored ahead, keyed by the ids vLLM makes of the chat
        text = rag_prompt_text(engine.tokenizer, question(r), r.passages, separator, r.task.system)
        engine.precompute(engine.tokenizer.encode(text, add_special_tokens=False))
    engine.close()
    del engine
    connector = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"model": args.model, "separator": separator, "local_disk": store}}
    report = dict(model=args.model, dtype=dtype, cpu=cpu_name(), data=args.data, concurrency=args.concurrency,
                  max_tokens=args.max_tokens, runs={},
                  command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]))
    for name, config in (("vllm", None), ("vllm+kvblend", connector)):
        log = args.out.with_suffix(f".{name.replace('+', '-')}.log")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with vllm_serve(folder, log, config, dtype=dtype, served_name="model") as url:
            load(url, requests, args.concurrency, args.max_tokens)  # untimed: warm-up, the connector's first reads
            report["runs"][name] = run = load(url, requests, args.concurrency, args.max_tokens)
        print(f"{name}: {run['requests_per_s']:.3f} requests/s, TTFT p50 {run['ttft_p50_s']:.2f}s "
              f"p99 {run['ttft_p99_s']:.2f}s", flush=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
    # The report is written. Leave without running interpreter teardown: vLLM's CPU build can
    # abort there ("terminate called without an active exception") while its engines' threads end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
