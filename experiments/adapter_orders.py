"""Does a chunk adapter's gain hold with the passages in another order? Records of a file (the whole
file indexed as the collection, as `kvblend eval` does) with their passages shuffled, blend at the
default ratio scored in the student (kvblend/train/student.py, the served path written out of place)
with and without the adapter, against the model's own full prefill of the same prompts.

    python experiments/adapter_orders.py --data ../shared/data/hotpotqa_s.dev.json --limit 30 --seed 5 \\
        --adapter experiments/adapters/qwen2.5-coder-0.5b-instruct-r4-multihop-step12.safetensors
"""

from __future__ import annotations

import argparse
import statistics

import torch
from soft_tokens import make_engine

from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import index_dataset
from kvblend.model.adapter import ChunkAdapter
from kvblend.train.data import build_prompts, teach
from kvblend.train.trainer import student_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--seed", type=int, default=5, help="the passage order")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    engine = make_engine(args.model)
    records = load_dataset(args.data)
    index_dataset(engine, records)
    # Records with a single passage have no chunk to reuse and are left out.
    examples = teach(engine, build_prompts(engine, records[:args.limit], 10**9, seed=args.seed), 16)
    scores = {}
    with torch.no_grad():
        for name, adapter in (("none", None), ("adapter", ChunkAdapter.load(args.adapter))):
            scores[name] = [float(student_loss(engine, adapter, ex)) for ex in examples]
            print(f"{name}: kl {statistics.mean(scores[name]):.4f} median {statistics.median(scores[name]):.4f}",
                  flush=True)
    none, with_adapter = scores["none"], scores["adapter"]
    print(f"{len(examples)} prompts: better {sum(b < a for a, b in zip(none, with_adapter))}, "
          f"worse {sum(b > a for a, b in zip(none, with_adapter))}")
    print("none   ", [round(x, 3) for x in none])
    print("adapter", [round(x, 3) for x in with_adapter])


if __name__ == "__main__":
    main()
