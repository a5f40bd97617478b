"""Layer-read bandwidth of each tier, checksums included: what the loading controller measures
and what pipelining has to hide. One entry the size of a 6k-token chunk set of the default
model (30 layers, 3 KV heads of 64, fp32 by default), written once per tier, then read layer by
layer: disk cold (pages dropped with posix_fadvise) and warm, Redis on loopback, int8 too.

    python benchmarks/tier_bandwidth.py --tokens 6000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from storage_bench import drop_page_cache, redis_and_scratch, save_json

from kvblend.store.chunk_kv import ChunkKV
from kvblend.store.disk import DiskTier
from kvblend.store.entry_format import EntrySpec, dtype_name
from kvblend.store.int8 import quantize
from kvblend.store.redis_tier import RedisTier


def read_all(tier, key: str) -> float:
    entry = tier.get(key)
    t0 = time.perf_counter()
    for layer in range(entry.n_layers):
        entry.layer(layer)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/tier_bandwidth.json")
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    shape = (args.layers, args.heads, args.tokens, args.head_dim)
    kv = ChunkKV(torch.randn(shape).to(dt), torch.randn(shape).to(dt), torch.arange(args.tokens))
    spec = EntrySpec("bench", dtype_name(dt), args.layers, args.heads, args.head_dim)
    rows = []
    with redis_and_scratch("kvblend-bw-") as (url, tmp):
        for label, value in ((args.dtype, kv), ("int8", quantize(kv))):
            disk = DiskTier(tmp / label, 1 << 40, spec)
            remote = RedisTier(url, 1 << 40, spec, prefix=f"bw-{label}:")
            for tier in (disk, remote):
                t0 = time.perf_counter()
                tier.put("chunk-bench", value)
                write_s = time.perf_counter() - t0
                cases = [("disk cold", True), ("disk warm", False)] if tier is disk else [("redis", False)]
                for name, cold in cases:
                    times = []
                    for _ in range(args.repeats):
                        if cold:
                            drop_page_cache(tmp / label)
                        times.append(read_all(tier, "chunk-bench"))
                    nbytes = tier.get("chunk-bench").meta.layer_nbytes * args.layers
                    rows.append({"stored": label, "tier": name, "MB": nbytes / 1e6, "read_s": min(times),
                                 "read_MB_s": nbytes / 1e6 / min(times), "write_s": write_s})
        print(f"{args.tokens} tokens x {args.layers} layers, {args.heads} KV heads of {args.head_dim}")
        print("| stored as | tier | MB | read (best of %d) | MB/s | write |" % args.repeats)
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['stored']} | {r['tier']} | {r['MB']:.0f} | {r['read_s'] * 1000:.0f} ms | "
                  f"{r['read_MB_s']:.0f} | {r['write_s'] * 1000:.0f} ms |")
        save_json(args.out, {"args": vars(args), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
