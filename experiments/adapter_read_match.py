"""Training a chunk adapter on what the question reads, one chunk at a time, instead of kl_answer
through a whole blend: a cheaper signal per CPU second for long prompts.

The teacher is the model's own full prefill of the prompt and its greedy answer, kept per prompt:
every row's K and V at every layer, and for the reader rows (the question and the teacher-forced
answer) their queries, their attention outputs and the log-sum-exp of their attention logits.
The student puts one stored chunk, made with the adapter after the prefix and its neighbour lead
and moved to its place, in place of full prefill's K and V at that chunk's rows; the rows blend
would recompute there keep full prefill's (the chunk rows the reader rows attend to most, as many
as blend's ratio and floor give the prompt), and the others are damped as served. With full
prefill's queries, each layer's attention output of the reader rows is then recomputed over that
KV, which only needs the chunk's own logits: the rest of the attention is full prefill's, known
from its log-sum-exp. The loss is that output's error after o_proj, relative to the output's
size, averaged over layers. A step costs the chosen chunks' encodes and their backward, not a
6k-token blend; the step is chosen as `kvblend adapter train` chooses it, by kl_answer of blend
served by the engine on dev records.

    python experiments/adapter_read_match.py --data ../shared/data/hotpotqa_s.dev.json \\
        --data ../shared/data/musique_s.dev.json --data ../shared/data/wikimqa_s.dev.json \\
        --offset 40 --limit 40 --use 48 --teacher-dir experiments/adapters/checkpoints/long-teacher \\
        --init experiments/adapters/qwen2.5-coder-0.5b-instruct-r4-multihop-orders3-step24.safetensors \\
        --steps 30 --batch 4 --chunks 2 --lr 2e-4 --dev-every 10 --out readmatch.safetensors

(The dev records default to the --data files' records 30-35.) `--probe 0,1,45,80` trains nothing: it
prints, for those prompts (indices into the --data prompts in file order), the loss summed over
their stored chunks without an adapter and with --init, and on how many chunks --init is lower.
See the chunk adapters in docs/experiments.md for what it gave.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from adapter_kv_match import add_flags, prompts_and_dev, start_adapter, train_on_proxy
from soft_tokens import make_engine

from kvblend.model.adapter import ChunkAdapter
from kvblend.store.keys import tokens_hash
from kvblend.train.data import Example, save_atomic, teach
from kvblend.train.student import ExactKV, encode, exact_kv, move
from kvblend.train.trainer import stored_spans


@torch.no_grad()
def reader_teacher(engine, ex: Example) -> dict:
    """Full prefill of the prompt and the teacher-forced answer: K, V of every row, per layer the
    reader rows' queries, attention outputs (before o_proj) and log-sum-exp, and the stored chunk
    rows blend would recompute (`fresh`)."""
    runner = engine.runner
    if any(w is not None for w in runner.windows):
        raise ValueError("reader teachers assume no sliding-window layers")
    n = ex.n_positions
    ids = ex.ids + ex.answer[:n - 1]
    full = exact_kv(runner, ids)
    start, T = ex.seg.suffix[0], len(ids)
    rows = runner.rows(torch.tensor(ids[start:]), torch.arange(start, T))
    group = runner.n_heads // runner.n_kv_heads
    causal = torch.arange(T)[None, :] <= rows.pos[:, None]
    qs, outs, lses, mass = [], [], [], torch.zeros(T)
    for layer in range(runner.n_layers):
        q, _, _ = runner.qkv(layer, rows)
        K = full.k[layer].repeat_interleave(group, 0).float()
        V = full.v[layer].repeat_interleave(group, 0).float()
        s = (q.float() @ K.transpose(1, 2)) * runner.layers[layer].self_attn.scaling
        s = s.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = (s - lse[..., None]).exp()
        o = p @ V
        mass += p.sum((0, 1))
        qs.append(q)
        outs.append(o)
        lses.append(lse)
        rows.h = runner.after_attention(layer, rows.h, o.to(rows.h.dtype))
    return {"k": torch.stack(full.k), "v": torch.stack(full.v), "q": torch.stack(qs),
            "o": torch.stack(outs), "lse": torch.stack(lses), "fresh": recomputed_rows(engine, ex, mass)}


def recomputed_rows(engine, ex: Example, mass: torch.Tensor) -> torch.Tensor:
    """[T] bool: the stored chunk rows blend would recompute, approximated by the reader rows'
    attention in full prefill (blend ranks by the question's attention too), as many as the
    engine's ratio and floor give this prompt."""
    spans = stored_spans(engine, ex.seg)
    stored = torch.cat([torch.arange(a, b) for a, b in spans])
    cfg = engine.blend_cfg
    count = min(len(stored), max(cfg.min_recompute_tokens, math.ceil(cfg.ratios[-1] * len(stored))))
    chosen = stored[mass[stored].topk(count).indices]
    out = torch.zeros(mass.shape[0], dtype=torch.bool)
    out[chosen] = True
    return out


def chunk_read_loss(engine, adapter: ChunkAdapter, ex: Example, t: dict, span: tuple[int, int]) -> torch.Tensor:
    """The reader rows' attention-output error, after o_proj and relative to the output's size,
    averaged over layers, when one chunk's stored KV (made with the adapter) stands in for full
    prefill's at its rows, the rows blend would recompute (`t["fresh"]`) excepted."""
    runner, cfg = engine.runner, engine.blend_cfg
    a, b = span
    C = ex.seg.exact_end
    context = ExactKV([k[:, :C] for k in t["k"]], [v[:, :C] for v in t["v"]])
    chunk = ex.ids[a:b]
    ks, vs, enc_pos = encode(runner, adapter, context, [chunk], [engine.keys.lead_ids(chunk)])
    target = torch.arange(a, b)
    stale = ~t["fresh"][a:b]
    group = runner.n_heads // runner.n_kv_heads
    log_scale = math.log(cfg.stale_key_scale)
    total = 0.0
    for layer in range(runner.n_layers):
        k_t, v_t = t["k"][layer][:, a:b].float(), t["v"][layer][:, a:b].float()
        k_s = torch.where(stale[None, :, None], move(runner, layer, ks[layer], target - enc_pos).float(), k_t)
        v_s = torch.where(stale[None, :, None], vs[layer].float(), v_t)
        q, lse, o = t["q"][layer].float(), t["lse"][layer], t["o"][layer]
        scale = runner.layers[layer].self_attn.scaling
        # Full prefill's share of this chunk, then the student's in its place (damped where stale).
        p_t = ((q @ k_t.repeat_interleave(group, 0).transpose(1, 2)) * scale - lse[..., None]).exp()
        s_s = (q @ k_s.repeat_interleave(group, 0).transpose(1, 2)) * scale - lse[..., None]
        if layer >= 1 and log_scale != 0:  # layer 0's stored KV counts as exact (fusor.prefill)
            s_s = s_s + torch.where(stale, log_scale, 0.0)
        p_s = s_s.exp()
        rest = o - p_t @ v_t.repeat_interleave(group, 0)
        o_s = (rest + p_s @ v_s.repeat_interleave(group, 0)) / (1 - p_t.sum(-1) + p_s.sum(-1))[..., None]
        w = runner.layers[layer].self_attn.o_proj.weight.float()
        total = total + F.linear(_heads_joined(o_s - o), w).pow(2).sum() / F.linear(_heads_joined(o), w).pow(2).sum()
    return total / runner.n_layers


def _heads_joined(x: torch.Tensor) -> torch.Tensor:
    """[H, n, d] -> [n, H * d], o_proj's input."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


class Teachers:
    """Each prompt's reader teacher, computed on first use and kept on disk."""

    def __init__(self, engine, where: Path):
        self.engine, self.where = engine, where
        where.mkdir(parents=True, exist_ok=True)

    def __call__(self, ex: Example) -> dict:
        path = self.where / f"{tokens_hash(ex.ids)[:32]}.pt"
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception as e:  # noqa: BLE001 - a damaged file is computed again
                print(f"{path}: {e}; computing it again", flush=True)
        # K and V stay in the runner's dtype: the loss takes this chunk's share out of the outputs,
        # which were computed from exactly these values.
        t = reader_teacher(self.engine, ex)
        save_atomic(t, path)
        return t


@torch.no_grad()
def probe(engine, teachers: Teachers, adapter: ChunkAdapter, examples: list[Example]) -> None:
    """Per prompt: the loss summed over its stored chunks without an adapter and with `adapter`."""
    for ex in examples:
        t = teachers(ex)
        spans = stored_spans(engine, ex.seg)
        none = [float(chunk_read_loss(engine, None, ex, t, s)) for s in spans]
        used = [float(chunk_read_loss(engine, adapter, ex, t, s)) for s in spans]
        print(f"{len(ex.ids)} tokens, {len(spans)} stored chunks: no adapter {sum(none):.5f}, "
              f"adapter {sum(used):.5f}, lower with it on {sum(w < n for n, w in zip(none, used))}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(ap, steps=30, batch=4, chunks=2, chunks_help="stored chunks of each prompt in the loss")
    ap.add_argument("--use", type=int, help="train on the first N prompts (after a shuffle); all are indexed")
    ap.add_argument("--teacher-dir", help="the prompts' kl_answer teachers (default: the kvblend cache)")
    ap.add_argument("--reader-dir", default="/tmp/kvblend-reader-teacher", help="the reader teachers")
    ap.add_argument("--probe", help="comma-separated prompt indices: compare no adapter and --init, train nothing")
    args = ap.parse_args()
    engine = make_engine(args.model)
    prompts, dev_prompts = prompts_and_dev(engine, args)
    teachers = Teachers(engine, Path(args.reader_dir) / engine.model.fingerprint)
    adapter = start_adapter(engine, args)
    if args.probe:
        probe(engine, teachers, adapter, teach(engine, [prompts[int(i)] for i in args.probe.split(",")], 16,
                                               root=args.teacher_dir))
        return
    random.Random(args.seed).shuffle(prompts)
    dev = teach(engine, dev_prompts, 16, root=args.teacher_dir)
    train_set = teach(engine, prompts[:args.use], 16, root=args.teacher_dir)
    print(f"{len(train_set)} training prompts, {len(dev)} dev", flush=True)

    def step_loss(rng: random.Random) -> float:
        total = 0.0
        for ex in rng.sample(train_set, min(args.batch, len(train_set))):
            t = teachers(ex)
            spans = stored_spans(engine, ex.seg)
            chosen = rng.sample(spans, min(args.chunks, len(spans)))
            for span in chosen:
                loss = chunk_read_loss(engine, adapter, ex, t, span) / (args.batch * len(chosen))
                loss.backward()
                total += loss.item()
        return total

    train_on_proxy(engine, adapter, dev, args, step_loss, "read_match")


if __name__ == "__main__":
    main()
