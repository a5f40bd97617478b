"""Peak resident memory of a kvblend process that holds a model and serves one long RAG prompt.

Run it as its own process per model and dtype (the peak is this process's high-water mark, from
getrusage): it loads the model, stores the prompt's chunks, then serves it through the engine loop
(one token) in full and in blend, and prints the peak after each step, the resident memory then,
and the bytes one stored chunk token takes.

    python benchmarks/peak_rss.py --model qwen2.5-coder-0.5b-instruct --length 8192
    python benchmarks/peak_rss.py --model qwen2.5-coder-0.5b-instruct --length 6144 --full-only
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

import torch

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.engine.sampler import SamplingParams
from kvblend.engine.scheduler import generate
from kvblend.eval.datasets import load_dataset
from kvblend.model.loader import DEFAULT_MODEL
from long_prompts import prompt_of_length  # this script's folder is on sys.path


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def rss_mib() -> float:
    """Resident memory now (Linux): loading peaks above what holding the model takes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto", help="weight format: auto, fp32, bf16, int8, int4")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full-only", action="store_true",
                    help="a process that only answers the prompt in full: nothing stored, no blend")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = {"model": args.model, "length": args.length, "start_peak_mib": peak_mib()}
    settings = load_settings(model=args.model, dtype=args.dtype, weights=args.weights)
    engine = Engine.from_settings(settings)
    out["dtype"] = str(engine.model.dtype).removeprefix("torch.")
    out["weights"] = engine.model.weights
    out["loaded_peak_mib"], out["loaded_rss_mib"] = peak_mib(), rss_mib()
    ids = prompt_of_length(engine.tokenizer, engine.sep_ids, load_dataset(args.data, limit=20), args.length)
    if not args.full_only:
        engine.precompute(ids)
        out["stored_peak_mib"], out["stored_rss_mib"] = peak_mib(), rss_mib()
        r = engine.runner
        out["stored_bytes_per_token"] = 2 * r.n_layers * r.n_kv_heads * r.head_dim * r.kv_dtype.itemsize
    # As served: the engine loop, a long full prefill in pieces.
    for mode in ("full",) if args.full_only else ("full", "blend"):
        generate(engine, ids, SamplingParams(max_tokens=1), mode, store=False)
        out[f"after_{mode}_peak_mib"], out[f"after_{mode}_rss_mib"] = peak_mib(), rss_mib()
    out["tokens"] = len(ids)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
