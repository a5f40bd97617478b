"""What one training prompt costs: the student's forward and backward (kl_answer against the
model's own full prefill, blend as served, the adapter on the chunks) on one record with all its
passages, its seconds and the process's peak memory. Run once per setting: peak memory is per
process.

    python experiments/adapter_step_cost.py --data ../shared/data/musique_s.dev.json --record 40 --low-memory \\
        --adapter experiments/adapters/qwen2.5-coder-0.5b-instruct-r4-multihop-orders3-step24.safetensors
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch
from soft_tokens import make_engine

from kvblend.cli_adapter import prompt_orders
from kvblend.eval.datasets import load_dataset
from kvblend.model.adapter import ChunkAdapter
from kvblend.train.data import teach
from kvblend.train.trainer import grad_chunks, student_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--record", type=int, default=40, help="the record (keep 0-29 for reporting)")
    ap.add_argument("--low-memory", action="store_true", help="recompute chunk activations in the backward")
    ap.add_argument("--grad-chunks", type=int, default=0, help="chunks the gradient reaches (0: all)")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    engine = make_engine(args.model)
    prompts = prompt_orders(engine, load_dataset(args.data, limit=1, offset=args.record), 10**9, 0, 1)
    engine.index_collection(prompts)
    ex = teach(engine, prompts, 16, progress=False)[0]
    adapter = ChunkAdapter.load(args.adapter)
    t0 = time.perf_counter()
    with torch.enable_grad():
        grad = grad_chunks(engine, ex, args.grad_chunks, random.Random(0))
        loss = student_loss(engine, adapter, ex, low_memory=args.low_memory, grad=grad)
        t1 = time.perf_counter()
        loss.backward()
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    print(f"{len(ex.ids)} tokens, low memory {args.low_memory}, gradient to {args.grad_chunks or 'all'} chunks: "
          f"forward {t1 - t0:.1f} s, backward {t2 - t1:.1f} s, "
          f"peak RSS {peak:.1f} GB")


if __name__ == "__main__":
    main()
