"""What loading a prompt's stored chunk KV costs, the loader alone: every layer of one prompt's
plan (re-rotation of K, copies of V) into a cache that earlier requests already touched, and into
a fresh one as each request gets, against one copy of the same bytes. Wall clock, medians:

    python benchmarks/chunk_loading.py --data ../shared/data/musique_s.dev.json --offset 0 --dtype float32
    THP_MEM_ALLOC_ENABLE=0 python benchmarks/chunk_loading.py ...   # without huge pages

(kvblend asks torch for transparent huge pages unless THP_MEM_ALLOC_ENABLE is set: see kvblend/__init__.py.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from kvblend.blend.loader import ChunkLoader
from kvblend.eval.harness import prompt_ids
from blend_phases import cpu_name  # this script's folder is on sys.path
from kvblend.eval.dev_records import add_record_flags, open_records
def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(ap, limit=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    engine, records = open_records(args)
    ids = prompt_ids(engine, records[0])
    engine.precompute(ids)
    plan = engine.plan(ids, "reuse")
    runner, n = engine.runner, plan.n_tokens

    def load(cache) -> None:
        cache.length = n
        loader = ChunkLoader(runner, plan, cache)  # inline: the reading thread would only add noise
        loader.start(range(runner.n_layers))
        for layer in range(runner.n_layers):
            loader.load_layer(layer)

    touched = runner.new_cache(n)
    warm = median_s(lambda: load(touched), args.repeats)
    fresh = median_s(lambda: load(runner.new_cache(n)), args.repeats)
    src = torch.empty_like(touched.k[:, :, :n])
    dst = torch.empty_like(src)
    copy = median_s(lambda: (dst.copy_(src), dst.copy_(src)), args.repeats)  # K and V
    mb = 2 * src.numel() * src.element_size() / 1e6
    print(f"{cpu_name()}; {touched.k.dtype}; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}; "
          f"{n} tokens, {plan.hits} stored chunks, {mb:.0f} MB of KV")
    print(f"loader, into a touched cache: {warm * 1e3:.0f} ms; into a fresh cache: {fresh * 1e3:.0f} ms; "
          f"one copy of the bytes: {copy * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
