"""How strongly the selector should trust the probe's attention: score = attention^p x |dV| (`attention_power`).

The engine weighs each candidate's V deviation at the check layer by the attention the question
pays it (p = 1); p = 0 is plain deviation ranking (HKVD, with the probe's check candidates still
chosen by attention). On Qwen2.5-Coder-0.5B an oracle ranking by the true V drift beat rankings by
the question's attention (experiments/error_sources.py), which asks whether a smaller p pays.
Teacher-forced against full's greedy answer, same positions as `kvblend eval`:

    python experiments/attention_power.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 30 --limit 6 --powers 1,0.5,0.25
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from tqdm import tqdm

from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

from kvblend.eval.dev_records import add_record_flags, open_records
from kvblend.eval.flops import work_frac


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--ratios", default="0.08")
    ap.add_argument("--powers", default="1,0.5,0.25")
    args = ap.parse_args()
    engine, records = open_records(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    powers = [float(p) for p in args.powers.split(",")]
    scores = {(r, p): [] for r in ratios for p in powers}
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        _, answer, ref = full_reference(engine, ids)
        for r, p in scores:
            cfg = replace(engine.blend_cfg, ratios=[r], attention_power=p)
            logits, out = forced_logits(engine, ids, "blend", cfg, answer)
            scores[r, p].append((float(kl_divergence(ref, logits).mean()),
                                 float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                                 work_frac(engine, len(ids), "blend", cfg, out.stats)))
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}")
    print("| ratio | attention power | kl_answer | top1_agree | work_frac (FLOPs) | per record kl |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for (r, p), s in scores.items():
        print(f"| {r:g} | {p:g} | {statistics.mean(x[0] for x in s):.4f} | {statistics.mean(x[1] for x in s):.3f} "
              f"| {statistics.mean(x[2] for x in s):.3f} "
              f"| {' '.join(f'{x[0]:.3f}' for x in s)} |")


if __name__ == "__main__":
    main()
