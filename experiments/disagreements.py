"""Where blend's top-1 disagrees with full prefill's, and how sure full itself was there.

top1_agree stops rising well before ratio 1.0 (MuSiQue: 0.95 from 30% on). This lists, per ratio,
the teacher-forced answer positions whose argmax differs from full's, with full's own top-1
probability and its margin over the runner-up: if the disagreements sit where full is nearly
tied, more recompute buys little top-1 there. Same positions and metric as `kvblend eval`.

    .venv/bin/python experiments/disagreements.py --data ../shared/data/musique_s.dev.json \\
        --offset 30 --limit 6 --ratios 0.15,0.3,0.5
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvblend.eval.harness import forced_logits, full_reference, prompt_ids

from kvblend.eval.dev_records import add_record_flags, open_records

NEAR_TIE = 0.1  # full's top-1 probability minus its runner-up's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--ratios", default="0.15,0.3,0.5")
    ap.add_argument("--out", default="results/disagreements.json")
    args = ap.parse_args()
    engine, records = open_records(args)
    ratios = [float(r) for r in args.ratios.split(",")]
    margins, found = [], {r: [] for r in ratios}  # every position's margin; per ratio, the disagreements
    for i, record in enumerate(tqdm(records, desc="records")):
        ids = prompt_ids(engine, record)
        _, answer, ref = full_reference(engine, ids)
        ref = ref.softmax(-1)
        top2 = ref.topk(2, -1).values
        margin = top2[:, 0] - top2[:, 1]
        margins += margin.tolist()
        for r in ratios:
            cfg = replace(engine.blend_cfg, ratios=[r] * len(engine.blend_cfg.check_layers))
            probs = forced_logits(engine, ids, "blend", cfg, answer)[0].softmax(-1)
            for j in (probs.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist():
                found[r].append(dict(record=args.offset + i, position=j, full_top1_p=float(top2[j, 0]),
                                     full_margin=float(margin[j]),
                                     blend_p_of_full_top1=float(probs[j, ref[j].argmax()])))
    n = len(margins)
    ties = sum(m < NEAR_TIE for m in margins)
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}: "
          f"{n} answer positions, {ties} ({ties / n:.0%}) where full's top two are within {NEAR_TIE} probability")
    print("| ratio | top1_agree (pooled over positions) | disagreements | of them near-ties "
          "| full's top-1 p there: median, max |")
    print("| --- | --- | --- | --- | --- |")
    for r in ratios:
        d = found[r]
        near = sum(x["full_margin"] < NEAR_TIE for x in d)
        ps = [x["full_top1_p"] for x in d]
        p = f"{statistics.median(ps):.2f}, {max(ps):.2f}" if d else "-"
        print(f"| {r:g} | {1 - len(d) / n:.3f} | {len(d)} | {near} | {p} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, offset=args.offset, n_records=len(records),
                                              n_positions=n, near_ties=ties,
                                              disagreements={f"{r:g}": found[r] for r in ratios}), indent=2))


if __name__ == "__main__":
    main()
