"""What bounding a Redis Cluster tier costs, kept by kvblend or left to the servers, and what
pipelining a prompt's reads saves: the measurement behind docs/storage.md#redis-cluster.

On a local cluster (three masters, a replica each) and on one redis-server, it writes `--entries`
chunk entries of SmolLM2's shape from `--writers` threads, then reads prompts of `--chunks` of them
(every header, then every layer) from `--readers` threads, and counts the commands each master
served (INFO commandstats). Capacities:

- server: the masters' maxmemory bounds each shard (what kvblend does on a cluster);
- kept: kvblend's own LRU accounting (a sorted set, a hash of sizes, a counter) as on one server,
  its keys under one hash tag so its transactions run at all, so on one shard;
- one server: kvblend's own accounting on a single redis-server (the default there).

Reads are timed with each layer pipelined over the prompt's chunks (as the loader reads them) and
one HGET per chunk and layer (as before).

    python benchmarks/redis_cluster_bench.py --entries 96 --chunks 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import redis
import torch

from kvblend.store.chunk_kv import ChunkKV
from kvblend.store.entry_format import EntrySpec
from kvblend.store.half import halve
from kvblend.store.redis_capacity import KeptCapacity
from kvblend.store.redis_tier import RedisTier
from local_servers import redis_server, start_cluster  # this script's folder is on sys.path

SPEC = EntrySpec("bench", "float32", 30, 3, 64)  # SmolLM2-135M's KV shape, stored in bf16 (kv_half)


class OneShardKept(KeptCapacity):
    """kvblend's accounting on a cluster: its keys must share a slot, and an entry's removal and its
    accounting can no longer be one transaction (the entry lives elsewhere)."""

    def stage(self, pipe, key: str, size: int) -> int:
        return 0  # not in the entry's transaction: another slot

    def settle(self, c, key: str, size: int, staged: list) -> int:
        p = c.pipeline(transaction=True)
        super().stage(p, key, size)
        return super().settle(c, key, size, p.execute())

    def remove(self, c, key: str) -> bool:
        gone = bool(c.delete(self.entry_key(key)))
        p = c.pipeline(transaction=True)
        p.zrem(self.lru, key)
        p.hget(self.sizes, key)
        p.hdel(self.sizes, key)
        _, size, had = p.execute()
        if had and size is not None:
            c.decrby(self.used, int(size))
        return gone


def entry(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.n_layers, SPEC.n_kv_heads, tokens, SPEC.head_dim)
    return halve(ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(tokens)))


def commands(nodes: list[redis.Redis]) -> list[int]:
    return [sum(v["calls"] for k, v in n.info("commandstats").items()) for n in nodes]


def measure(tier: RedisTier, nodes: list[redis.Redis], args, values: dict) -> dict:
    """Writes per second and the busiest master's share of their commands; a prompt's read time,
    pipelined and per chunk, and the busiest master's share of the reads' commands."""
    before = commands(nodes)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.writers) as pool:
        assert all(pool.map(lambda kv: tier.put(*kv), values.items()))
    out = {"write_entries_s": len(values) / (time.perf_counter() - t0)}
    calls = [a - b for a, b in zip(commands(nodes), before)]
    out["write_busiest_share"], out["write_commands"] = max(calls) / sum(calls), sum(calls) / len(values)
    keys = list(values)

    def prompt(i: int, pipelined: bool) -> float:
        chosen = [keys[(i * 7 + j) % len(keys)] for j in range(args.chunks)]
        t = time.perf_counter()
        tier.prefetch(chosen)
        entries = [tier.get(k) for k in chosen]
        for layer in range(SPEC.n_layers):
            if pipelined:
                for e in entries:
                    e.prefetch(layer)
            for e in entries:
                e.parts(layer)
        return time.perf_counter() - t

    before = commands(nodes)
    for pipelined in (True, False):
        prompt(0, pipelined)  # connections made, pages touched: not timed
        with ThreadPoolExecutor(args.readers) as pool:
            times = list(pool.map(lambda i, p=pipelined: prompt(i, p), range(args.prompts)))
        out["prompt_ms_pipelined" if pipelined else "prompt_ms_per_chunk"] = 1000 * statistics.median(times)
    calls = [a - b for a, b in zip(commands(nodes), before)]
    out["read_busiest_share"] = max(calls) / sum(calls)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=32, help="tokens an entry holds")
    ap.add_argument("--chunks", type=int, default=20, help="chunks a prompt reads")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--readers", type=int, default=2)
    args = ap.parse_args(argv)

    values = {f"chunk-{i:04d}": entry(args.tokens, i) for i in range(args.entries)}
    rows = {}
    cluster = start_cluster()
    try:
        masters = [redis.Redis(port=p) for p in cluster.master_ports()]
        for name in ("server", "kept"):
            for m in masters:
                m.flushall()
            tier = RedisTier(cluster.url, 1 << 40, SPEC)
            if name == "kept":
                tier.capacity = OneShardKept("kvblend:{capacity}:", tier.capacity_bytes, tier.entry_key)
            rows[f"cluster, capacity {name}"] = measure(tier, masters, args, values)
            tier.client.close()
    finally:
        cluster.stop()
    with redis_server() as url:
        tier = RedisTier(url, 1 << 40, SPEC)
        rows["one server, capacity kept"] = measure(tier, [tier.client], args, values)

    mb = next(iter(values.values())).nbytes / 1e6
    print(f"\n{args.entries} entries of {args.tokens} tokens ({mb:.2f} MB, bf16), prompts of {args.chunks} chunks, "
          f"{args.writers} writers, {args.readers} readers")
    print("| tier, capacity | entries written / s | commands a write | busiest master's share: writes | "
          "reads | prompt read, pipelined ms | HGET per chunk and layer ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['write_entries_s']:.0f} | {r['write_commands']:.1f} | {r['write_busiest_share']:.2f} | "
              f"{r['read_busiest_share']:.2f} | {r['prompt_ms_pipelined']:.0f} | {r['prompt_ms_per_chunk']:.0f} |")

if __name__ == "__main__":
    main()
