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

from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import index_dataset, prompt_ids
from kvblend.model.loader import load_model
from kvblend.model.runner import Rows
from kvblend.train.data import Example, build_prompts, save_atomic, teach
from kvblend.train.student import ExactKV, _attend, _mask, exact_kv, move, read, topk_kl
from kvblend.train.trainer import exact_end, selected


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
    ks, vs, pos_all, is_chunk = [[] for _ in range(runner.n_layers)], [[] for _ in range(runner.n_layers)], [], []
    m1 = 0 if soft is None else soft.pre.shape[0]
    m2 = 0 if soft is None else soft.post.shape[0]
    for lead, chunk in zip(leads, chunks):
        C, L = context.n, len(lead)
        emb = runner.embed_tokens
        parts = [emb(torch.tensor(lead))] if lead else []
        if m1:
            parts.append(soft.pre.to(runner.dtype))
        parts.append(emb(torch.tensor(chunk)))
        if m2:
            parts.append(soft.post.to(runner.dtype))
        h = torch.cat(parts)
        pos = torch.arange(C, C + h.shape[0])
        rows = Rows(h, pos, {key: rot.cos_sin(pos, runner.dtype) for key, rot in runner.rotaries.items()})
        k_pos = torch.cat([torch.arange(C), pos])
        for layer in range(runner.n_layers):
            q, k, v = runner.qkv(layer, rows)
            ks[layer].append(k[:, L:])
            vs[layer].append(v[:, L:])
            if layer == runner.n_layers - 1:
                break
            mask = _mask(pos, k_pos, runner.windows[layer])
            keys, values = torch.cat([context.k[layer], k], 1), torch.cat([context.v[layer], v], 1)
            rows.h = runner.after_attention(layer, rows.h, _attend(runner, layer, q, keys, values, mask))
        pos_all.append(pos[L:])
        is_chunk.append(torch.tensor([False] * m1 + [True] * len(chunk) + [False] * m2))
    return ([torch.cat(k, 1) for k in ks], [torch.cat(v, 1) for v in vs], torch.cat(pos_all), torch.cat(is_chunk))


def student_logits(engine: Engine, soft: SoftTokens | None, ex: Example) -> torch.Tensor:
    """The answer logits of blend served with the soft rows stored around each chunk: they keep
    the chunk's move, so `pre` sits just before the chunk's place and `post` just after it."""
    runner, cfg = engine.runner, engine.blend_cfg
    T, E = len(ex.ids), exact_end(engine, ex)
    exact = exact_kv(runner, ex.ids[:E])
    context = ExactKV([k[:, :ex.seg.exact_end] for k in exact.k], [v[:, :ex.seg.exact_end] for v in exact.v])
    spans = [s for s in ex.seg.chunks if s[0] >= E]
    chunks = [ex.ids[a:b] for a, b in spans]
    ks, vs, enc_pos, is_chunk = encode(runner, soft, context, chunks, [engine.keys.lead_ids(c) for c in chunks])
    m1 = 0 if soft is None else soft.pre.shape[0]
    lead_len = [len(engine.keys.lead_ids(c)) for c in chunks]
    # Every row of a chunk's block moves by the chunk's own delta.
    m2 = 0 if soft is None else soft.post.shape[0]
    C = context.n  # a chunk's first row was encoded at C + its lead + m1
    shift = torch.cat([torch.full((m1 + (b - a) + m2,), a - (C + L + m1)) for (a, b), L in zip(spans, lead_len)])
    target = enc_pos + shift
    moved = [move(runner, layer, k, shift) for layer, k in enumerate(ks)]
    chosen = selected(engine, ex, exact, [m[:, is_chunk] for m in moved], [v[:, is_chunk] for v in vs], cfg)
    stale = torch.zeros(T, dtype=torch.bool)
    stale[target[is_chunk]] = True
    stale[chosen] = False
    keep = ~is_chunk
    keep[is_chunk] = stale[target[is_chunk]]
    rows = [p for p in range(E, T) if not stale[p]]
    n = ex.n_positions
    ids = [ex.ids[p] for p in rows] + ex.answer[: n - 1]
    pos = torch.tensor(rows + list(range(T, T + n - 1)))
    damp_from = 1 if cfg.weight_by_attention and cfg.check_candidates else 0
    return read(runner, exact, [m[:, keep] for m in moved], [v[:, keep] for v in vs], target[keep], ids, pos, n,
                cfg.stale_key_scale, damp_from)


@torch.no_grad()
def score(engine: Engine, soft: SoftTokens | None, examples: list[Example]) -> tuple[list[float], list[float]]:
    kls, agree = [], []
    for ex in examples:
        logits = student_logits(engine, soft, ex)
        kls.append(float(topk_kl(ex.logp, ex.idx, logits).mean()))
        agree.append(float((logits.argmax(-1) == ex.idx[:, 0]).float().mean()))
    return kls, agree


def make_engine(model: str) -> Engine:
    settings = Settings(model=model, chunk_adapter="none", local_disk=None, remote_url=None, neighbour_index=None)
    engine = Engine(load_model(settings.model, settings.dtype, settings.device, settings.weights), settings)
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    return engine


def cmd_train(args) -> None:
    engine = make_engine(args.model)
    records = [r for path in args.data for r in load_dataset(path, offset=args.offset)]
    dev_records = [r for path in args.dev_data for r in load_dataset(path, limit=args.dev_limit,
                                                                      offset=args.dev_offset)]
    prompts = build_prompts(engine, records, args.max_tokens, seed=args.seed)
    random.Random(args.seed).shuffle(prompts)
    dev_prompts = build_prompts(engine, dev_records, args.max_tokens, seed=args.seed)
    engine.index_collection(dev_prompts + prompts)
    examples = teach(engine, dev_prompts + prompts, 16)
    dev, train_set = examples[:len(dev_prompts)], examples[len(dev_prompts):]
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
