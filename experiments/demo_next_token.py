"""Next-token distributions of one demo question after a forced answer start: full prefill's top
tokens beside reuse's and blend's at several ratios, and which chunks the blend recomputed. For
reading one drifting answer (the demo's Marrowick question goes wrong as the ratio rises):

    .venv/bin/python experiments/demo_next_token.py --question 0 --start "The" \\
        --ratios 0,0.08,0.15,0.3,0.6 --grid stale_key_scale=0.35,1
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from importlib import resources

import torch

from kvblend.api import LLM

from kvblend.eval.variants import parse_grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question", type=int, default=0, help="index into the demo's questions")
    ap.add_argument("--start", default="", help="answer text forced before the token read")
    ap.add_argument("--ratios", default="0,0.08,0.15,0.3", help="0 is reuse")
    ap.add_argument("--grid", nargs="*", default=[], help='BlendConfig fields, e.g. "stale_key_scale=0.35,1"')
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype)
    engine, tok = llm.engine, llm.tokenizer
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    passages = demo["passages"]
    llm.store_documents(passages)
    q = demo["questions"][args.question]
    ids = llm.rag_prompt_ids(q["question"], [passages[i] for i in q["passages"]])
    ids += tok.encode(args.start, add_special_tokens=False) if args.start else []

    def top(logits: torch.Tensor) -> str:
        p, i = torch.softmax(logits.float(), -1).topk(args.top)
        return "  ".join(f"{tok.decode([int(t)])!r} {float(x):.2f}" for t, x in zip(i, p))

    print(f"{q['question']} (chunks {q['passages']}), after {args.start!r}")
    print(f"full: {top(engine.prefill(ids, 'full', 0)[1].logits)}")
    for fields in parse_grid(args.grid) or [{}]:
        for r in (float(x) for x in args.ratios.split(",")):
            cfg = replace(engine.blend_cfg, **fields, **({"ratios": [r]} if r else {}))
            plan, out = engine.prefill(ids, "blend" if r else "reuse", 0, blend_cfg=cfg)
            spans = [c.span for c in plan.chunks]
            per_chunk = [sum(a <= p < b for p in out.stats.selected_positions) for a, b in spans]
            name = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"{'blend ' + format(r, 'g') if r else 'reuse'} {name}: {top(out.logits)}   "
                  f"recomputed per chunk {per_chunk} of {[b - a for a, b in spans]}")
    llm.close()


if __name__ == "__main__":
    main()
