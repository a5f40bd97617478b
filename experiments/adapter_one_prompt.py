"""Can a chunk adapter correct blend on one prompt? Train a fresh adapter on that prompt alone and
score blend as the engine serves it before and after: if even this fails, the adapter cannot carry
the correction; if it succeeds, what is left to find is a training that generalizes. E.g.:

    python experiments/adapter_one_prompt.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --record 31 --steps 8 --lr 1e-3
"""

from __future__ import annotations

import argparse
import time

import torch

from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.model.adapter import ChunkAdapter
from kvblend.train.data import build_prompts, teach
from kvblend.train.trainer import dev_score, student_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", required=True)
    ap.add_argument("--record", type=int, default=31, help="a dev record (never one of 0-29)")
    ap.add_argument("--max-tokens", type=int, default=2560)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--student", choices=["blend", "reuse"], default="blend")
    args = ap.parse_args()

    settings = Settings(model=args.model, chunk_adapter="none")
    engine = Engine.from_settings(settings)
    records = load_dataset(args.data, limit=1, offset=args.record)
    examples = teach(engine, build_prompts(engine, records, args.max_tokens), progress=False)
    if not examples:
        raise SystemExit(f"record {args.record} does not fit in --max-tokens {args.max_tokens}")
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    adapter = ChunkAdapter.for_model(engine.model.config, rank=args.rank)
    opt = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"{len(examples[0].ids)} tokens; served blend KL without an adapter: "
          f"{dev_score(engine, None, examples)['kl_answer']:.4f}", flush=True)
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.enable_grad():
            loss = student_loss(engine, adapter, examples[0], args.student)
            loss.backward()
        opt.step()
        print(f"step {step + 1}: student loss {loss.item():.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"served blend KL with the adapter: {dev_score(engine, adapter, examples)['kl_answer']:.4f}")


if __name__ == "__main__":
    main()
