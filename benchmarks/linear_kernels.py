"""One linear layer in each weight format, timed on this CPU: what `weights=auto` is chosen from.

Each format runs its whole layer as the engine does (int8: quantize the rows, the int32 product,
scale back; int4: the 4-bit product), at the shapes of Qwen2.5 0.5B and 1.5B's MLP, for a
prefill's rows and for one decode row. Prints ms and TFLOP/s per format; bf16 is left out where
the CPU has no bf16 products (it runs there, 4-20x slower than fp32).

    python benchmarks/linear_kernels.py --rows 1024,1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvblend.model.allocator import keep_freed_memory
from kvblend.model.loader import cpu_has_fast_bf16
from kvblend.model.weights import Int4Linear, Int8Linear
from blend_phases import cpu_name  # this script's folder is on sys.path

SHAPES = {"0.5B up": (896, 4864), "0.5B down": (4864, 896), "1.5B up": (1536, 8960), "1.5B down": (8960, 1536)}


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def layers(w: torch.Tensor, bf16: bool) -> dict:
    out = {"fp32": (torch.nn.functional.linear, w, torch.float32),
           "int8 (fp32 activations)": (Int8Linear(w, None, torch.float32), None, torch.float32)}
    if bf16:
        out["bf16"] = (torch.nn.functional.linear, w.bfloat16(), torch.bfloat16)
        out["int8 (bf16 activations)"] = (Int8Linear(w, None, torch.bfloat16), None, torch.bfloat16)
        out["int4 (bf16 activations)"] = (Int4Linear(w, None, torch.bfloat16), None, torch.bfloat16)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1024,1", help="comma-separated row counts (prefill rows, decode rows)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/linear_kernels.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    bf16 = cpu_has_fast_bf16()
    rows = []
    print(cpu_name())
    print("| shape (in, out) | rows | format | ms | TFLOP/s |\n| --- | ---: | --- | ---: | ---: |")
    for name in args.shapes.split(","):
        n_in, n_out = SHAPES[name]
        w = torch.randn(n_out, n_in) * 0.02
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, n_in)
            for fmt, (fn, weight, dtype) in layers(w, bf16).items():
                xd = x.to(dtype)
                call = (lambda: fn(xd, weight)) if weight is not None else (lambda: fn(xd))
                ms = best_ms(call, args.repeats)
                tflops = 2 * n * n_in * n_out / ms / 1e9
                rows.append(dict(shape=name, rows=n, format=fmt, ms=ms, tflops=tflops))
                print(f"| {name} ({n_in}, {n_out}) | {n} | {fmt} | {ms:.2f} | {tflops:.3f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(cpu=cpu_name(), threads=args.threads, rows=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
