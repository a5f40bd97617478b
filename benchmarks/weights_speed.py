"""Full prefill and decode in each weight format, in one run: what `weights=auto` is chosen from
where the CPU has no bf16 products and activations are fp32.

Each format loads the model once (dtype `--dtype`), then for each prompt length the formats take
turns, repeat after repeat, so that a noisy machine slows them alike; the best time is kept. A
decode step (one token after a prompt of the first length) is timed the same way. torch's kernel
ISA is printed: to see an AVX2 machine's kernels on a newer CPU, set ATEN_CPU_CAPABILITY=avx2 and
ONEDNN_MAX_CPU_ISA=AVX2 before running (an approximation: caches and memory stay this machine's).

    python benchmarks/weights_speed.py --model qwen2.5-coder-0.5b-instruct \\
        --formats fp32,bf16-fp32 --lengths 1024,4096,8192 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.model.loader import DEFAULT_MODEL, load_model
from kvblend.model.runner import Runner
from blend_phases import cpu_name  # this script's folder is on sys.path


def prefill_seconds(runner: Runner, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    runner.forward(ids, torch.arange(len(ids)), runner.new_cache(len(ids)))
    return time.perf_counter() - start


def decode_seconds(runner: Runner, ids: torch.Tensor, steps: int) -> float:
    """Seconds per decode step after a prefill of ids (the prefill is not timed)."""
    n = len(ids)
    cache = runner.new_cache(n + steps)
    runner.forward(ids, torch.arange(n), cache)
    start = time.perf_counter()
    for i in range(steps):
        runner.forward(ids[-1:], torch.tensor([n + i]), cache)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32", help="activation dtype of every format")
    ap.add_argument("--formats", default="fp32,bf16-fp32")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/weights_speed.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    runners = {f: Runner(load_model(args.model, dtype=args.dtype, weights=f, progress=False)) for f in formats}
    vocab = next(iter(runners.values())).model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (n,), generator=gen) for n in lengths}
    best = {(f, n): float("inf") for f in formats for n in lengths}
    decode = dict.fromkeys(formats, float("inf"))
    with torch.inference_mode():
        for runner in runners.values():  # warm-up: kernels' first calls pick and cache their plans
            prefill_seconds(runner, prompts[lengths[0]][:32])
        bar = tqdm(total=args.repeats * len(formats) * (len(lengths) + 1), unit="run")
        for _ in range(args.repeats):
            for n in lengths:
                for f, runner in runners.items():
                    best[f, n] = min(best[f, n], prefill_seconds(runner, prompts[n]))
                    bar.update()
            for f, runner in runners.items():
                decode[f] = min(decode[f], decode_seconds(runner, prompts[lengths[0]], args.decode_steps))
                bar.update()
        bar.close()
    base = formats[0]
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"\n{args.model}, activations {args.dtype}, {cpu_name()}, torch kernels {isa}")
    print("| format | " + " | ".join(f"prefill {n} (s)" for n in lengths) + f" | decode after {lengths[0]} (ms) |")
    print("| --- |" + " ---: |" * (len(lengths) + 1))
    for f in formats:
        cells = [f"{best[f, n]:.2f} ({best[base, n] / best[f, n]:.2f}x)" for n in lengths]
        print(f"| {f} | " + " | ".join(cells) + f" | {decode[f] * 1e3:.1f} ({decode[base] / decode[f]:.2f}x) |")
    print(f"(x: speed against {base}, measured in this run)")
    report = dict(model=args.model, dtype=args.dtype, cpu=cpu_name(), isa=isa, threads=args.threads,
                  prefill_s={f: {n: best[f, n] for n in lengths} for f in formats}, decode_s=decode)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
