"""How far full prefill's own answer moves under a perturbation that is not blend's, beside blend's.

The perturbation is part of what a user meets by changing machine: the rounding a bf16 engine does,
emulated in fp32 (every weight and every linear layer's output rounded to bf16; the residual stream
and attention stay fp32), so it runs at fp32 speed on any CPU. The perturbed full prefill and blend
at each given ratio are scored against fp32 full prefill on the same 16 answer positions
(kl_answer, top1_agree) and by their own greedy answers. A model whose answers flip under rounding
cannot be expected to keep them under any approximation of its prompt; this is the floor against
which blend's flips are read. E.g.:

    python experiments/noise_floor.py --model qwen2.5-coder-0.5b-instruct --data ../shared/data/hotpotqa_s.dev.json \\
        --offset 0 --limit 30 --dtype float32 --ratios 0.08
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.eval.harness import REFERENCE_CAPACITY, greedy, prompt_ids, scored, teacher_forced

from kvblend.eval.dev_records import add_record_flags, open_records
from kvblend.eval.report import differing_answers


class Bf16Rounding:
    """Switches a model between its own weights and bf16-rounded ones whose linear layers also
    round their outputs to bf16 (the two weight sets are kept; switching swaps tensors)."""

    def __init__(self, hf: torch.nn.Module):
        self.params = [p for p in hf.parameters() if p.dtype == torch.float32]
        self.own = [p.data for p in self.params]
        self.rounded = [p.data.to(torch.bfloat16).float() for p in self.params]
        self.linears = [m for m in hf.modules() if isinstance(m, torch.nn.Linear)]
        self.hooks = []

    def on(self) -> None:
        for p, t in zip(self.params, self.rounded):
            p.data = t
        self.hooks = [m.register_forward_hook(lambda _m, _i, out: out.bfloat16().float()) for m in self.linears]

    def off(self) -> None:
        for p, t in zip(self.params, self.own):
            p.data = t
        for h in self.hooks:
            h.remove()
        self.hooks = []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=30)
    ap.add_argument("--ratios", default="0.08", help="blend recompute ratios scored beside the perturbation")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--positions", type=int, default=16)
    ap.add_argument("--out", default="results/noise_floor.json")
    args = ap.parse_args()
    engine, records = open_records(args)
    if engine.model.dtype != torch.float32:
        sys.exit("the bf16 emulation perturbs an fp32 model: run with --dtype float32")
    rounding = Bf16Rounding(engine.model.hf)
    cap = max(REFERENCE_CAPACITY, args.answer_tokens + 8)
    ratios = [float(r) for r in args.ratios.split(",")]
    per = []
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        _, full = engine.prefill(ids, "full", cap)
        answer = greedy(engine, full, len(ids), args.answer_tokens)
        ref = teacher_forced(engine, full, len(ids), answer, args.positions)
        row = {"full": engine.tokenizer.decode(answer, skip_special_tokens=True)}
        for r in ratios:
            _, out = engine.prefill(ids, "blend", cap, blend_cfg=replace(engine.blend_cfg, ratios=[r]))
            row[f"blend {r:g}"] = scored(engine, ids, out, answer, ref, args.positions, args.answer_tokens)
        rounding.on()
        try:
            _, out = engine.prefill(ids, "full", cap)
            row["full bf16-rounded"] = scored(engine, ids, out, answer, ref, args.positions, args.answer_tokens)
        finally:
            rounding.off()
        per.append(row)
    labels = [k for k in per[0] if k != "full"]
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}")
    print("| against fp32 full | kl_answer | top1_agree | match_full | median kl |\n| --- | --- | --- | --- | --- |")
    for k in labels:
        kls = [p[k]["kl_answer"] for p in per]
        print(f"| {k} | {statistics.mean(kls):.4f} | {statistics.mean(p[k]['top1_agree'] for p in per):.3f} "
              f"| {statistics.mean(p[k]['match_full'] for p in per):.2f} | {statistics.median(kls):.4f} |")
    print("\nAnswers that differ from full's:", *differing_answers(per, labels, "full", args.offset), sep="\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, offset=args.offset, per_record=per), indent=2))


if __name__ == "__main__":
    main()
