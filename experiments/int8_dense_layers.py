"""Does keeping int8's most sensitive layers dense bring it to bf16's quality? Full prefill against
fp32 full (kl_answer, top1_agree, greedy answers that differ) on dev records.

`--sensitivity`: a bf16 engine with one layer's gate and up in int8 at a time, each layer's KL.
Otherwise: bf16, int8 as shipped, and int8 with the `--dense` layer lists' gate and up taken back
from the bf16 engine, on the same prompts.

    python experiments/int8_dense_layers.py --data ../shared/data/hotpotqa_s.dev.json --offset 30 --limit 8 \\
        --sensitivity
    python experiments/int8_dense_layers.py --data ../shared/data/hotpotqa_s.dev.json --offset 38 --limit 22 \\
        --dense 7,14,9,12 --dense 7,14,9,12,6,2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import REFERENCE_CAPACITY, greedy, open_engine, prompt_ids, scored, teacher_forced
from kvblend.model.weights import quantize_layer

PRODUCTS = ("gate_proj", "up_proj")  # what int8 replaces


def references(ref: Engine, records: list) -> list[tuple]:
    """Per record: prompt ids, fp32 full's greedy answer, its teacher-forced logits."""
    out = []
    for record in tqdm(records, desc="fp32 references"):
        ids = prompt_ids(ref, record)
        _, full = ref.prefill(ids, "full", REFERENCE_CAPACITY + 40)
        answer = greedy(ref, full, len(ids), 32)
        out.append((ids, answer, teacher_forced(ref, full, len(ids), answer, 16)))
    return out


def score(e: Engine, refs: list[tuple]) -> list[dict]:
    rows = []
    for ids, answer, ref in refs:
        _, out = e.prefill(ids, "full", REFERENCE_CAPACITY + 40)
        rows.append(scored(e, ids, out, answer, ref, 16, 32))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", default="../shared/data/hotpotqa_s.dev.json")
    ap.add_argument("--offset", type=int, default=30)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--sensitivity", action="store_true", help="each layer alone in int8")
    ap.add_argument("--dense", action="append", default=[], help="comma-separated layers kept dense in int8")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    records = load_dataset(args.data, offset=args.offset, limit=args.limit)
    refs = references(open_engine(args.model, "float32", "fp32", "cpu", progress=False), records)
    bf16 = open_engine(args.model, "bfloat16", "bf16", "cpu", progress=False)
    base = score(bf16, refs)
    print(f"bf16: kl_answer {statistics.mean(r['kl_answer'] for r in base):.5f}")
    if args.sensitivity:
        for i, layer in enumerate(bf16.runner.layers):
            saved = {n: getattr(layer.mlp, n) for n in PRODUCTS}
            quantize_layer(layer, "int8", torch.bfloat16)
            kl = statistics.mean(r["kl_answer"] for r in score(bf16, refs))
            for n, m in saved.items():
                setattr(layer.mlp, n, m)
            print(f"layer {i} alone in int8: kl_answer {kl:.5f}", flush=True)
        return
    runs = {"bf16": base}
    int8 = open_engine(args.model, "bfloat16", "int8", "cpu", progress=False)
    runs["int8"] = score(int8, refs)
    for spec in args.dense:
        for i in map(int, spec.split(",")):
            for n in PRODUCTS:  # the bf16 engine's modules: read-only, shared
                setattr(int8.runner.layers[i].mlp, n, getattr(bf16.runner.layers[i].mlp, n))
        runs[f"int8, dense {spec}"] = score(int8, refs)
        int8 = open_engine(args.model, "bfloat16", "int8", "cpu", progress=False)
    print("| against fp32 full | kl_answer | top1_agree | answers that differ |\n| --- | ---: | ---: | ---: |")
    for label, rows in runs.items():
        print(f"| {label} | {statistics.mean(r['kl_answer'] for r in rows):.5f} "
              f"| {statistics.mean(r['top1_agree'] for r in rows):.3f} "
              f"| {sum(1 - r['match_full'] for r in rows):g} of {len(rows)} |")
    for j, (_, answer, _) in enumerate(refs):
        for label, rows in runs.items():
            if not rows[j]["match_full"]:
                print(f"record {args.offset + j}, {label}: {bf16.tokenizer.decode(answer, skip_special_tokens=True)!r}"
                      f" -> {rows[j]['answer']!r}")


if __name__ == "__main__":
    main()
