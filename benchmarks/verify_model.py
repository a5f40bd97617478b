"""Is kvblend's runner right on this model? Its logits against transformers' own forward on the
same weights and dtype, the rotary gate, and blend's invariants (ratio 1.0 equals full prefill,
0 equals reuse), on a RAG prompt of the demo's passages. Prints a table and writes JSON.

    python benchmarks/verify_model.py --model qwen2.5-coder-1.5b-instruct --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch

from kvblend import LLM
from kvblend.blend.fusor import BlendConfig
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import DEFAULT_MODEL
from kvblend.model.rotary import check_rerotation


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logit rows a against reference rows b: max abs diff, argmax agreement, mean KL(b || a)."""
    a, b = a.float(), b.float()
    return {"max_abs": float((a - b).abs().max()), "top1": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "kl": float(kl_divergence(b, a).mean())}


@torch.inference_mode()
def verify(model: str, dtype: str, repeat: int) -> dict:
    llm = LLM(model=model, dtype=dtype)
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    docs, question = demo["passages"] * repeat, demo["questions"][0]["question"]
    ids = llm.rag_prompt_ids(question, docs)
    engine, runner = llm.engine, llm.engine.runner
    T = len(ids)
    ref = engine.model.hf(torch.tensor([ids])).logits[0]
    mine = runner.forward(torch.tensor(ids), torch.arange(T), runner.new_cache(T), logit_rows=slice(None))
    gate, why = check_rerotation(engine.model.hf, engine.max_len)
    llm.store_documents(docs)
    moved = llm.rag_prompt_ids(question, docs[::-1])  # every chunk at a new position
    _, full = engine.prefill(moved, "full")
    _, one = engine.prefill(moved, "blend", blend_cfg=BlendConfig([1], [1.0], "v"))
    _, reuse = engine.prefill(moved, "reuse")
    _, zero = engine.prefill(moved, "blend", blend_cfg=replace(engine.blend_cfg, ratios=[0.0]))
    llm.close()
    return {"model": model, "dtype": str(engine.model.dtype).removeprefix("torch."), "tokens": T,
            "runner_vs_transformers": compare(mine, ref), "rotary_gate": gate, "rotary_gate_why": why,
            "blend_1_vs_full": compare(one.logits[None], full.logits[None]),
            "blend_0_equals_reuse": bool(torch.equal(zero.logits, reuse.logits))}


def table(rows: list[dict]) -> str:
    lines = ["| model | dtype | tokens | runner vs transformers: max abs / top-1 / KL | rotary gate | "
             "blend 1.0 vs full: max abs | blend 0 == reuse |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c, b = r["runner_vs_transformers"], r["blend_1_vs_full"]
        lines.append(f"| {r['model']} | {r['dtype']} | {r['tokens']} | {c['max_abs']:.2e} / {c['top1']:.3f} / "
                     f"{c['kl']:.1e} | {'ok' if r['rotary_gate'] else r['rotary_gate_why']} | {b['max_abs']:.2e} | "
                     f"{'yes' if r['blend_0_equals_reuse'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16")
    ap.add_argument("--repeat", type=int, default=2, help="the demo's passages this many times (prompt length)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    rows = [verify(args.model, dtype, args.repeat) for dtype in args.dtypes.split(",")]
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
