"""`kvblend adapter train`: a chunk adapter for a model, learned from its own full prefill over the
user's documents and questions (no answers needed: the model is its own teacher)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path


def cmd_train(settings, args) -> int:
    from .eval.machine import cpu_name
    from .model.aliases import cache_dir
    from .train.trainer import TrainConfig, train

    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, rank=args.rank,
                      alpha=args.alpha, dev_every=args.dev_every, seed=args.seed, student=args.student,
                      init=args.init or "", low_memory_above=args.low_memory_above,
                      grad_chunks=args.grad_chunks)
    engine = training_engine(settings)
    dev, train_set = training_examples(engine, args)
    out = Path(args.out)
    checkpoint = Path(args.checkpoint) if args.checkpoint else cache_dir() / "adapter-checkpoints" / f"{out.stem}.pt"
    info = {"model": settings.model, "dtype": str(engine.model.dtype).removeprefix("torch."),
            "data": [str(p) for p in args.data], "offset": args.offset, "prompts": len(train_set),
            "dev_prompts": len(dev), "dev_data": [str(p) for p in args.dev_data or []],
            "orders": args.orders, "dev_offset": args.dev_offset, "dev_orders": args.dev_orders,
            "max_tokens": args.max_tokens,
            "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d")}
    print(f"training a chunk adapter for {settings.model} on {len(train_set)} prompts ({len(dev)} for dev); "
          f"checkpoint {checkpoint}")
    history = train(engine, train_set, dev, out, checkpoint, cfg, info)
    print(json.dumps({"dev": [{k: v for k, v in d.items() if k != "per_prompt"} for d in history.dev],
                      "best_step": history.best_step, "best_kl_answer": history.best_kl}, indent=1))
    if history.best_step < 0:
        print(f"no step beat the model without an adapter on the dev prompts: {out} was not written")
        return 1
    print(f"wrote {out}")
    return 0


def training_engine(settings):
    """The engine an adapter trains in: chunk KV kept in memory, made with no other adapter."""
    import torch

    from .engine.engine import Engine
    from .model.loader import auto_device, auto_dtype, load_model
    from .model.weights import QUANTIZED

    # The engine that trains makes chunk KV with the adapter being trained, never with another one,
    # and keeps it in memory: the adapter changes every step, so its KV is of no use to a store.
    settings = settings.model_copy(update={"chunk_adapter": "none", "local_disk": None, "remote_url": None,
                                           "neighbour_index": None})
    # Gradients flow through the frozen model's layers, which only dense weights carry (an int8
    # product rounds its input); the adapter then serves with whichever format the engine loads.
    if settings.weights in QUANTIZED:
        raise ValueError(f"--weights {settings.weights}: adapters train through dense weights; leave it at auto")
    dtype = auto_dtype(settings.dtype, auto_device(settings.device))
    # weights=auto picks int8 for some models where activations are bf16 (weights.auto_weights).
    weights = "bf16" if settings.weights == "auto" and dtype == torch.bfloat16 else settings.weights
    return Engine(load_model(settings.model, dtype, settings.device, weights), settings)


def training_examples(engine, args) -> tuple[list, list]:
    """The dev and training prompts of `args` (the `adapter train` flags), each with its teacher."""
    from .eval.datasets import load_dataset
    from .train.data import teach

    records = [r for path in args.data for r in load_dataset(path, limit=args.limit, offset=args.offset)]
    dev_records = [r for path in args.dev_data or [] for r in load_dataset(path, limit=args.dev_limit,
                                                                           offset=args.dev_offset)]
    check_disjoint(records, dev_records)
    prompts = prompt_orders(engine, records, args.max_tokens, args.seed, args.orders, "--orders")
    random.Random(args.seed).shuffle(prompts)
    if dev_records:  # the step is chosen on prompts like those served, not on a share of the training mix
        dev_prompts = prompt_orders(engine, dev_records, args.max_tokens, args.seed, args.dev_orders, "--dev-orders")
    else:
        if len(prompts) <= args.dev:
            raise ValueError(f"{len(prompts)} prompts fit in --max-tokens {args.max_tokens}: "
                             f"need more than --dev {args.dev}")
        dev_prompts, prompts = prompts[:args.dev], prompts[args.dev:]
    if not dev_prompts or not prompts:
        raise ValueError(f"{len(prompts)} training and {len(dev_prompts)} dev prompts fit in --max-tokens "
                         f"{args.max_tokens}: need some of each")
    # The prompts' chunks are the collection: each is trained after its neighbour in it, as served.
    engine.index_collection(dev_prompts + prompts)
    examples = teach(engine, dev_prompts + prompts, args.positions, root=args.teacher_dir)
    dev, train_set = examples[:len(dev_prompts)], examples[len(dev_prompts):]
    return dev, train_set


def prompt_orders(engine, records: list, max_tokens: int, seed: int, orders: int,
                  flag: str = "--orders") -> list[list[int]]:
    """Each record's prompt in `orders` passage orders (the same prompt once), order i shuffled
    with seed + i. For training, more prompts from the same documents: each order gives every
    chunk other neighbours and positions. For dev, less noise: a handful of hard prompts sway a
    small dev set's mean, and which prompts are hard moves with the order."""
    from .train.data import build_prompts

    if orders < 1:
        raise ValueError(f"{flag} must be >= 1, got {orders}")
    seen, prompts = set(), []
    for order in range(orders):
        for ids in build_prompts(engine, records, max_tokens, seed=seed + order):
            if tuple(ids) not in seen:
                seen.add(tuple(ids))
                prompts.append(ids)
    return prompts


def check_disjoint(records: list, dev_records: list) -> None:
    """Dev records that also train would choose the step on what it learned: refuse them."""
    def key(r):
        return r.question, tuple(r.passages)
    shared = {key(r) for r in records} & {key(r) for r in dev_records}
    if shared:
        raise ValueError(f"{len(shared)} --dev-data record(s) are also in --data (e.g. {next(iter(shared))[0]!r}): "
                         f"choose the step on records it does not train on (--offset, --dev-offset, --dev-limit)")


def add_parser(sub, add_engine_flags):
    adapter = sub.add_parser("adapter", help="train a chunk adapter for a model")
    asub = adapter.add_subparsers(dest="adapter_command", required=True)
    t = asub.add_parser("train", help="learn a chunk adapter from the model's own full prefill on your documents")
    add_engine_flags(t)
    t.add_argument("--data", action="append", required=True,
                   help="questions over documents: CacheBlend .json, LongBench .jsonl or NQ-open .jsonl(.gz) (repeat)")
    t.add_argument("--offset", type=int, default=0, help="skip each file's first N records (keep them to report on)")
    t.add_argument("--limit", type=int, help="records of each file (default: all)")
    t.add_argument("--orders", type=int, default=1,
                   help="each --data record in this many passage orders (more prompts from the same documents)")
    t.add_argument("--max-tokens", type=int, default=1536, help="prompt length: passages beyond it are left out")
    t.add_argument("--dev", type=int, default=8,
                   help="prompts of --data kept aside to choose the best step on (without --dev-data)")
    t.add_argument("--dev-data", action="append",
                   help="choose the best step on these files' records instead (repeat; none may be in --data)")
    t.add_argument("--dev-offset", type=int, default=0, help="skip each --dev-data file's first N records")
    t.add_argument("--dev-limit", type=int, help="records of each --dev-data file (default: all)")
    t.add_argument("--dev-orders", type=int, default=1,
                   help="each --dev-data record in this many passage orders (more dev prompts, less noise)")
    t.add_argument("--positions", type=int, default=16, help="answer positions the loss compares")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--rank", type=int, default=8)
    t.add_argument("--alpha", type=float, default=16.0)
    t.add_argument("--dev-every", type=int, default=25)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", help="an adapter file to continue training from (its --rank and --alpha)")
    t.add_argument("--student", choices=["blend", "reuse"], default="blend",
                   help="train for blend at the configured ratio (default) or for plain reuse")
    t.add_argument("--low-memory-above", type=int, default=3072,
                   help="prompts longer than this (tokens) recompute chunk activations in the backward: "
                        "one more forward of each chunk, a fraction of the memory")
    t.add_argument("--grad-chunks", type=int, default=0,
                   help="chunks of each prompt the gradient reaches, drawn afresh each step (0: all); "
                        "the others are encoded without autograd, so a long prompt's step costs less")
    t.add_argument("--out", required=True, help="the adapter file written (the dev prompts' best step)")
    t.add_argument("--checkpoint", help="resumable training state (default: in the kvblend cache, by --out's name)")
    t.add_argument("--teacher-dir", help="where the teacher's outputs are kept (default: the kvblend cache); "
                   "beside --checkpoint, a run resumed on another machine does not compute them again")
    return adapter
