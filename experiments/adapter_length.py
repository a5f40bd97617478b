"""Does a chunk adapter's gain depend on the prompt's length? Records of a file with their passages
shuffled and cut to --max-tokens (the prompts' chunks indexed as the collection), blend at the
default ratio served by the engine itself (precompute, blend, teacher-forced answer: the trainer's
dev score), with and without the adapter, against the model's own full prefill of the same prompts.

    python experiments/adapter_length.py --data ../shared/data/musique_s.dev.json --limit 30 --max-tokens 2048 \\
        --adapter experiments/adapters/qwen2.5-coder-0.5b-instruct-r4-multihop-orders3-step24.safetensors
"""

from __future__ import annotations

import argparse
import statistics

from soft_tokens import make_engine

from kvblend.cli_adapter import prompt_orders
from kvblend.eval.datasets import load_dataset
from kvblend.model.adapter import ChunkAdapter
from kvblend.train.data import teach
from kvblend.train.trainer import dev_score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=2048, help="passages beyond it are left out")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    engine = make_engine(args.model)
    prompts = prompt_orders(engine, load_dataset(args.data, limit=args.limit), args.max_tokens, 0, 1)
    engine.index_collection(prompts)
    examples = teach(engine, prompts, 16, progress=False)
    print(f"{len(examples)} prompts, {statistics.mean(len(e.ids) for e in examples):.0f} tokens on average")
    for name, adapter in (("none", None), ("adapter", ChunkAdapter.load(args.adapter))):
        s = dev_score(engine, adapter, examples)
        print(f"{name}: kl {s['kl_answer']:.4f} top1 {s['top1_agree']:.3f} "
              f"median {statistics.median(s['per_prompt']):.4f}", flush=True)


if __name__ == "__main__":
    main()
