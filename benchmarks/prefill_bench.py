"""Full-prefill throughput: the kvblend Runner against transformers' own forward.

For each prompt length, times one full prefill (logits of the last row only) with
  (a) kvblend's layerwise Runner,
  (b) transformers' forward in the same dtype,
  (c) transformers' forward in fp32 (its default dtype),
and prints a markdown table of tokens/s plus the Runner's speed-up over each.

    python benchmarks/prefill_bench.py --lengths 1024,4096,8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.model.loader import DEFAULT_MODEL, load_model
from kvblend.model.runner import Runner

WARMUP_LENGTH = 32


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runner_prefill(runner: Runner):
    def run(ids: torch.Tensor) -> None:
        n = ids.shape[0]
        runner.forward(ids, torch.arange(n), runner.new_cache(n))
    return run


def hf_prefill(loaded):
    def run(ids: torch.Tensor) -> None:
        loaded.hf(input_ids=ids[None].to(loaded.device), logits_to_keep=1)
    return run


def best_seconds(run, ids: torch.Tensor, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        run(ids)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="1024,4096,8192", help="comma-separated prompt lengths")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per length; the best is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's own); use fewer when other work shares the CPU")
    ap.add_argument("--out", type=Path, default=Path("results/prefill_bench.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=args.dtype)
    fp32 = loaded if loaded.dtype == torch.float32 else load_model(args.model, dtype="float32")
    runner = Runner(loaded)
    device = loaded.device
    max_len = loaded.config.max_position_embeddings
    vocab = loaded.config.vocab_size

    lengths = []
    for n in (int(x) for x in args.lengths.split(",") if x.strip()):
        if n > max_len:
            print(f"skipping length {n}: beyond the model's max_position_embeddings ({max_len})")
        else:
            lengths.append(n)

    variants = {"runner": runner_prefill(runner), "hf": hf_prefill(loaded)}
    if fp32 is not loaded:  # when the dtype is fp32 already, transformers' default is the same run
        variants["hf_fp32"] = hf_prefill(fp32)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    with torch.inference_mode():
        warm = torch.randint(0, vocab, (min([WARMUP_LENGTH, *lengths]),), generator=gen)
        for run in variants.values():
            run(warm)
        sync(device)

        bar = tqdm(total=len(lengths) * len(variants), unit="run")
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=gen)
            row = {"length": n}
            for name, run in variants.items():
                bar.set_description(f"{name} @ {n}")
                seconds = best_seconds(run, ids, args.repeats, device)
                row[f"{name}_s"] = seconds
                row[f"{name}_tok_s"] = n / seconds
                bar.update()
                bar.write(f"{name:8s} length {n:6d}: {n / seconds:10.1f} tok/s ({seconds:.3f} s)")
            if "hf_fp32" not in variants:
                row["hf_fp32_s"], row["hf_fp32_tok_s"] = row["hf_s"], row["hf_tok_s"]
            row["speedup_vs_hf"] = row["runner_tok_s"] / row["hf_tok_s"]
            row["speedup_vs_hf_fp32"] = row["runner_tok_s"] / row["hf_fp32_tok_s"]
            rows.append(row)
        bar.close()

    dtype = str(loaded.dtype).removeprefix("torch.")
    print()
    print(f"| length | runner tok/s ({dtype}) | transformers tok/s ({dtype}) | transformers tok/s (fp32) "
          f"| speed-up vs {dtype} | speed-up vs fp32 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']} | {r['runner_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['hf_fp32_tok_s']:.1f} "
              f"| {r['speedup_vs_hf']:.2f}x | {r['speedup_vs_hf_fp32']:.2f}x |")

    import transformers

    report = {
        "model": args.model,
        "fingerprint": loaded.fingerprint,
        "dtype": dtype,
        "device": str(device),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "repeats": args.repeats,
        "seed": args.seed,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
