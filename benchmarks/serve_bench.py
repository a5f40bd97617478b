"""Serving throughput over HTTP: a concurrent RAG workload against `kvblend serve`'s app.

1. RAG load, per mode (full, prefix, blend): questions over a fixed pool of passages, each prompt
   using several of them in random order, sent by `--concurrency` streaming clients. The pool is
   stored once through /v1/chunks first (a RAG server's steady state). Prints requests/s and
   client-side TTFT p50/p99 (first streamed token).
2. Decode: `--streams` streams of `--decode-tokens` tokens each, decoded as one batch
   (max_batch = streams) against one at a time (max_batch = 1). Prints tokens/s.

Numbers depend on the machine and on what else runs on it: compare ratios within one run.

    python benchmarks/serve_bench.py --requests 32 --concurrency 8 --out results/serve_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from local_servers import serve as serve_app  # this script's folder is on sys.path

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.server.app import ServerConfig

MODEL = "bench"


def serve(engine: Engine, max_batch: int):
    return serve_app(engine, ServerConfig(model_name=MODEL, max_batch=max_batch, max_queue=256))


def stream(url: str, body: dict) -> tuple[float, int]:
    """Send one streaming completion; returns (TTFT seconds, tokens received)."""
    t0 = time.perf_counter()
    ttft, n = None, 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            if data["choices"][0]["text"]:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
            if "usage" in data:
                n = data["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), n


def passages_pool(path: str | None, n: int, size: int = 24) -> tuple[list[str], list[str]]:
    if path:
        from kvblend.eval.datasets import load_dataset

        records = load_dataset(path, limit=n)
        pool = list(dict.fromkeys(p for r in records for p in r.passages))
        return pool, [r.question for r in records]
    rng = random.Random(0)
    words = "river bridge town glass salt market guild harbour tower winter archive".split()
    pool = [f"Passage {i}: " + " ".join(rng.choice(words) for _ in range(120)) + "." for i in range(size)]
    return pool, [f"What does passage {i} say about the {rng.choice(words)}?" for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def clear_store(engine: Engine) -> None:
    """Each mode starts cold: no chunk KV and no prefix blocks from the mode before."""
    for tier in engine.store.tiers:
        for key in tier.keys():
            tier.delete(key)


def rag_load(engine: Engine, pool: list[str], questions: list[str], args) -> list[dict]:
    rng = random.Random(1)
    bodies = [{"model": MODEL, "prompt": questions[i % len(questions)], "max_tokens": args.max_tokens,
               "temperature": 0, "documents": rng.sample(pool, args.docs_per_prompt)} for i in range(args.requests)]
    rows = []
    for mode in ("full", "prefix", "blend"):
        clear_store(engine)
        with serve(engine, args.concurrency) as url:
            if mode == "blend":
                for i in range(0, len(pool), 8):
                    httpx.post(url + "/v1/chunks", json={"documents": pool[i:i + 8]}, timeout=600).raise_for_status()
            stream(url, {**bodies[0], "kvblend": {"mode": mode}})  # warm-up
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as ex:
                results = list(ex.map(lambda b: stream(url, {**b, "kvblend": {"mode": mode}}), bodies))
            wall = time.perf_counter() - t0
        ttfts = [t for t, _ in results]
        rows.append({"mode": mode, "requests": len(bodies), "requests_per_s": len(bodies) / wall,
                     "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 0.99)})
        print(f"{mode:7s} {rows[-1]['requests_per_s']:7.2f} req/s   TTFT p50 {rows[-1]['ttft_p50_s'] * 1000:7.0f} ms"
              f"   p99 {rows[-1]['ttft_p99_s'] * 1000:7.0f} ms", flush=True)
    return rows


def decode_load(engine: Engine, args) -> list[dict]:
    bodies = [{"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": args.decode_tokens,
               "temperature": 0, "kvblend": {"mode": "full"}} for i in range(args.streams)]
    rows = []
    for label, batch in (("batched", args.streams), ("one at a time", 1)):
        with serve(engine, batch) as url:
            stream(url, bodies[0])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.streams) as ex:
                tokens = sum(n for _, n in ex.map(lambda b: stream(url, b), bodies))
            wall = time.perf_counter() - t0
        rows.append({"decode": label, "streams": args.streams, "tokens": tokens, "tokens_per_s": tokens / wall})
        print(f"decode {label:14s} {tokens / wall:8.1f} tok/s ({tokens} tokens, {args.streams} streams)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--data", default=None, help="a CacheBlend .json for real passages (default: synthetic)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--docs-per-prompt", type=int, default=4)
    p.add_argument("--passages", type=int, default=24, help="synthetic passages in the pool (without --data)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    settings = load_settings(model=args.model, dtype=args.dtype)
    engine = Engine.from_settings(settings)
    pool, questions = passages_pool(args.data, max(args.requests, 8), args.passages)
    if len(pool) < args.docs_per_prompt:
        p.error(f"--docs-per-prompt {args.docs_per_prompt} needs at least as many passages, not {len(pool)}")
    print(f"model {settings.model} ({engine.model.dtype}), {len(pool)} passages, {args.requests} requests, "
          f"{args.concurrency} clients, {args.docs_per_prompt} passages per prompt", flush=True)
    result = {"rag": rag_load(engine, pool, questions, args), "decode": decode_load(engine, args),
              "args": vars(args)}
    full = result["rag"][0]["requests_per_s"]
    for row in result["rag"][1:]:
        print(f"{row['mode']} / full requests/s: {row['requests_per_s'] / full:.2f}x")
    d = result["decode"]
    print(f"batched / one-at-a-time decode tokens/s: {d[0]['tokens_per_s'] / d[1]['tokens_per_s']:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
