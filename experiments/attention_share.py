"""Where a full prefill's time goes on this CPU: the runner at 4k tokens timed with and without its
attention calls, and the matmul throughput of bf16 and fp32 (why 5x over transformers' fp32 is out
of reach without AMX; docs/experiments.md#kernels-and-throughput-probes).

    python experiments/attention_share.py --length 4096
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvblend.model.runner as runner_module
from kvblend.model.loader import load_model
from kvblend.model.runner import Runner


def matmul_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2, help="timed prefills each way (the fastest counts)")
    args = ap.parse_args()
    loaded = load_model(args.model)
    runner, n = Runner(loaded), args.length
    ids = torch.randint(0, loaded.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

    def prefill_seconds(n: int = n) -> float:
        cache = runner.new_cache(n)
        start = time.perf_counter()
        runner.forward(ids[:n], torch.arange(n), cache)
        return time.perf_counter() - start

    with torch.inference_mode():
        prefill_seconds(min(n, 512))  # warm-up: the kernels, not the timings
        full = min(prefill_seconds() for _ in range(args.repeats))
        real = F.scaled_dot_product_attention
        runner_module.F.scaled_dot_product_attention = lambda q, k, v, **kw: torch.zeros_like(q)
        try:
            without = min(prefill_seconds() for _ in range(args.repeats))
        finally:
            runner_module.F.scaled_dot_product_attention = real
    cfg = loaded.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Causal attention: QK^T and PV over half the n x n square, 2 flops a multiply-add.
    attn_tflop = cfg.num_hidden_layers * cfg.num_attention_heads * 2 * n * n * head_dim / 1e12
    attn = full - without
    print(f"{n} tokens ({loaded.dtype}): prefill {full:.2f} s, without attention {without:.2f} s, "
          f"attention {attn:.2f} s ({attn / full:.0%}), {attn_tflop:.2f} TFLOP at {attn_tflop / attn:.2f} TFLOP/s")
    for dtype in (torch.bfloat16, torch.float32):
        print(f"matmul 2048^3 {str(dtype).removeprefix('torch.')}: {matmul_tflops(dtype):.2f} TFLOP/s")


if __name__ == "__main__":
    main()
