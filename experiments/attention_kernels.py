"""What attention costs per (query row, key, head) on this CPU, and what the probe's fused
attention-with-mass saves, on random tensors of the default model's shape (9 query heads, 3 KV
heads of 64) over a MuSiQue-length prompt, with the KV warm in cache and read cold as a request's
layers are. CPU seconds, best of repeats:

    OMP_NUM_THREADS=1 python experiments/attention_kernels.py --keys 6300 --rows 100
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvblend.blend.select import attend_with_mass, attention_mass
from kvblend.model.runner import attend, biased_groups, query_groups


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=6300)
    ap.add_argument("--rows", type=int, default=100, help="watched rows at the end of the prompt (the question)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30, help="distinct KV sets for the cold-cache case (a request's layers)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    H, Hkv, d, T, n = 9, 3, 64, args.keys, args.rows
    k, v = torch.randn(Hkv, T, d, generator=g), torch.randn(Hkv, T, d, generator=g)
    q = torch.randn(H, n, d, generator=g)
    pos = torch.arange(T - n, T)
    bias = torch.zeros(T)
    bias[: T - n] = -1.0  # stale chunk keys, damped
    groups = biased_groups(query_groups(pos, T), bias)
    two = best(lambda: (attend(q, k, v, groups, 0.125), attention_mass(q, k, pos, 0.125, None, bias)), args.repeats)
    fused = best(lambda: attend_with_mass(q, k, v, pos, 0.125, None, bias), args.repeats)
    sdpa = best(lambda: attend(q, k, v, groups, 0.125), args.repeats)
    print(f"{n} rows x {T} keys, one layer: SDPA + attention_mass {two * 1e3:.1f} ms, "
          f"attend_with_mass {fused * 1e3:.1f} ms, SDPA alone {sdpa * 1e3:.1f} ms")
    qf = torch.randn(1, H, T, d, generator=g)
    causal = best(lambda: F.scaled_dot_product_attention(qf, k[None], v[None], is_causal=True, enable_gqa=True), 2)
    per_pair = lambda s, pairs: s / (pairs * H) * 1e9  # noqa: E731
    # A request reads each layer's KV once, from memory, not from a warm cache: the same call over
    # a distinct KV per layer.
    kvs = [(torch.randn(Hkv, T, d, generator=g), torch.randn(Hkv, T, d, generator=g)) for _ in range(args.layers)]
    cold = best(lambda: [attend(q, kl, vl, groups, 0.125) for kl, vl in kvs], 2) / args.layers
    print(f"ns per (row, key, head): causal prefill {per_pair(causal, T * T / 2):.2f}, "
          f"the {n} rows over every key {per_pair(sdpa, n * T):.2f} (one warm KV), "
          f"{per_pair(cold, n * T):.2f} ({args.layers} layers' KV, each read once)")


if __name__ == "__main__":
    main()
