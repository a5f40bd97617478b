"""Is blend's error in the rows it recomputes or in the rows it leaves stale?

Blend's cache differs from reuse's only in the rows it selects (the must-compute rows are computed
in both). Per record and ratio this scores, teacher-forced against full's greedy answer (the
suffix and answer rows computed fresh against each cache):
- `blend`: the engine as it is;
- `blend, selected exact`: the same cache with the selected rows' K and V replaced by full
  prefill's, every layer (what a perfect recompute of the same rows would give);
- `reuse, same rows exact`: reuse's cache with those rows exact (undamped);
and, over the selected rows and the layers after the check, how far blend's recomputed V and the
stored (reuse) V are from full's: if recomputing moves rows away from full, the rows are right and
their recomputed values are wrong.

    python experiments/exact_selected.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 39 --limit 1 --ratios 0.08,0.15
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch
from tqdm import tqdm

from kvblend.eval.harness import REFERENCE_CAPACITY, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

from kvblend.eval.dev_records import add_record_flags, open_records

POSITIONS = 16


@torch.inference_mode()
def suffix_logits(engine, ids, answer, cache, start):
    """The suffix and the answer's first tokens computed against `cache` from `start` on: the
    logits at the answer's first POSITIONS positions."""
    n = min(POSITIONS, len(answer))
    cache.truncate(start)
    toks = ids[start:] + answer[: n - 1]
    return engine.runner.forward(torch.tensor(toks), torch.arange(start, start + len(toks)), cache,
                                 logit_rows=slice(len(ids) - start - 1, None))


def score_against(engine, ids, answer, ref, start, scores: dict):
    """A scorer: score(label, cache) appends (kl_answer, top1_agree) against full's `ref` logits
    to scores[label]."""
    def score(label, cache):
        logits = suffix_logits(engine, ids, answer, cache, start)
        scores.setdefault(label, []).append((float(kl_divergence(ref, logits).mean()),
                                             float((logits.argmax(-1) == ref.argmax(-1)).float().mean())))
    return score


def print_scores(args, engine, n_records: int, scores: dict) -> None:
    print(f"\n{args.data}, records {args.offset}-{args.offset + n_records - 1}, {engine.model.dtype}")
    print("| variant | kl_answer | top1_agree | per record kl |\n| --- | --- | --- | --- |")
    for label, s in scores.items():
        print(f"| {label} | {statistics.mean(x[0] for x in s):.4f} | {statistics.mean(x[1] for x in s):.3f} "
              f"| {' '.join(f'{x[0]:.3f}' for x in s)} |")


@torch.inference_mode()
def make_exact(cache, full_cache, rows):
    """Rows take full prefill's KV at every layer, and no stale-key damping."""
    cache.k[:, :, rows] = full_cache.k[:, :, rows]
    cache.v[:, :, rows] = full_cache.v[:, :, rows]
    for bias in {id(b): b for b in cache.key_bias if b is not None}.values():
        bias[rows] = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=1)
    ap.add_argument("--ratios", default="0.08,0.15")
    args = ap.parse_args()
    engine, records = open_records(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    scores = {}
    for i, record in enumerate(tqdm(records, desc="records")):
        ids = prompt_ids(engine, record)
        full, answer, ref = full_reference(engine, ids)
        score = score_against(engine, ids, answer, ref, engine.segments(ids).suffix[0], scores)
        check = min(engine.blend_cfg.check_layers)

        _, reuse = engine.prefill(ids, "reuse", REFERENCE_CAPACITY)
        score("reuse", reuse.cache)
        for r in ratios:
            _, blend = engine.prefill(ids, "blend", REFERENCE_CAPACITY, blend_cfg=replace(engine.blend_cfg, ratios=[r]))
            rows = torch.tensor(blend.stats.selected_positions)
            later = slice(check + 1, None)
            to_full = lambda c: (c.v[later][:, :, rows].float() - full.cache.v[later][:, :, rows].float()).pow(2).sum(dim=(0, 1, 3))
            recomputed, stored = to_full(blend.cache), to_full(reuse.cache)
            worse = float((recomputed > stored).float().mean())
            print(f"\nrecord {args.offset + i}, {r:g}: {len(rows)} rows; V distance to full after "
                  f"the check, recomputed {float(recomputed.sum()):.1f} vs stored {float(stored.sum()):.1f}; "
                  f"recomputed further from full for {worse:.0%} of the rows")
            score(f"blend {r:g}", blend.cache)
            make_exact(blend.cache, full.cache, rows)
            score(f"blend {r:g}, selected exact", blend.cache)
            _, again = engine.prefill(ids, "reuse", REFERENCE_CAPACITY)
            make_exact(again.cache, full.cache, rows)
            score(f"reuse, blend {r:g}'s rows exact", again.cache)
    print_scores(args, engine, len(records), scores)


if __name__ == "__main__":
    main()
