"""Can causal attention in a long full prefill run at the CPU's matrix-product rate instead of the
flash kernel's? At Qwen2.5-0.5B's shape (14 query heads, 2 KV heads of 64) in bf16: torch's
causal SDPA against the same attention as blocks of bf16 matrix products (a block of query rows
against every key up to it, softmax in fp32), and the softmax's own rate over one block's scores.
Wall-clock medians, all threads:

    python experiments/attention_blocked.py --lengths 1024,4096,8192
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer


def seconds(fn, min_run_time: float) -> float:
    """Median wall-clock seconds of one call (torch.utils.benchmark: warm-up and blocked runs)."""
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())  # its default is 1 thread
    return timer.blocked_autorange(min_run_time=min_run_time).median


def blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """Causal attention of q [H, T, d] over k, v [Hkv, T, d], `block` query rows at a time."""
    H, T, d = q.shape
    Hkv, g = k.shape[0], H // k.shape[0]
    qq, out = q.view(Hkv, g, T, d), torch.empty(Hkv, g, T, d, dtype=q.dtype)
    for s in range(0, T, block):
        e = min(T, s + block)
        scores = torch.bmm(qq[:, :, s:e].reshape(Hkv, g * (e - s), d), k[:, :e].transpose(1, 2))
        scores = scores.view(Hkv, g, e - s, e).float().mul_(d ** -0.5)
        scores[..., s:e].masked_fill_(torch.ones(e - s, e - s, dtype=torch.bool).triu_(1), float("-inf"))
        p = torch.softmax(scores, -1).to(q.dtype)
        out[:, :, s:e] = torch.bmm(p.view(Hkv, g * (e - s), e), v[:, :e]).view(Hkv, g, e - s, d)
    return out.view(H, T, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--min-run-time", type=float, default=2.0, help="seconds each timing runs at least")
    args = ap.parse_args()
    g, H, Hkv, d, dt = torch.Generator().manual_seed(0), 14, 2, 64, torch.bfloat16
    for T in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(H, T, d, generator=g).to(dt)
        k, v = torch.randn(Hkv, T, d, generator=g).to(dt), torch.randn(Hkv, T, d, generator=g).to(dt)
        ref = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        err = (blocked(q, k, v, args.block).float() - ref.float()).abs().max().item()
        flops = 4 * H * d * T * T / 2
        sdpa = seconds(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                           enable_gqa=True), args.min_run_time)
        mm = seconds(lambda: blocked(q, k, v, args.block), args.min_run_time)
        scores = torch.randn(H, args.block, T, generator=g)
        soft = seconds(lambda: torch.softmax(scores, -1), args.min_run_time)
        print(f"{T} tokens: flash kernel {sdpa * 1e3:.0f} ms ({flops / sdpa / 1e12:.3f} TFLOP/s), "
              f"blocked products {mm * 1e3:.0f} ms ({flops / mm / 1e12:.3f}; max difference {err:.3f}); "
              f"softmax {scores.numel() / soft / 1e9:.2f} G scores/s", flush=True)


if __name__ == "__main__":
    main()
