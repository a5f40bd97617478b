"""Does an adapter trained on short prompts need a stronger correction on long ones? A stored
chunk's keys drift further from full prefill's the more context stands in front of it in the
prompt, and an adapter trained on prompts of at most 2k tokens learned the correction of chunks
with less in front of them. Its deltas scaled by s (alpha x s) and scored as the trainer scores
its dev prompts: blend served by the engine against the model's own full prefill, records of
each file at full length.

    python experiments/adapter_scale.py --data ../shared/data/hotpotqa_s.dev.json \\
        --data ../shared/data/musique_s.dev.json --data ../shared/data/wikimqa_s.dev.json \\
        --offset 30 --limit 6 --scales 1,1.5,2 \\
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


def scaled(path: str, s: float) -> ChunkAdapter:
    adapter = ChunkAdapter.load(path)
    adapter.alpha *= s  # the deltas' scale is alpha / rank
    return adapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", action="append", default=[], help="repeat; in the order dev prompts were built")
    ap.add_argument("--offset", type=int, default=30, help="keep records 0-29 for reporting")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8000, help="passages beyond it are left out")
    ap.add_argument("--scales", default="1,1.5,2", help="comma-separated; 0 is no adapter")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--save", help="write the adapter at the one scale of --scales here (for kvblend eval) and stop")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    if args.save:
        scaled(args.adapter, float(args.scales)).save(args.save)
        return
    if not args.data:
        ap.error("--data is needed to score (repeat it)")
    engine = make_engine(args.model)
    per_file = [load_dataset(p, limit=args.limit, offset=args.offset) for p in args.data]
    # One call over all records, as `adapter train --dev-data` builds them: the same prompts, so its
    # cached teacher serves.
    prompts = prompt_orders(engine, [r for records in per_file for r in records], args.max_tokens, 0, 1)
    if len(prompts) != sum(map(len, per_file)):
        raise SystemExit("some records do not fit in --max-tokens: raise it")
    engine.index_collection(prompts)
    examples = teach(engine, prompts, 16)
    for s in (float(x) for x in args.scales.split(",")):
        score = dev_score(engine, scaled(args.adapter, s) if s else None, examples)
        kls, at, parts = score["per_prompt"], 0, []
        for path, group in zip(args.data, per_file):
            parts.append(f"{path.rsplit('/', 1)[-1].split('.')[0]} {statistics.mean(kls[at:at + len(group)]):.4f}")
            at += len(group)
        print(f"scale {s:g}: kl {score['kl_answer']:.4f} top1 {score['top1_agree']:.3f} "
              f"median {statistics.median(kls):.4f} | " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
