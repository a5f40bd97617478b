"""Chunks precomputed after their k most similar chunks of the collection, for each k of --counts.

`neighbour_count` k: each chunk of the indexed collection (every record of --data, as `kvblend
eval` indexes it) is precomputed after its k nearest chunks, the nearest last. Each k gets its own
index over the same chunks, so keys never mix; scored teacher-forced against full prefill's greedy
answer, reuse and blend at each ratio, and at each stale-key scale of --scales (a longer context
leaves the stored KV less stale, so it may want less damping).

    python experiments/neighbour_count.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 48 --limit 12 --counts 1,3 --ratios 0.08 --scales 0.7,1
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from tqdm import tqdm

from kvblend.blend.neighbours import NeighbourIndex
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

from kvblend.eval.dev_records import add_record_flags, open_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=12)
    ap.add_argument("--counts", default="1,3", help="neighbour counts, comma-separated")
    ap.add_argument("--ratios", default="0.08", help="blend recompute ratios; reuse is always scored")
    ap.add_argument("--scales", default=None, help="stale-key scales, comma-separated (default: the model's own)")
    args = ap.parse_args()
    engine, records = open_records(args)
    prompts = [prompt_ids(engine, r) for r in load_dataset(args.data)]
    collection = [ids[a:b] for ids in prompts for a, b in engine.segments(ids).chunks]
    indexes = {}
    for k in [int(x) for x in args.counts.split(",")]:
        indexes[k] = NeighbourIndex()
        indexes[k].add(collection, count=k)
    ratios = [0.0] + [float(x) for x in args.ratios.split(",")]
    scales = [float(x) for x in args.scales.split(",")] if args.scales else [None]
    scores: dict[tuple[int, float | None, float], list] = {}
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        _, answer, ref = full_reference(engine, ids)
        for k, index in indexes.items():
            engine.use_neighbours(index)
            engine.precompute(ids)
            for s in scales:
                for r in ratios:
                    cfg = replace(engine.blend_cfg, **({"ratios": [r]} if r else {}),
                                  **({"stale_key_scale": s} if s is not None else {}))
                    logits, _ = forced_logits(engine, ids, "blend" if r else "reuse", cfg, answer)
                    top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                    scores.setdefault((k, s, r), []).append((float(kl_divergence(ref, logits).mean()), top1))
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}")
    print("| neighbours | stale-key scale | mode | kl_answer | top1_agree | per record kl |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for (k, s, r), got in scores.items():
        print(f"| {k} | {'default' if s is None else f'{s:g}'} | {f'blend {r:g}' if r else 'reuse'} "
              f"| {statistics.mean(x[0] for x in got):.4f} | {statistics.mean(x[1] for x in got):.3f} "
              f"| {' '.join(f'{x[0]:.3f}' for x in got)} |")
    engine.close()


if __name__ == "__main__":
    main()
