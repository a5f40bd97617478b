"""Chunks precomputed after their k most similar chunks of the collection, for each k of --counts.

`neighbour_count` k: each chunk of the indexed collection (every record of --data, as `kvblend
eval` indexes it) is precomputed after its k nearest chunks, the nearest last. Each k gets its own
index over the same chunks, so keys never mix; scored teacher-forced against full prefill's greedy
answer, reuse and blend at each ratio.

    python experiments/neighbour_count.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 48 --limit 12 --counts 1,3 --ratios 0.08
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvblend.blend.neighbours import NeighbourIndex
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # dev_records
from dev_records import add_record_flags, open_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=12)
    ap.add_argument("--counts", default="1,3", help="neighbour counts, comma-separated")
    ap.add_argument("--ratios", default="0.08", help="blend recompute ratios; reuse is always scored")
    args = ap.parse_args()
    engine, records = open_records(args)
    prompts = [prompt_ids(engine, r) for r in load_dataset(args.data)]
    collection = [ids[a:b] for ids in prompts for a, b in engine.segments(ids).chunks]
    indexes = {}
    for k in [int(x) for x in args.counts.split(",")]:
        indexes[k] = NeighbourIndex()
        indexes[k].add(collection, count=k)
    ratios = [0.0] + [float(x) for x in args.ratios.split(",")]
    scores: dict[tuple[int, float], list] = {}
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        _, answer, ref = full_reference(engine, ids)
        for k, index in indexes.items():
            engine.use_neighbours(index)
            engine.precompute(ids)
            for r in ratios:
                cfg = replace(engine.blend_cfg, **({"ratios": [r]} if r else {}))
                logits, _ = forced_logits(engine, ids, "blend" if r else "reuse", cfg, answer)
                scores.setdefault((k, r), []).append((float(kl_divergence(ref, logits).mean()),
                                                      float((logits.argmax(-1) == ref.argmax(-1)).float().mean())))
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}")
    print("| neighbours | mode | kl_answer | top1_agree | per record kl |\n| --- | --- | --- | --- | --- |")
    for (k, r), s in scores.items():
        print(f"| {k} | {f'blend {r:g}' if r else 'reuse'} | {statistics.mean(x[0] for x in s):.4f} "
              f"| {statistics.mean(x[1] for x in s):.3f} | {' '.join(f'{x[0]:.3f}' for x in s)} |")
    engine.close()


if __name__ == "__main__":
    main()
