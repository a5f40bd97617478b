"""Training a chunk adapter on a dense target instead of kl_answer: each stored chunk's K and V,
made with the adapter after the prefix and its neighbour lead and moved to its place, against the
K and V that the model's own full prefill of the same prompt computed at those rows (squared
error relative to the target's, per layer, K and V alike). One full prefill (no grad) and a few
chunks' encodes (with grad) a prompt, and every row of every layer of those chunks is a target:
far more signal per CPU second than 16 answer positions at the end of a 6k-token blend. The step
is chosen as `kvblend adapter train` chooses it: kl_answer of blend served by the engine on dev
records (their teacher shared with that command's cache).

    python experiments/adapter_kv_match.py --data ../shared/data/musique_s.dev.json \\
        --data ../shared/data/wikimqa_s.dev.json --data ../shared/data/hotpotqa_s.dev.json --offset 40 --limit 60 \\
        --init experiments/adapters/qwen2.5-coder-0.5b-instruct-r4-multihop-orders3-step24.safetensors \\
        --steps 36 --batch 2 --chunks 6 --lr 2e-4 --dev-every 12 --out kvmatch.safetensors

(The dev records default to the --data files' records 30-35.) It did not pay: see the chunk
adapters in docs/experiments.md. The flags, prompts and training loop here serve
adapter_read_match.py too: both train on a proxy and choose the step by blend's served KL.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from soft_tokens import make_engine
from tqdm import tqdm

from kvblend.cli_adapter import prompt_orders
from kvblend.eval.datasets import load_dataset
from kvblend.model.adapter import ChunkAdapter
from kvblend.train.data import save_atomic, teach
from kvblend.train.student import ExactKV, encode, exact_kv, move
from kvblend.train.trainer import TrainConfig, dev_score, lr_at, stored_spans


def kv_loss(engine, adapter: ChunkAdapter, ids: list[int], n_chunks: int, rng: random.Random) -> torch.Tensor:
    """Mean over `n_chunks` of the prompt's stored chunks (drawn at random) and the layers of
    |K - K_full|^2 / |K_full|^2 + the same for V."""
    runner, seg = engine.runner, engine.segments(ids)
    full = exact_kv(runner, ids)
    spans = stored_spans(engine, seg)
    spans = rng.sample(spans, min(n_chunks, len(spans)))
    C = seg.exact_end
    context = ExactKV([k[:, :C] for k in full.k], [v[:, :C] for v in full.v])
    chunks = [ids[a:b] for a, b in spans]
    ks, vs, enc_pos = encode(runner, adapter, context, chunks, [engine.keys.lead_ids(c) for c in chunks],
                         low_memory=True)
    target = torch.cat([torch.arange(a, b) for a, b in spans]).to(runner.device)
    loss = 0.0
    for layer in range(runner.n_layers):
        k = move(runner, layer, ks[layer], target - enc_pos).float()
        kt, vt = full.k[layer][:, target].float(), full.v[layer][:, target].float()
        loss = loss + (k - kt).pow(2).sum() / kt.pow(2).sum() + (vs[layer].float() - vt).pow(2).sum() / vt.pow(2).sum()
    return loss / runner.n_layers


def add_flags(ap: argparse.ArgumentParser, steps: int, batch: int, chunks: int, chunks_help: str) -> None:
    ap.add_argument("--data", action="append", required=True)
    ap.add_argument("--offset", type=int, default=40)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--dev-data", action="append", help="default: the --data files")
    ap.add_argument("--dev-offset", type=int, default=30)
    ap.add_argument("--dev-limit", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--init", required=True, help="the adapter to start from (its rank and alpha)")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch, help="prompts a step")
    ap.add_argument("--chunks", type=int, default=chunks, help=chunks_help)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dev-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", help="default: OUT with .pt")
    ap.add_argument("--start-kl", type=float, help="the start adapter's dev kl_answer, when measured already")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")


def prompts_and_dev(engine, args) -> tuple[list[list[int]], list[list[int]]]:
    """The training and dev prompts of the flags, their chunks indexed as one collection."""
    records = [r for p in args.data for r in load_dataset(p, limit=args.limit, offset=args.offset)]
    dev_records = [r for p in args.dev_data or args.data for r in load_dataset(p, limit=args.dev_limit,
                                                                                offset=args.dev_offset)]
    prompts = prompt_orders(engine, records, args.max_tokens, args.seed, 1)
    dev_prompts = prompt_orders(engine, dev_records, args.max_tokens, args.seed, 1)
    engine.index_collection(dev_prompts + prompts)  # as `kvblend adapter train` indexes them
    return prompts, dev_prompts


def start_adapter(engine, args) -> ChunkAdapter:
    adapter = ChunkAdapter.load(args.init)
    adapter.check_fits(engine.model.config)
    return adapter


def train_on_proxy(engine, adapter: ChunkAdapter, dev: list, args, step_loss: Callable[[random.Random], float],
                   name: str) -> None:
    """Steps of AdamW on `step_loss` (which runs its own backward and returns the loss), resumable
    from the checkpoint; every --dev-every steps the adapter is scored on `dev` and the best one
    written to --out."""
    cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup)
    opt = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=0.0)
    checkpoint = Path(args.checkpoint or Path(args.out).with_suffix(".pt"))
    state = {"step": 0, "dev": [], "losses": []}
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        adapter.load_state_dict(state["adapter"])
        opt.load_state_dict(state["optimizer"])
    elif args.start_kl is not None:  # the start's dev score, measured before on the same dev prompts
        state["dev"].append({"step": 0, "which": "init", "kl_answer": args.start_kl})
    else:
        for which, a in (("none", None), ("init", adapter)):
            _score(engine, a, dev, state, step=0, which=which)
    best = min(d["kl_answer"] for d in state["dev"])
    print(f"best dev KL so far {best:.4f}", flush=True)
    bar = tqdm(range(state["step"], args.steps), initial=state["step"], total=args.steps, desc=name)
    for step in bar:
        t0 = time.perf_counter()
        rng = random.Random(args.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():
            total = step_loss(rng)
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        opt.step()
        state["losses"].append({"step": step + 1, "loss": total, "seconds": time.perf_counter() - t0})
        if (step + 1) % args.dev_every == 0 or step + 1 == args.steps:
            kl = _score(engine, adapter, dev, state, step=step + 1)
            if kl < best:
                best = kl
                keep = copy.deepcopy(adapter)
                keep.info = {**(adapter.info or {}), f"{name}_step": step + 1, "dev_kl_answer": best}
                keep.save(args.out)
        bar.set_postfix(loss=f"{total:.5f}")
        state.update(step=step + 1, adapter=adapter.state_dict(), optimizer=opt.state_dict())
        save_atomic(state, checkpoint)


def _score(engine, adapter: ChunkAdapter | None, dev: list, state: dict, **what) -> float:
    s = dev_score(engine, adapter, dev)
    state["dev"].append({**what, "kl_answer": s["kl_answer"], "top1": s["top1_agree"], "per_prompt": s["per_prompt"]})
    print({k: v for k, v in state["dev"][-1].items() if k != "per_prompt"}, flush=True)
    return s["kl_answer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(ap, steps=40, batch=2, chunks=8, chunks_help="chunks of each prompt in the loss")
    args = ap.parse_args()
    engine = make_engine(args.model)
    prompts, dev_prompts = prompts_and_dev(engine, args)
    dev = teach(engine, dev_prompts, 16)
    adapter = start_adapter(engine, args)
    print(f"{len(prompts)} training prompts, {len(dev)} dev", flush=True)

    def step_loss(rng: random.Random) -> float:
        total = 0.0
        for ids in rng.sample(prompts, args.batch):
            loss = kv_loss(engine, adapter, ids, args.chunks, rng) / args.batch
            loss.backward()
            total += loss.item()
        return total

    train_on_proxy(engine, adapter, dev, args, step_loss, "kv_match")


if __name__ == "__main__":
    main()
