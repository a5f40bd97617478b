"""Quality of each weight format against the model as shipped: fp32 full prefill.

Per record, fp32 full prefill gives the reference answer (greedy) and its next-token logits at the
answer's first positions, teacher-forced. Each format (`--formats`, in the dtype `--dtype` picks)
is then scored on the same positions, for full prefill and for blend at the engine's default
ratio: kl_answer, top1_agree, and whether its own greedy answer is fp32 full's, with the answers
that differ listed. For blend, the whole file is indexed first in every format's engine, as `kvblend
eval` does.

    python benchmarks/weight_formats.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 0 --limit 30 --formats bf16,int8,int4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import (REFERENCE_CAPACITY, greedy, index_dataset, open_engine, prompt_ids, scored,
                                  teacher_forced)
from kvblend.eval.report import differing_answers
from kvblend.model.loader import DEFAULT_MODEL

DTYPE_OF = {"fp32": "float32", "bf16": "bfloat16"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default="../shared/data/hotpotqa_s.dev.json")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=30)
    ap.add_argument("--formats", default="bf16,int8,int4", help="weight formats scored against fp32")
    ap.add_argument("--dtype", default="auto", help="activation dtype of the quantized formats")
    ap.add_argument("--modes", default="full,blend")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--positions", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/weight_formats.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    records = load_dataset(args.data, limit=args.limit, offset=args.offset)
    everything = load_dataset(args.data)
    ref_engine = open_engine(args.model, "float32", "fp32", "cpu", progress=False)
    engines = {f: open_engine(args.model, DTYPE_OF.get(f, args.dtype), f, "cpu", progress=False)
               for f in args.formats.split(",")}
    modes = args.modes.split(",")
    if "blend" in modes:  # only blend reads the store; the reference runs full prefill alone
        for engine in engines.values():
            index_dataset(engine, everything)
    capacity = max(REFERENCE_CAPACITY, args.answer_tokens + 8)
    per = []
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(ref_engine, record)
        ref_engine.check_ids(ids, args.answer_tokens)
        _, full = ref_engine.prefill(ids, "full", capacity)
        answer = greedy(ref_engine, full, len(ids), args.answer_tokens)
        ref = teacher_forced(ref_engine, full, len(ids), answer, args.positions)
        row = {"fp32 full": ref_engine.tokenizer.decode(answer, skip_special_tokens=True)}
        for f, engine in engines.items():
            if "blend" in modes:
                engine.precompute(ids)
            for mode in modes:
                _, out = engine.prefill(ids, mode, capacity)
                row[f"{f} {mode}"] = scored(engine, ids, out, answer, ref, args.positions, args.answer_tokens)
        per.append(row)
    labels = [k for k in per[0] if k != "fp32 full"]
    summary = {k: dict(kl_answer=statistics.mean(p[k]["kl_answer"] for p in per),
                       median_kl=statistics.median(p[k]["kl_answer"] for p in per),
                       top1_agree=statistics.mean(p[k]["top1_agree"] for p in per),
                       answers_differ=sum(1 - p[k]["match_full"] for p in per)) for k in labels}
    print(f"\n{args.model} on {args.data}, records {args.offset}-{args.offset + len(records) - 1}; "
          f"quantized formats in {next(iter(engines.values())).model.dtype}")
    print("| against fp32 full | kl_answer | median | top1_agree | answers that differ |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, s in summary.items():
        print(f"| {k} | {s['kl_answer']:.4f} | {s['median_kl']:.4f} | {s['top1_agree']:.3f} "
              f"| {s['answers_differ']:g} of {len(per)} |")
    differ = differing_answers(per, labels, "fp32 full", args.offset)
    print("\nAnswers that differ from fp32 full's:", *differ, sep="\n")
    result = dict(model=args.model, data=args.data, offset=args.offset, summary=summary, per_record=per)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
