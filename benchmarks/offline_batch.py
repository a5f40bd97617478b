"""Offline throughput: LLM.generate over a list of RAG prompts, batched through the engine loop
(the server's scheduler), against the same prompts one call at a time.

The documents are stored first, so both runs reuse them alike; every prompt decodes the same number
of tokens (greedy, EOS ignored). The runs alternate over `--repeats`; the best of each is printed.
Batched decode must not change a token: the script checks that both runs give the same tokens and
exits with an error if they differ.

Numbers depend on the machine and on what else runs on it: compare the ratio within one run.

    python benchmarks/offline_batch.py --prompts 8 --max-tokens 32 --out results/offline_batch.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from importlib import resources
from pathlib import Path

from kvblend import LLM, SamplingParams
from kvblend.eval.machine import cpu_name


def workload(n: int, seed: int) -> tuple[list[str], list[list[str]]]:
    """`n` questions of the demo, each over its passages and a distractor, in a shuffled order."""
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    rng = random.Random(seed)
    questions, documents = [], []
    for i in range(n):
        q = demo["questions"][i % len(demo["questions"])]
        picked = list(q["passages"]) + rng.sample([j for j in range(len(demo["passages"])) if j not in q["passages"]], 1)
        rng.shuffle(picked)
        questions.append(q["question"])
        documents.append([demo["passages"][j] for j in picked])
    return questions, documents


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mode", default="blend", choices=["full", "prefix", "blend"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    llm = LLM(model=args.model, dtype=args.dtype)
    questions, documents = workload(args.prompts, args.seed)
    llm.store_documents(sorted({d for docs in documents for d in docs}))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def one_at_a_time():
        return [llm.generate(q, params, documents=d, mode=args.mode)[0] for q, d in zip(questions, documents)]

    def batched():
        return llm.generate(questions, params, documents=documents, mode=args.mode)

    batched()  # warm: the prefix cache and the allocator, for both runs alike
    best = {"one at a time": float("inf"), "batched": float("inf")}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in (("one at a time", one_at_a_time), ("batched", batched)):
            t0 = time.perf_counter()
            outputs[name] = run()
            best[name] = min(best[name], time.perf_counter() - t0)
    tokens = sum(len(o.token_ids) for o in outputs["batched"])
    same = [o.token_ids for o in outputs["batched"]] == [o.token_ids for o in outputs["one at a time"]]
    rows = [{"run": name, "seconds": s, "tokens": tokens, "tokens_per_s": tokens / s} for name, s in best.items()]
    for r in rows:
        print(f"{r['run']:>14}: {r['seconds']:.2f} s for {r['tokens']} tokens, {r['tokens_per_s']:.1f} tokens/s")
    speedup = best["one at a time"] / best["batched"]
    print(f"batched is {speedup:.2f}x the throughput of one at a time; outputs {'match' if same else 'DIFFER'} "
          f"({args.prompts} prompts, {args.max_tokens} tokens each, {args.mode}, {cpu_name()})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": llm.settings.model, "mode": args.mode, "prompts": args.prompts,
                                              "max_tokens": args.max_tokens, "cpu": cpu_name(), "rows": rows,
                                              "speedup": speedup, "outputs_match": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
