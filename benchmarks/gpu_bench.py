"""TTFT on a GPU for a model of a real model's shape, with random weights built from its config
(nothing to download): full, prefix, reuse and blend at several ratios, all in one run.

Prompts are a system prompt, `--chunks` chunks of random tokens and a `--question`-token
question, at each of `--lengths` tokens. Also reported, per length:
  - the runner's full prefill against transformers' own forward (SDPA) in the same dtype;
  - peak device memory of each mode;
  - the pipelining condition: one layer's chunk KV copied from pinned host memory to the device
    against one layer's compute of blend's selected rows at the highest ratio;
  - blend's attention over its scattered rows by each way to call it (the runner's own, the CPU's
    calls over runs of key blocks, one call with the key heads repeated, FlexAttention where it
    compiles), timed on one layer.

    python benchmarks/gpu_bench.py --shape llama3-8b --lengths 4096,8192,16384
    python benchmarks/gpu_bench.py --shape tiny --device cpu --lengths 256   # the CI smoke run

Weights are random, so only timings and memory mean anything here; quality is measured on real
models (`kvblend eval`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvblend.blend import loader as loader_mod
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.model.loader import LoadedModel, auto_device, auto_dtype
from kvblend.model import runner as runner_mod
from kvblend.model.runner import Runner, attend, query_groups

SEP = [7, 7, 3]  # a separator no random chunk contains (chunks draw ids >= 10)
SYSTEM = 16  # system prompt tokens

SHAPES = {
    "llama3-8b": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=32768)),
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    "qwen2.5-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    "tiny": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, rope_theta=10000.0, max_position_embeddings=4096)),
}


def build(shape: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The shape's model with random weights, built straight on the device in `dtype`."""
    config_cls, model_cls, kw = SHAPES[shape]
    config = config_cls(**kw, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            hf = model_cls(config)
    finally:
        torch.set_default_dtype(default)
    hf = hf.eval().requires_grad_(False)
    # The fingerprint names the random weights by their seed: hashing 16 GB of them would take minutes.
    return LoadedModel(hf, None, f"random-{shape}", f"random-{shape}-seed0-{dtype}", dtype, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls (after one untimed warm-up) and the last call's result."""
    out, times = fn(), []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def peak_memory(fn, device: torch.device) -> float | None:
    """Peak device memory (GiB) of one call, or None off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def make_prompt(n: int, n_chunks: int, question: int, vocab: int, seed: int) -> list[int]:
    """System prompt, chunks and question joined by SEP, n tokens in all (give or take rounding)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(10, vocab, (k,), generator=g).tolist()  # noqa: E731
    per = max(1, (n - SYSTEM - question - len(SEP) * (n_chunks + 1)) // n_chunks)
    ids = rand(SYSTEM)
    for _ in range(n_chunks):
        ids += SEP + rand(per)
    return ids + SEP + rand(question)


def attention_kernels(runner: Runner, cache, n: int, T: int, ratio: float, device: torch.device,
                      repeats: int, flex: bool) -> dict:
    """Layer 0's attention for blend's rows at `ratio` (random reused rows plus the question) by
    each kernel, in ms, with each one's largest difference from the runner's own."""
    g = torch.Generator().manual_seed(1)
    k_rows = int(ratio * T)
    pos = torch.cat([torch.randperm(T - n, generator=g)[:k_rows], torch.arange(T - n, T)]).sort().values.to(device)
    H, d = runner.n_heads, runner.head_dim
    q = torch.randn(H, pos.numel(), d, generator=g).to(device, runner.dtype)
    k, v = cache.k[0][:, :T], cache.v[0][:, :T]
    scale = runner.layers[0].self_attn.scaling
    out = {"rows": pos.numel(), "keys": T}

    runner_groups = query_groups(pos, T)  # built once per pass in the engine: outside the timing
    one_call = runner_mod.groups_in_one_call
    runner_mod.groups_in_one_call = lambda q_pos: False
    try:
        block_groups = query_groups(pos, T)  # the CPU's: calls over runs of key blocks
    finally:
        runner_mod.groups_in_one_call = one_call

    def runner_kernel():
        return attend(q, k, v, runner_groups, scale)

    def cpu_block_groups():
        return attend(q, k, v, block_groups, scale)

    mask = torch.arange(T, device=device)[None, :] <= pos[:, None]
    rep = H // k.shape[0]

    def one_call_expanded():  # the key heads repeated for every query head they serve
        ke, ve = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        return F.scaled_dot_product_attention(q[None], ke[None], ve[None], attn_mask=mask[None, None], scale=scale)[0]

    kernels = {"runner": runner_kernel, "cpu_block_groups": cpu_block_groups, "one_call_expanded": one_call_expanded}
    if flex and device.type == "cuda":  # compiling takes tens of seconds: at one length only
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            t0 = time.perf_counter()
            flex = torch.compile(flex_attention)
            block = create_block_mask(lambda b, h, qi, ki: ki <= pos[qi], None, None, pos.numel(), T, device=device)

            def flex_call():
                return flex(q[None], k[None], v[None], block_mask=block, scale=scale, enable_gqa=True)[0]

            flex_call()
            sync(device)
            out["flex_compile_s"] = time.perf_counter() - t0
            kernels["flex"] = flex_call
        except Exception as e:  # report, don't fail: the other kernels are still measured
            out["flex_error"] = f"{type(e).__name__}: {e}"[:300]
    ref = runner_kernel().float()
    for name, fn in kernels.items():
        try:
            seconds, o = timed(fn, device, repeats)
            out[f"{name}_ms"] = seconds * 1e3
            out[f"{name}_max_diff"] = float((o.float() - ref).abs().max())
        except Exception as e:
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def layer_costs(runner: Runner, ids: list[int], ratio: float, device: torch.device, repeats: int,
                flex: bool) -> dict:
    """One layer's chunk KV (every chunk's K and V) copied from pinned host memory, against one
    layer's compute of `ratio` of the rows plus the question: CacheBlend's pipelining condition."""
    T = len(ids)
    cache = runner.new_cache(T)
    runner.forward(torch.tensor(ids), torch.arange(T), cache)
    n_chunk = T - SYSTEM  # roughly: every chunk row
    host_k = torch.empty(runner.n_kv_heads, n_chunk, runner.head_dim, dtype=runner.dtype,
                         pin_memory=device.type == "cuda")
    host_v = torch.empty_like(host_k, pin_memory=device.type == "cuda")
    dev_k, dev_v = torch.empty_like(host_k, device=device), torch.empty_like(host_v, device=device)

    def load():
        dev_k.copy_(host_k, non_blocking=True)
        dev_v.copy_(host_v, non_blocking=True)

    g = torch.Generator().manual_seed(2)
    n_q = 64
    sel = torch.cat([torch.randperm(T - n_q, generator=g)[:int(ratio * T)], torch.arange(T - n_q, T)]).sort().values
    rows = runner.rows(torch.tensor(ids, device=device)[sel.to(device)], sel.to(device))

    def compute():
        q, k, v = runner.qkv(1, rows)
        cache.write(1, rows.pos, k, v)
        return runner.finish(1, rows, q, cache)

    with torch.inference_mode():
        load_s, _ = timed(load, device, repeats)
        compute_s, _ = timed(compute, device, repeats)
        kernels = attention_kernels(runner, cache, n_q, T, ratio, device, repeats, flex)
    nbytes = 2 * host_k.nbytes
    return {"kv_layer_mb": nbytes / 1e6, "load_layer_ms": load_s * 1e3, "load_gb_s": nbytes / load_s / 1e9,
            "compute_layer_ms": compute_s * 1e3, "attention": kernels}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="4096,8192,16384")
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--ratios", default="0.05,0.10,0.15")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' forward")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="layers of stored KV read ahead by a thread (the engine's prefetch_depth; 0: inline)")
    ap.add_argument("--cpu-paths", action="store_true",
                    help="attention groups and chunk writes as on the CPU (what the GPU's own paths are "
                         "measured against)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu_bench.json"))
    args = ap.parse_args(argv)
    if args.cpu_paths:
        runner_mod.groups_in_one_call = lambda q_pos: False
        loader_mod.writes_in_batches = lambda cache: False
    device = auto_device(args.device)
    dtype = auto_dtype(args.dtype, device)
    ratios = [float(r) for r in args.ratios.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]

    t0 = time.perf_counter()
    model = build(args.shape, device, dtype)
    print(f"built {args.shape} ({sum(p.numel() for p in model.hf.parameters()) / 1e9:.2f} B parameters, {dtype}) "
          f"on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    # Chunk KV of every length stays in memory.
    settings = Settings(max_local_cpu_size=1000.0, prefetch_depth=args.prefetch_depth)
    engine = Engine(model, settings, sep_ids=SEP)
    runner = engine.runner
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    rows = []
    for n in lengths:
        ids = make_prompt(n, args.chunks, args.question, runner.cfg.vocab_size, seed=n)
        engine.precompute(ids)
        modes = {"full": ("full", None), "prefix": ("prefix", None), "reuse": ("reuse", None)}
        modes.update({f"blend {r:.0%}": ("blend", replace(engine.blend_cfg, ratios=[r])) for r in ratios})
        row = {"length": len(ids)}
        for name, (mode, cfg) in modes.items():
            def run(mode=mode, cfg=cfg):
                return engine.prefill(ids, mode, blend_cfg=cfg)[1]
            seconds, out = timed(run, device, args.repeats)
            row[name] = {"ttft_s": seconds, "peak_gib": peak_memory(run, device),
                         "recomputed": out.stats.recomputed_tokens}
            print(f"{len(ids):6d} {name:10s} {seconds * 1e3:9.1f} ms", flush=True)
        if not args.no_hf:
            def hf():
                return model.hf(input_ids=torch.tensor([ids], device=device), logits_to_keep=1)
            with torch.inference_mode():
                seconds, _ = timed(hf, device, args.repeats)
            row["transformers full"] = {"ttft_s": seconds, "peak_gib": peak_memory(hf, device)}
            print(f"{len(ids):6d} {'hf full':10s} {seconds * 1e3:9.1f} ms", flush=True)
        flex = n == min(lengths, key=lambda m: abs(m - 8192))
        row["layer"] = layer_costs(runner, ids, max(ratios), device, args.repeats, flex)
        print(f"{len(ids):6d} layer: {json.dumps(row['layer'])}", flush=True)
        rows.append(row)

    print_table(rows, ratios, dtype, gpu or "cpu")
    report = {"shape": args.shape, "config": SHAPES[args.shape][2], "device": str(device), "gpu": gpu,
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "chunks": args.chunks,
              "question": args.question, "repeats": args.repeats, "cpu_paths": args.cpu_paths,
              "prefetch_depth": args.prefetch_depth, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}")


def print_table(rows: list[dict], ratios: list[float], dtype: torch.dtype, where: str) -> None:
    blends = [f"blend {r:.0%}" for r in ratios]
    names = ["full", "prefix", "reuse", *blends]
    print(f"\nTTFT in ms ({where}, {str(dtype).removeprefix('torch.')}); speed-up over the runner's full prefill\n")
    print("| tokens | transformers full | " + " | ".join(names) + " | KV layer load / compute (ms) |")
    print("|---:|---:|" + "---:|" * len(names) + "---:|")
    for r in rows:
        full = r["full"]["ttft_s"]
        hf = r.get("transformers full")
        cells = [f"{r[m]['ttft_s'] * 1e3:.1f} ({full / r[m]['ttft_s']:.2f}x)" for m in names]
        lay = r["layer"]
        print(f"| {r['length']} | {hf['ttft_s'] * 1e3:.1f} |" if hf else f"| {r['length']} | - |",
              " | ".join(cells), f"| {lay['load_layer_ms']:.2f} / {lay['compute_layer_ms']:.2f} |")


if __name__ == "__main__":
    main()
