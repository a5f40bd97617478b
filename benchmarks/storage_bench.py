"""TTFT of `blend` with chunk KV read from each storage tier, with and without layerwise
pipelining, and from a tier throttled to a set bandwidth (with and without the loading
controller). One run, the same prompts for every configuration, interleaved per prompt so that
load on the machine falls on all of them alike.

Each prompt's chunks are precomputed once (untimed) and copied into every tier; disk reads are
cold (the entry files' pages are dropped from the page cache with posix_fadvise before each
request); Redis is a redis-server on loopback that this script starts.

    python benchmarks/storage_bench.py --data ../shared/data/musique_s.dev.json --limit 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import redis
from tqdm import tqdm

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import prompt_ids
from kvblend.model.loader import load_model
from kvblend.store.throttle import Throttled


@contextmanager
def redis_and_scratch(prefix: str):
    """A redis-server on a free loopback port and a scratch folder for one run: (url, folder).
    Both are gone afterwards, however the run ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for _ in range(200):
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}", tmp
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def save_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")


def drop_page_cache(directory: Path) -> None:
    for p in directory.glob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--throttle-mb", type=float, default=100.0, help="throttled tier bandwidth, MB/s")
    ap.add_argument("--skip-full", action="store_true", help="leave out full prefill (slow on a small CPU)")
    ap.add_argument("--out", default="results/storage_bench.json")
    args = ap.parse_args()

    base = load_settings(dtype=args.dtype)
    model = load_model(base.model, base.dtype, base.device)
    records = load_dataset(args.data, limit=args.limit)
    with redis_and_scratch("kvblend-bench-") as (url, tmp):
        def engine(**update) -> Engine:
            return Engine(model, base.model_copy(update=update))

        mem = engine()
        disk = engine(local_cpu=False, local_disk=str(tmp / "disk"))
        remote = engine(local_cpu=False, remote_url=url)
        slow = engine(local_cpu=False, local_disk=str(tmp / "slow"))
        slow_ctl = engine(local_cpu=False, local_disk=str(tmp / "slow"), loading_controller=True)
        for e in (slow, slow_ctl):
            e.store.tiers[0] = Throttled(e.store.tiers[0], args.throttle_mb * 1e6)
        mb = f"{args.throttle_mb:g} MB/s"
        configs = [  # (label, engine, mode, prefetch depth)
            ("full prefill", mem, "full", 0),
            ("memory", mem, "blend", mem.prefetch_depth), ("memory, no pipelining", mem, "blend", 0),
            ("disk", disk, "blend", disk.prefetch_depth), ("disk, no pipelining", disk, "blend", 0),
            ("redis", remote, "blend", remote.prefetch_depth), ("redis, no pipelining", remote, "blend", 0),
            (f"disk at {mb}", slow, "blend", slow.prefetch_depth), (f"disk at {mb}, no pipelining", slow, "blend", 0),
            (f"disk at {mb} + controller", slow_ctl, "blend", slow_ctl.prefetch_depth),
        ]
        if args.skip_full:
            configs = configs[1:]
        params = SamplingParams(max_tokens=1)
        runs: dict[str, list[dict]] = {label: [] for label, *_ in configs}
        tokens, stored_bytes = [], []
        for i, record in enumerate(tqdm(records, desc="prompts")):
            ids = prompt_ids(mem, record)
            mem.precompute(ids)
            entries = {k: mem.store.tiers[0].get(k) for k in mem.store.tiers[0].keys()}
            for e in (disk, remote, slow):
                for key, kv in entries.items():
                    e.store.tiers[0].put(key, kv)
            tokens.append(len(ids))
            plan = mem.plan(ids, "blend")
            stored_bytes.append(sum(c.kv.nbytes for c in plan.chunks if c.kv is not None)
                                / sum(c.span[1] - c.span[0] for c in plan.chunks if c.kv is not None))
            for label, e, mode, depth in configs:
                e.prefetch_depth = depth
                if i == 0:  # warm-up: one-time costs, and the controller's first measurements
                    e.generate(ids, params, mode=mode, store=False)
                for d in (tmp / "disk", tmp / "slow"):
                    drop_page_cache(d)
                m = e.generate(ids, params, mode=mode, store=False).metrics
                runs[label].append({"ttft_s": m.ttft_s, "load_wait_s": m.load_wait_s, "tiers": sorted(set(m.chunk_tiers)),
                                    "recomputed": m.recomputed_tokens, "controller": m.controller})
            for e in (mem, disk, remote, slow):
                for key in entries:
                    e.store.tiers[0].delete(key)

        ref = statistics.mean(r["ttft_s"] for r in runs["memory"])
        rows = []
        for label, *_ in configs:
            rs = runs[label]
            ttft = statistics.mean(r["ttft_s"] for r in rs)
            rows.append({"config": label, "ttft_ms": 1000 * ttft, "vs_memory": ttft / ref,
                         "load_wait_ms": 1000 * statistics.mean(r["load_wait_s"] for r in rs),
                         "recomputed": statistics.mean(r["recomputed"] for r in rs),
                         "tiers": sorted({t for r in rs for t in r["tiers"]})})
        per_token = statistics.mean(stored_bytes)
        meta = {"model": base.model, "dtype": str(model.dtype), "prompts": len(records),
                "mean_tokens": statistics.mean(tokens), "prefetch_depth": base.prefetch_depth,
                "ratio": base.recompute_ratios, "stored_bytes_per_token": per_token,
                "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()}
        print(f"\n{meta['prompts']} prompts, {meta['mean_tokens']:.0f} tokens on average, {meta['dtype']}, "
              f"{per_token / 1e3:.1f} kB stored per chunk token")
        print("| config | TTFT ms | vs memory | waited on loads ms | recomputed rows | chunks from |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['config']} | {r['ttft_ms']:.0f} | {r['vs_memory']:.2f} | {r['load_wait_ms']:.0f} | "
                  f"{r['recomputed']:.0f} | {', '.join(r['tiers'])} |")
        save_json(args.out, {"meta": meta, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
