"""Training a chunk adapter by self-distillation: the loss is kl_answer, the KL from the model's own
full prefill to blend served with the adapter's chunk KV, at the teacher's answer positions.

Each step takes a batch of prompts. For each: the chunks are encoded with the adapter (autograd
on), blend's own selection runs on that KV (the engine's fusor, no grad: which rows it would
recompute), and the student recomputes those rows, the separators, the suffix and the answer by
the model alone over the adapter's chunk KV (student.py). Every `dev_every` steps the adapter is
scored on dev prompts through the engine's served path itself, and the best one so far is
written to `out`. A checkpoint after every step lets an interrupted run resume where it stopped.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..blend.fusor import BlendConfig, prefill
from ..blend.plan import ChunkRef, Plan
from ..blend.segment import Segments
from ..engine.engine import Engine
from ..eval.harness import forced_logits
from ..model.adapter import ChunkAdapter
from ..store.chunk_kv import ChunkKV
from .data import Example, save_atomic
from .student import ExactKV, encode, exact_kv, move, read, topk_kl


@dataclass
class TrainConfig:
    steps: int = 200
    batch: int = 4  # prompts per step (their gradients are summed before the step)
    lr: float = 1e-3
    warmup: int = 10  # steps of linear warm-up, then cosine decay to lr / 10
    rank: int = 8
    alpha: float = 16.0
    dev_every: int = 25
    seed: int = 0
    # "blend": the student recomputes the rows blend selects, as served; "reuse": none of them.
    student: str = "blend"
    # An adapter file to start from (its rank and alpha): training continues from its weights.
    init: str = ""
    # Prompts longer than this (tokens) compute each chunk's activations again in the backward
    # instead of keeping them: one more forward of each chunk, and a 6k-token prompt fits in a few GB.
    low_memory_above: int = 3072
    # Chunks of a prompt that the gradient reaches, drawn afresh each step (0: all). The others are
    # encoded without autograd: a long prompt's step costs its forward and these chunks' backward.
    grad_chunks: int = 0

    def __post_init__(self):
        if self.student not in ("blend", "reuse"):
            raise ValueError(f"student must be 'blend' or 'reuse', got {self.student!r}")
        if self.grad_chunks < 0:
            raise ValueError(f"grad_chunks must be >= 0, got {self.grad_chunks}")
        for name in ("steps", "batch", "dev_every", "rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class History:
    steps: list[dict] = field(default_factory=list)  # per step: loss, lr, seconds
    dev: list[dict] = field(default_factory=list)  # per dev point: step, kl_answer, top1_agree
    best_step: int = -1
    best_kl: float = math.inf


def exact_end(engine: Engine, seg: Segments) -> int:
    """Rows served exact: the prefix with its separator and, with exact_first_chunk, the first
    chunk with the separator after it (the engine's prefix cache holds it exact)."""
    seps = seg.separators
    if engine.settings.exact_first_chunk and len(seps) > 1 and seg.chunks:
        return seps[1][1]
    return seg.exact_end


def stored_spans(engine: Engine, seg: Segments) -> list[tuple[int, int]]:
    """The chunks served from stored KV: every chunk past the exact rows."""
    E = exact_end(engine, seg)
    return [s for s in seg.chunks if s[0] >= E]


def student_loss(engine: Engine, adapter: ChunkAdapter | None, ex: Example, student: str = "blend",
                 cfg: BlendConfig | None = None, low_memory: bool = False,
                 grad: set[int] | None = None) -> torch.Tensor:
    """Mean KL over the answer positions of blend served with this adapter's chunk KV; `grad`
    names the stored chunks (indices among those encoded) the gradient reaches (default: all)."""
    runner, cfg = engine.runner, cfg or engine.blend_cfg
    E = exact_end(engine, ex.seg)
    context_end = ex.seg.exact_end  # chunks are encoded after the prefix and its separator
    exact = exact_kv(runner, ex.ids[:E])
    context = ExactKV([k[:, :context_end] for k in exact.k], [v[:, :context_end] for v in exact.v])
    spans = stored_spans(engine, ex.seg)
    if not spans:
        raise ValueError("a training prompt needs a chunk after the exact ones")
    chunks = [ex.ids[a:b] for a, b in spans]
    # Each chunk after its neighbour lead in the indexed collection, as the engine precomputes it.
    ks, vs, enc_pos = encode(runner, adapter, context, chunks, [engine.keys.lead_ids(c) for c in chunks], low_memory,
                         grad)
    target = torch.cat([torch.arange(a, b) for a, b in spans]).to(runner.device)
    moved = [move(runner, layer, k, target - enc_pos) for layer, k in enumerate(ks)]
    return topk_kl(ex.logp, ex.idx, read_served(engine, ex, exact, moved, vs, target, student, cfg)).mean()


def read_served(engine: Engine, ex: Example, exact: ExactKV, moved: list[torch.Tensor], vs: list[torch.Tensor],
                target: torch.Tensor, student: str, cfg: BlendConfig,
                chunk_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The answer logits when the stored rows (K moved to `target`) are served: blend's selection
    on the chunk rows, the rest read stale. `chunk_rows` [N] bool marks the stored rows that are a
    chunk's tokens (default: all); any others are read stale and never recomputed."""
    runner, T, E = engine.runner, len(ex.ids), exact.n
    if chunk_rows is None:
        chunk_rows = torch.ones(target.shape[0], dtype=torch.bool)
    chunk_rows = chunk_rows.to(runner.device)
    blending = student == "blend" and any(r > 0 for r in cfg.ratios)
    chosen = selected(engine, ex, exact, [m[:, chunk_rows] for m in moved], [v[:, chunk_rows] for v in vs],
                      cfg) if blending else []
    # Rows the model computes: every row past E that is no stale chunk row, then the answer.
    stale = torch.zeros(T, dtype=torch.bool)
    stale[target[chunk_rows].cpu()] = True
    stale[chosen] = False
    keep = ~chunk_rows
    keep[chunk_rows] = stale[target[chunk_rows].cpu()].to(runner.device)
    rows = [p for p in range(E, T) if not stale[p]]
    n = ex.n_positions
    ids = [ex.ids[p] for p in rows] + ex.answer[: n - 1]
    pos = torch.tensor(rows + list(range(T, T + n - 1)), device=runner.device)
    # Blend computes its check candidates at layer 0, where it then counts stored KV as exact
    # (fusor.prefill); reuse damps stale keys at every layer.
    damp_from = 1 if blending and cfg.weight_by_attention and cfg.check_candidates else 0
    return read(runner, exact, [m[:, keep] for m in moved], [v[:, keep] for v in vs], target[keep], ids, pos, n,
                cfg.stale_key_scale, damp_from)


@torch.no_grad()
def selected(engine: Engine, ex: Example, exact: ExactKV, moved: list[torch.Tensor], vs: list[torch.Tensor],
             cfg: BlendConfig) -> list[int]:
    """The reused rows blend recomputes when it is served this chunk KV: the engine's own prefill
    on a plan whose chunks hold it (no store involved)."""
    runner, E = engine.runner, exact.n
    plan = Plan(torch.tensor(ex.ids), ex.seg, prefix_hit=E,
                prefix_blocks=[((0, E), ChunkKV(torch.stack(exact.k), torch.stack(exact.v), torch.arange(E)))])
    k_all, v_all = torch.stack([m.detach() for m in moved]), torch.stack([v.detach() for v in vs])
    at = 0
    for span in ex.seg.chunks:
        if span[1] <= E:
            plan.chunks.append(ChunkRef(span, "", None, exact=True))
            continue
        n = span[1] - span[0]
        # Stored as if computed at the target positions: the moved K, so the loader moves it by 0.
        kv = ChunkKV(k_all[:, :, at:at + n], v_all[:, :, at:at + n], torch.arange(*span))
        plan.chunks.append(ChunkRef(span, "", kv))
        at += n
    return prefill(runner, plan, "blend", cfg).stats.selected_positions


@torch.no_grad()
def dev_score(engine: Engine, adapter: ChunkAdapter | None, dev: list[Example]) -> dict:
    """kl_answer and top1_agree of blend served by the engine itself with this adapter (None:
    none), against the teacher, on the dev prompts."""
    saved = engine.adapter, engine.keys.adapter
    engine.adapter = adapter
    engine.keys.adapter = adapter.fresh_identity() if adapter is not None else ""
    kls, agree = [], []
    try:
        for ex in dev:
            engine.precompute(ex.ids)
            logits, _ = forced_logits(engine, ex.ids, "blend", None, ex.answer, ex.n_positions)
            kls.append(float(topk_kl(ex.logp, ex.idx, logits).mean()))
            agree.append(float((logits.argmax(-1) == ex.idx[:, 0]).float().mean()))
    finally:
        engine.adapter, engine.keys.adapter = saved
    return {"kl_answer": sum(kls) / len(kls), "top1_agree": sum(agree) / len(agree), "per_prompt": kls}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train(engine: Engine, train_set: list[Example], dev_set: list[Example], out: str | Path,
          checkpoint: str | Path, cfg: TrainConfig, info: dict | None = None, progress: bool = True) -> History:
    """Train (or resume, from `checkpoint` if it exists and was made with the same config) and
    write the adapter that scored best on the dev prompts to `out`."""
    if not train_set or not dev_set:
        raise ValueError("training needs at least one training prompt and one dev prompt")
    checkpoint, out = Path(checkpoint), Path(out)
    adapter = start_adapter(engine, cfg, info)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    history, start = History(), 0
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        # A setting added since the checkpoint was made counts as its default: the run used it.
        if {**asdict(TrainConfig()), **state["config"]} != asdict(cfg):
            raise ValueError(f"checkpoint {checkpoint} was made with other settings ({state['config']}); "
                             "remove it or train with those")
        adapter.load_state_dict(state["adapter"])
        opt.load_state_dict(state["optimizer"])
        history, start = state["history"], state["step"]
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    if start == 0 and not history.dev:  # the model without an adapter (and the one started from): marks to beat
        history.dev.append({"step": 0, **dev_score(engine, None, dev_set)})
        if cfg.init:
            history.dev.append({"step": 0, "init": cfg.init, **dev_score(engine, adapter, dev_set)})
        history.best_kl = min(d["kl_answer"] for d in history.dev)
    bar = tqdm(range(start, cfg.steps), desc="adapter", initial=start, total=cfg.steps, disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = rng.sample(train_set, min(cfg.batch, len(train_set)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        with torch.enable_grad():
            for ex in batch:
                low_memory = len(ex.ids) > cfg.low_memory_above
                loss = student_loss(engine, adapter, ex, cfg.student, low_memory=low_memory,
                                    grad=grad_chunks(engine, ex, cfg.grad_chunks, rng)) / len(batch)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        opt.step()
        history.steps.append({"step": step + 1, "loss": total, "lr": lr_at(step, cfg),
                              "seconds": time.perf_counter() - t0})
        if (step + 1) % cfg.dev_every == 0 or step + 1 == cfg.steps:
            score = dev_score(engine, adapter, dev_set)
            history.dev.append({"step": step + 1, **score})
            if score["kl_answer"] < history.best_kl:
                history.best_kl, history.best_step = score["kl_answer"], step + 1
                best = copy.deepcopy(adapter)
                best.info = {**(info or {}), "step": step + 1, "dev_kl_answer": score["kl_answer"],
                             "dev_kl_answer_without": history.dev[0]["kl_answer"], "train": asdict(cfg)}
                best.save(out)
        bar.set_postfix(loss=f"{total:.4f}", dev=f"{history.dev[-1]['kl_answer']:.4f}")
        _save_checkpoint(checkpoint, adapter, opt, step + 1, history, cfg)
    return history


def grad_chunks(engine: Engine, ex: Example, k: int, rng: random.Random) -> set[int] | None:
    """k of the prompt's stored chunks, at random, for the gradient to reach (None: all)."""
    n = len(stored_spans(engine, ex.seg))
    return None if k == 0 or k >= n else set(rng.sample(range(n), k))


def start_adapter(engine: Engine, cfg: TrainConfig, info: dict | None) -> ChunkAdapter:
    """A fresh adapter, or the weights of `cfg.init` (which must fit the model and have cfg's rank and alpha)."""
    if not cfg.init:
        return ChunkAdapter.for_model(engine.model.config, cfg.rank, cfg.alpha, info, cfg.seed)
    adapter = ChunkAdapter.load(cfg.init)
    adapter.check_fits(engine.model.config)
    if (adapter.rank, adapter.alpha) != (cfg.rank, cfg.alpha):
        raise ValueError(f"{cfg.init} has rank {adapter.rank} and alpha {adapter.alpha}: "
                         f"train it on with --rank {adapter.rank} --alpha {adapter.alpha}")
    return adapter


def _save_checkpoint(path: Path, adapter: ChunkAdapter, opt, step: int, history: History, cfg: TrainConfig) -> None:
    save_atomic({"adapter": adapter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                 "history": history, "config": asdict(cfg)}, path)

