"""How the defaults were chosen: chunk-context mode x deviation signal x check layers.

Teacher-forced fidelity only (kl_answer, top1_agree over 16 answer positions of full prefill's
greedy answer; DESIGN section 5), which is what separates the variants, at ratio 0.15.

    python benchmarks/choose_defaults.py --data ../shared/data/musique_s.dev.json --offset 30 --limit 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from kvblend.blend.fusor import BlendConfig
from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import greedy, prompt_ids, teacher_forced
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import load_model

# (check layers, ratios, deviation, check_layer_kv); None = plain reuse
VARIANTS = [None, ([1], [0.15], "k", "fresh"), ([1], [0.15], "v", "fresh"), ([1], [0.15], "kv", "fresh"),
            ([2], [0.15], "v", "fresh"), ([1, 2], [0.3, 0.15], "v", "fresh"), ([1, 4], [0.3, 0.15], "v", "fresh")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--offset", type=int, default=0, help="skip the first records (keep tuning off the eval set)")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--contexts", default="prefix,bare")
    ap.add_argument("--out", default="results/choose_defaults.json")
    args = ap.parse_args()
    records = load_dataset(args.data, limit=args.offset + args.limit)[args.offset:]
    model = load_model()
    rows = []
    for ctx in args.contexts.split(","):
        engine = Engine(model, load_settings(chunk_context=ctx))
        scores = {i: [] for i in range(len(VARIANTS))}
        for record in tqdm(records, desc=f"context {ctx}"):
            ids = prompt_ids(engine, record)
            engine.precompute(ids)
            _, full = engine.prefill(ids, "full", 40)
            answer = greedy(engine, full, len(ids), 17)
            ref = teacher_forced(engine, full, len(ids), answer, 16)
            for i, v in enumerate(VARIANTS):
                mode, cfg = ("reuse", None) if v is None else ("blend", BlendConfig(*v))
                _, out = engine.prefill(ids, mode, 40, blend_cfg=cfg)
                logits = teacher_forced(engine, out, len(ids), answer, 16)
                top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                scores[i].append((float(kl_divergence(ref, logits).mean()), top1))
        for i, v in enumerate(VARIANTS):
            kl = sum(s[0] for s in scores[i]) / len(records)
            top1 = sum(s[1] for s in scores[i]) / len(records)
            label = "reuse" if v is None else f"blend {v[1]} at layers {v[0]}, dev {v[2]}, check-layer KV {v[3]}"
            rows.append(dict(context=ctx, variant=label, kl_answer=kl, top1_agree=top1))
    print("| chunk context | variant | kl_answer | top1_agree |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['context']} | {r['variant']} | {r['kl_answer']:.3f} | {r['top1_agree']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, n=len(records), rows=rows), indent=2))


if __name__ == "__main__":
    main()
