"""Blend settings side by side on dev records: teacher-forced fidelity against full prefill.

Each variant is a set of BlendConfig fields (`ratios`, `stale_key_scale`, `deviation`, ...); full
prefill and its greedy answer are computed once per record, and every variant is scored on the
same 16 answer positions (docs/results.md). Choose settings here on records the held-out tables
do not use (they take the first 30), e.g.:

    python experiments/sweep_blend.py --data ../shared/data/hotpotqa_s.dev.json --offset 30 --limit 30 \\
        --ratios 0.08,0.15 --grid stale_key_scale=1,0.65,0.5,0.35

`--variant` names whole variants instead of a product: --variant "" --variant "deviation=k check_layers=1+6".
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

from kvblend.eval.dev_records import add_record_flags, open_records
from kvblend.eval.flops import work_frac
from kvblend.eval.variants import parse_grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=16)
    ap.add_argument("--ratios", default="0.08,0.15", help="blend recompute ratios; reuse is always scored")
    ap.add_argument("--grid", nargs="*", default=[], help="field=v1,v2 ... (BlendConfig fields)")
    ap.add_argument("--variant", action="append", default=[],
                    help='one variant\'s BlendConfig fields, e.g. "deviation=k check_layers=1+6" (repeatable; '
                         'with --grid, each is added to every grid combination)')
    ap.add_argument("--out", default="results/sweep_blend.json")
    args = ap.parse_args()
    engine, records = open_records(args)
    grid = parse_grid(args.grid) or [{}]
    combos = [{**g, **parse_grid(v.split())[0]} for g in grid for v in args.variant] or grid
    variants = {}  # label -> (mode, BlendConfig)
    for fields in combos:
        tag = " ".join(f"{k}={v}" for k, v in fields.items())
        reuse_fields = {k: v for k, v in fields.items() if k == "stale_key_scale"}
        variants[f"reuse {tag}".strip()] = ("reuse", replace(engine.blend_cfg, **reuse_fields))
        for r in (float(x) for x in args.ratios.split(",")):
            variants[f"blend {r:g} {tag}".strip()] = ("blend", replace(engine.blend_cfg, **{"ratios": [r], **fields}))  # a variant may set its own ratios
    scores = {label: [] for label in variants}
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        _, answer, ref = full_reference(engine, ids)
        for label, (mode, cfg) in variants.items():
            logits, out = forced_logits(engine, ids, mode, cfg, answer)
            top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
            scores[label].append((float(kl_divergence(ref, logits).mean()), top1, out.stats.compute_frac,
                                  work_frac(engine, len(ids), mode, cfg, out.stats)))
    rows = [dict(variant=label, kl_answer=statistics.mean(s[0] for s in ss), top1_agree=statistics.mean(s[1] for s in ss),
                 compute_frac=statistics.mean(s[2] for s in ss), work_frac=statistics.mean(s[3] for s in ss))
            for label, ss in scores.items()]
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}")
    print("| variant | kl_answer | top1_agree | compute_frac | work_frac (FLOPs) |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['kl_answer']:.4f} | {r['top1_agree']:.3f} | {r['compute_frac']:.3f} | {r['work_frac']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, offset=args.offset, n=len(records),
                                              dtype=str(engine.model.dtype), rows=rows, per_record=scores), indent=2))


if __name__ == "__main__":
    main()
