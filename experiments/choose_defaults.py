"""How the defaults were chosen: chunk-context mode x deviation signal x attention weighting.

Teacher-forced fidelity only (kl_answer, top1_agree over 16 answer positions of full prefill's
greedy answer; docs/results.md), which is what separates the variants, at ratio 0.15, on records
the held-out tables do not use (they take the first 30):

    python experiments/choose_defaults.py --data ../shared/data/musique_s.dev.json --offset 30 --limit 16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import load_model

RATIO = 0.15
# label -> BlendConfig fields at ratio 0.15; None = plain reuse
VARIANTS = {"reuse": None}
for dev in ("k", "v", "kv"):
    VARIANTS[f"blend, {dev} deviation"] = dict(deviation=dev, weight_by_attention=False)
    VARIANTS[f"blend, {dev} deviation x attention"] = dict(deviation=dev, weight_by_attention=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--offset", type=int, default=30, help="skip the first records (keep tuning off the eval set)")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--contexts", default="bare,prefix,bos")
    ap.add_argument("--out", default="results/choose_defaults.json")
    args = ap.parse_args()
    records = load_dataset(args.data, limit=args.limit, offset=args.offset)
    model = load_model()
    rows = []
    for ctx in args.contexts.split(","):
        engine = Engine(model, load_settings(chunk_context=ctx))
        scores = {label: [] for label in VARIANTS}
        for record in tqdm(records, desc=f"context {ctx}"):
            ids = prompt_ids(engine, record)
            _, answer, ref = full_reference(engine, ids)
            for label, fields in VARIANTS.items():
                mode, cfg = ("reuse", None) if fields is None else ("blend", replace(engine.blend_cfg, ratios=[RATIO], **fields))
                logits, _ = forced_logits(engine, ids, mode, cfg, answer)
                top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                scores[label].append((float(kl_divergence(ref, logits).mean()), top1))
        for label, s in scores.items():
            kl = sum(x[0] for x in s) / len(s)
            top1 = sum(x[1] for x in s) / len(s)
            rows.append(dict(context=ctx, variant=label, kl_answer=kl, top1_agree=top1))
            print(f"| {ctx} | {label} | {kl:.3f} | {top1:.3f} |", flush=True)
    print("\n| chunk context | variant | kl_answer | top1_agree |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['context']} | {r['variant']} | {r['kl_answer']:.3f} | {r['top1_agree']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, offset=args.offset, n=len(records), ratio=RATIO,
                                              rows=rows), indent=2))


if __name__ == "__main__":
    main()
