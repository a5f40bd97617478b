"""Soft tokens stored with each chunk (KV Packet's packets) on top of blend and the neighbour lead.

A few learned embedding rows go before and after every chunk while its KV is precomputed (after
the prefix and its neighbour lead, as served); their K and V are kept with the chunk's and read at
request time by the rows blend recomputes, the question and the answer. The model stays frozen:
only the rows' embeddings learn, by kl_answer against the model's own full prefill. Unlike a
chunk adapter, the question reads extra rows: it can learn how much of its attention each chunk
should take, which is what the stale keys get wrong.

Measured in the student (kvblend/train/student.py: the served path written out of place, within a
few percent of the engine), since nothing in the engine stores these rows:

    python experiments/soft_tokens.py train --data /tmp/adapter_rc.json --data hotpotqa_s.dev.json \\
        --offset 40 --dev-data hotpotqa_s.dev.json --dev-offset 30 --dev-limit 6 --out soft.pt
    python experiments/soft_tokens.py eval --soft soft.pt --data hotpotqa_s.dev.json --limit 30
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch

from kvblend.cli_adapter import training_engine, training_examples
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import index_dataset, prompt_ids
from kvblend.model.runner import Rows
from kvblend.train.data import Example, save_atomic, teach
from kvblend.train.student import ExactKV, encode_rows, exact_kv, move, topk_kl
from kvblend.train.trainer import exact_end, read_served, stored_spans


class SoftTokens(torch.nn.Module):
    """`pre` [m, hidden] rows before each chunk and `post` [m, hidden] after it, shared by all chunks."""

    def __init__(self, pre: torch.Tensor, post: torch.Tensor):
        super().__init__()
        self.pre = torch.nn.Parameter(pre.detach().float().clone())
        self.post = torch.nn.Parameter(post.detach().float().clone())

    @classmethod
    def from_text(cls, engine: Engine, m: int) -> "SoftTokens":
        """Started from the embeddings of a plain header and footer, so the untrained rows read as text."""
        tok = engine.tokenizer
        def rows(text):
            ids = (tok.encode(text, add_special_tokens=False) * m)[:m]
            return engine.runner.embed_tokens(torch.tensor(ids)).float()
        return cls(rows(" Document:\n"), rows("\n(end of document)\n"))


def encode(runner, soft: SoftTokens | None, context: ExactKV, chunks, leads):
    """Each chunk after the context and its lead, with the soft rows around it: per layer K, V
    over [pre, chunk, post] of every chunk (concatenated), their encode positions, and which are
    chunk rows."""
    m1, m2 = (0, 0) if soft is None else (soft.pre.shape[0], soft.post.shape[0])
    per_chunk = []
    for lead, chunk in zip(leads, chunks):
        parts = [runner.embed_tokens(torch.tensor(lead))] if lead else []
        parts += [soft.pre.to(runner.dtype)] if m1 else []
        parts.append(runner.embed_tokens(torch.tensor(chunk)))
        parts += [soft.post.to(runner.dtype)] if m2 else []
        h = torch.cat(parts)
        pos = torch.arange(context.n, context.n + h.shape[0])
        rows = Rows(h, pos, {key: rot.cos_sin(pos, runner.dtype) for key, rot in runner.rotaries.items()})
        ks, vs = encode_rows(runner, None, context, rows, len(lead))
        per_chunk.append((ks, vs, pos[len(lead):], torch.tensor([False] * m1 + [True] * len(chunk) + [False] * m2)))
    return ([torch.cat([c[0][layer] for c in per_chunk], 1) for layer in range(runner.n_layers)],
            [torch.cat([c[1][layer] for c in per_chunk], 1) for layer in range(runner.n_layers)],
            torch.cat([c[2] for c in per_chunk]), torch.cat([c[3] for c in per_chunk]))


def student_logits(engine: Engine, soft: SoftTokens | None, ex: Example) -> torch.Tensor:
    """The answer logits of blend served with the soft rows stored around each chunk: they keep
    the chunk's move, so `pre` sits just before the chunk's place and `post` just after it."""
    runner = engine.runner
    E = exact_end(engine, ex.seg)
    exact = exact_kv(runner, ex.ids[:E])
    context = ExactKV([k[:, :ex.seg.exact_end] for k in exact.k], [v[:, :ex.seg.exact_end] for v in exact.v])
    spans = stored_spans(engine, ex.seg)
    chunks = [ex.ids[a:b] for a, b in spans]
    leads = [engine.keys.lead_ids(c) for c in chunks]
    ks, vs, enc_pos, is_chunk = encode(runner, soft, context, chunks, leads)
    m1, m2 = (0, 0) if soft is None else (soft.pre.shape[0], soft.post.shape[0])
    # Every row of a chunk's block moves by the chunk's own delta (its first row was encoded at
    # the context's end + its lead + m1).
    shift = torch.cat([torch.full((m1 + (b - a) + m2,), a - (context.n + len(lead) + m1))
                       for (a, b), lead in zip(spans, leads)])
    moved = [move(runner, layer, k, shift) for layer, k in enumerate(ks)]
    return read_served(engine, ex, exact, moved, vs, enc_pos + shift, "blend", engine.blend_cfg, is_chunk)


@torch.no_grad()
def score(engine: Engine, soft: SoftTokens | None, examples: list[Example]) -> tuple[list[float], list[float]]:
    kls, agree = [], []
    for ex in examples:
        logits = student_logits(engine, soft, ex)
        kls.append(float(topk_kl(ex.logp, ex.idx, logits).mean()))
        agree.append(float((logits.argmax(-1) == ex.idx[:, 0]).float().mean()))
    return kls, agree


def make_engine(model: str) -> Engine:
    engine = training_engine(Settings(model=model))
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    return engine


def cmd_train(args) -> None:
    engine = make_engine(args.model)
    dev, train_set = training_examples(engine, args)
    soft = SoftTokens.from_text(engine, args.m)
    opt = torch.optim.AdamW(soft.parameters(), lr=args.lr, weight_decay=0.0)
    state_path, out = Path(args.out + ".state"), Path(args.out)
    start, log = 0, {"dev": [], "steps": []}
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        soft.load_state_dict(state["soft"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
    if not log["dev"]:
        for name, s in (("none", None), ("untrained", soft)):
            kls, agree = score(engine, s, dev)
            log["dev"].append({"step": 0, "what": name, "kl": statistics.mean(kls), "top1": statistics.mean(agree),
                               "per_prompt": kls})
            print(log["dev"][-1]["what"], round(log["dev"][-1]["kl"], 4), round(log["dev"][-1]["top1"], 3), flush=True)
    best = min(d["kl"] for d in log["dev"] if d["what"] == "none")
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = random.Random(args.seed * 1_000_003 + step).sample(train_set, args.batch)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ex in batch:
            loss = topk_kl(ex.logp, ex.idx, student_logits(engine, soft, ex)).mean() / len(batch)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(soft.parameters(), 1.0)
        opt.step()
        log["steps"].append({"step": step + 1, "loss": total, "seconds": time.perf_counter() - t0})
        print(f"step {step + 1} loss {total:.4f} lr {lr:.2e} {time.perf_counter() - t0:.0f}s", flush=True)
        if (step + 1) % args.dev_every == 0 or step + 1 == args.steps:
            kls, agree = score(engine, soft, dev)
            log["dev"].append({"step": step + 1, "what": "soft", "kl": statistics.mean(kls),
                               "top1": statistics.mean(agree), "per_prompt": kls})
            print(f"dev step {step + 1}: {statistics.mean(kls):.4f} top1 {statistics.mean(agree):.3f}", flush=True)
            if statistics.mean(kls) < best:
                best = statistics.mean(kls)
                save_atomic({"soft": soft.state_dict(), "step": step + 1, "dev_kl": best}, out)
        save_atomic({"soft": soft.state_dict(), "opt": opt.state_dict(), "step": step + 1, "log": log}, state_path)


def cmd_eval(args) -> None:
    engine = make_engine(args.model)
    records = [r for path in args.data for r in load_dataset(path)]
    index_dataset(engine, records)  # the whole file is the collection, as `kvblend eval` indexes it
    scored = records[:args.limit]
    examples = teach(engine, [prompt_ids(engine, r) for r in scored], 16)  # in the file's order, as served
    softs = {"none": None}
    for path in args.soft:
        state = torch.load(path, weights_only=False)["soft"]
        softs[path] = SoftTokens(state["pre"], state["post"])
    base = None
    for name, soft in softs.items():
        t0 = time.perf_counter()
        kls, agree = score(engine, soft, examples)
        base = base or kls
        print(f"{name}: kl {statistics.mean(kls):.3f} median {statistics.median(kls):.3f} top1 "
              f"{statistics.mean(agree):.3f} better {sum(a < b for a, b in zip(kls, base))} worse "
              f"{sum(a > b for a, b in zip(kls, base))} ({time.perf_counter() - t0:.0f}s)", flush=True)
        print("  per prompt", [round(x, 3) for x in kls], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", action="append", required=True)
    t.add_argument("--offset", type=int, default=40)
    t.add_argument("--dev-data", action="append", required=True)
    t.add_argument("--dev-offset", type=int, default=30)
    t.add_argument("--dev-limit", type=int, default=6)
    t.add_argument("--max-tokens", type=int, default=2048)
    t.add_argument("--m", type=int, default=8, help="soft rows before and after each chunk")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--dev-every", type=int, default=5)
    t.add_argument("--seed", type=int, default=5)
    t.add_argument("--out", required=True)
    t.set_defaults(limit=None, dev=8, orders=1, dev_orders=1, positions=16)  # the rest of `adapter train`'s data flags
    e = sub.add_parser("eval")
    e.add_argument("--data", action="append", required=True)
    e.add_argument("--limit", type=int, default=30)
    e.add_argument("--soft", action="append", default=[])
    for p in (t, e):
        p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    args = ap.parse_args()
    torch.manual_seed(0)
    {"train": cmd_train, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
