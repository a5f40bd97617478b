"""How much does a Hadamard rotation cut int8's error in the MLP's products? Real activations:
fp32 full prefill of dev records, the input of each layer's gate/up and down products captured,
then each product computed in int8 (weights per output channel, bf16 rows per row, as `Int8Linear`)
with and without the block rotation, and in bf16, against the fp32 product. Prints the mean and
worst relative error (Frobenius) over the layers; the rotation block is `Int8Linear`'s.

    python experiments/int8_rotation.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --offset 30 --limit 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import open_engine, prompt_ids
from kvblend.model.weights import hadamard, quantize_rows, rotate, rotation_block


def int8_product(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """x W^T with W int8 per output channel and x int8 per row, both rotated first by Hadamard
    blocks of `block` (0: not rotated), x in bf16 as the engine's bf16 activations are."""
    h = hadamard(block) if block else None
    if h is not None:
        w = rotate(w, h) / block
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    xq, xs = quantize_rows(x.bfloat16(), x.shape[1], h)
    return (xq.float() @ (w / scale[:, None]).round().t()) * xs * scale


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--data", default="../shared/data/hotpotqa_s.dev.json")
    ap.add_argument("--offset", type=int, default=30)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = open_engine(args.model, "float32", "fp32", "cpu", progress=False)
    layers = engine.runner.layers
    inputs: dict[tuple[int, str], list[torch.Tensor]] = {}

    def capture(i: int, product: str):
        def hook(_module, args_):
            inputs.setdefault((i, product), []).append(args_[0].detach().reshape(-1, args_[0].shape[-1]).clone())
        return hook

    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(capture(i, "gate/up"))
        layer.mlp.down_proj.register_forward_pre_hook(capture(i, "down"))
    for record in load_dataset(args.data, offset=args.offset, limit=args.limit):
        engine.prefill(prompt_ids(engine, record), "full", 64)
    errors: dict[str, list[float]] = {}
    for (i, product), xs in inputs.items():
        mlp = layers[i].mlp
        w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) if product == "gate/up" else mlp.down_proj.weight
        block = rotation_block(w.shape[1])
        for x in xs:
            ref = x @ w.t()
            errors.setdefault(f"{product} int8", []).append(relative(int8_product(x, w, 0), ref))
            if block:
                errors.setdefault(f"{product} int8 rotated ({block})", []).append(
                    relative(int8_product(x, w, block), ref))
            errors.setdefault(f"{product} bf16", []).append(relative((x.bfloat16() @ w.bfloat16().t()).float(), ref))
    print(f"{args.model}, {args.data} records {args.offset}-{args.offset + args.limit - 1}, "
          f"relative error of each MLP product against fp32 ({len(layers)} layers)")
    print("| product | mean | worst |\n| --- | ---: | ---: |")
    for label, errs in errors.items():
        print(f"| {label} | {statistics.mean(errs):.4f} | {max(errs):.4f} |")
    return {label: statistics.mean(errs) for label, errs in errors.items()}


if __name__ == "__main__":
    main()
