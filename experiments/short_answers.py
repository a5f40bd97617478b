"""Short prompts: does blend's free-running greedy answer equal full prefill's?

Each file holds fictional passages and questions with their passages in mixed orders (a few hundred
tokens a prompt, where the default ratio recomputes only a few dozen tokens). The passages are
stored as one collection (LLM.store_documents), then every question is answered by full prefill
and by blend, greedy; prints each pair and the count of equal answers per setting.

    python experiments/short_answers.py experiments/short_prompts_dev.json kvblend/demo/passages.json \
        --quiet --set min_recompute_tokens=0,32,64,128,256
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvblend.api import LLM, SamplingParams

from kvblend.eval.variants import parse_grid


def answers(llm: LLM, data: dict, mode: str, max_tokens: int) -> tuple[list[str], list[float]]:
    """Each question's greedy answer in `mode`, and its TTFT."""
    params = SamplingParams(max_tokens=max_tokens)
    texts, ttfts = [], []
    for q in data["questions"]:
        docs = [data["passages"][i] for i in q["passages"]]
        out = llm.generate(q["question"], params, documents=docs, mode=mode)[0]
        texts.append(out.text.strip())
        ttfts.append(out.metrics.ttft_s)
    return texts, ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                    help="settings to try (the grid of all combinations); default: the defaults alone")
    ap.add_argument("--quiet", action="store_true", help="counts only")
    args = ap.parse_args()
    for overrides in parse_grid(args.set) or [{}]:
        llm = LLM(model=args.model, **overrides)
        same = total = 0
        ttft = {"full": [], "blend": []}
        for path in args.files:
            with open(path) as f:
                data = json.load(f)
            llm.store_documents(data["passages"])
            full, t_full = answers(llm, data, "full", args.max_tokens)
            blend, t_blend = answers(llm, data, "blend", args.max_tokens)
            ttft["full"] += t_full
            ttft["blend"] += t_blend
            for q, a, b in zip(data["questions"], full, blend):
                same += a == b
                total += 1
                if not args.quiet:
                    print(f"{'==' if a == b else '!='} {q['question']}\n   full:  {a!r}\n   blend: {b!r}")
        full_ms, blend_ms = (1000 * statistics.median(ttft[m]) for m in ("full", "blend"))
        print(f"{overrides or 'defaults'}: blend == full on {same} of {total}; median TTFT full {full_ms:.0f} ms, "
              f"blend {blend_ms:.0f} ms", flush=True)
        llm.close()


if __name__ == "__main__":
    main()
