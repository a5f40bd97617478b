"""`kvblend eval`: the modes side by side on a RAG dataset, measured against full prefill.

For each prompt: store its prefix and chunks (untimed: the steady state of a RAG server), run full
prefill and decode its greedy answer A, then for every mode feed A teacher-forced after the mode's
prefill KV and compare next-token distributions with full's (docs/results.md), and let the mode
answer on its own. Prompts are token ids end to end; nothing is decoded and re-tokenized.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from ..blend.fusor import PrefillOutput
from ..blend.segment import rag_prompt_ids
from ..config import load_settings
from ..engine.engine import Engine
from .datasets import RagRecord
from .metrics import gold_score, kl_divergence, rouge_l


@dataclass(frozen=True)
class Variant:
    mode: str
    ratio: float | None = None

    @property
    def label(self) -> str:
        return self.mode if self.ratio is None else f"{self.mode} {self.ratio:g}"


def variants(modes: list[str], ratios: list[float]) -> list[Variant]:
    out = [Variant("full")]
    for mode in modes:
        if mode == "blend":
            out += [Variant("blend", r) for r in ratios]
        elif mode != "full":
            out.append(Variant(mode))
    return out


def open_engine(model: str, dtype: str, weights: str, device: str = "auto", progress: bool = True) -> Engine:
    """An engine on `model` with these dtype and weight settings (benchmarks and experiments)."""
    return Engine.from_settings(load_settings(model=model, dtype=dtype, weights=weights, device=device), progress)


def prompt_ids(engine: Engine, record: RagRecord) -> list[int]:
    """The task's system prompt, the passages as chunks, then its instruction and the question."""
    tail = record.task.instruction + (f"\nQuestion: {record.question}" if record.question else "")
    return rag_prompt_ids(engine.tokenizer, engine.sep_ids, record.task.system, tail, record.passages)


def index_dataset(engine: Engine, records: list[RagRecord]) -> int:
    """Index a dataset's passages as the collection a RAG server would have indexed ahead of
    time (with `neighbour_context`): the whole file, not only the records scored."""
    return engine.index_collection([prompt_ids(engine, r) for r in records])


@torch.inference_mode()
def greedy(engine: Engine, out: PrefillOutput, n_prompt: int, max_tokens: int) -> list[int]:
    out.cache.truncate(n_prompt)
    tokens = [int(out.logits.argmax())]
    while len(tokens) < max_tokens and tokens[-1] not in engine.eos_ids:
        pos = n_prompt + len(tokens) - 1
        logits = engine.runner.forward(torch.tensor(tokens[-1:]), torch.tensor([pos]), out.cache)
        tokens.append(int(logits[0].argmax()))
    return tokens


@torch.inference_mode()
def teacher_forced(engine: Engine, out: PrefillOutput, n_prompt: int, answer: list[int], n: int) -> torch.Tensor:
    """Next-token logits at the first n answer positions: the prefill's last row, then the answer
    tokens as more suffix rows computed fresh against the mode's KV."""
    n = min(n, len(answer))
    out.cache.truncate(n_prompt)
    rows = [out.logits[None]]
    if n > 1:
        fed = torch.tensor(answer[: n - 1])
        rows.append(engine.runner.forward(fed, torch.arange(n_prompt, n_prompt + n - 1), out.cache,
                                          logit_rows=slice(None)))
    return torch.cat(rows)


# Benchmarks score modes as `kvblend eval` does, on shorter answers: full prefill's greedy answer
# (17 tokens) fed teacher-forced, compared at its first 16 positions; the cache keeps room for it.
REFERENCE_CAPACITY = 40


def full_reference(engine: Engine, ids: list[int], answer_tokens: int = 17,
                   positions: int = 16) -> tuple[PrefillOutput, list[int], torch.Tensor]:
    """Precompute the prompt's chunks, then full_answer."""
    engine.precompute(ids)
    return full_answer(engine, ids, answer_tokens, positions)


def full_answer(engine: Engine, ids: list[int], answer_tokens: int = 17,
                positions: int = 16) -> tuple[PrefillOutput, list[int], torch.Tensor]:
    """Full prefill: its output, its greedy answer and the next-token logits at the answer's
    first `positions` positions, teacher-forced."""
    _, full = engine.prefill(ids, "full", REFERENCE_CAPACITY)
    answer = greedy(engine, full, len(ids), answer_tokens)
    return full, answer, teacher_forced(engine, full, len(ids), answer, positions)


def forced_logits(engine: Engine, ids: list[int], mode: str, cfg, answer: list[int],
                  positions: int = 16) -> tuple[torch.Tensor, PrefillOutput]:
    """Prefill in `mode` (with BlendConfig `cfg`, or None for the engine's), then the logits at
    `answer`'s first `positions` positions, teacher-forced against that prefill's KV."""
    _, out = engine.prefill(ids, mode, REFERENCE_CAPACITY, blend_cfg=cfg)
    return teacher_forced(engine, out, len(ids), answer, positions), out


def scored(engine: Engine, ids: list[int], out: PrefillOutput, answer: list[int], ref: torch.Tensor,
           positions: int, answer_tokens: int) -> dict:
    """A prefill `out` of `ids` against a reference's greedy `answer` and its teacher-forced logits
    `ref`: kl_answer, top1_agree, and whether the prefill's own greedy answer is the same."""
    logits = teacher_forced(engine, out, len(ids), answer, positions)
    mine = greedy(engine, out, len(ids), answer_tokens)
    return dict(kl_answer=float(kl_divergence(ref, logits).mean()),
                top1_agree=float((logits.argmax(-1) == ref.argmax(-1)).float().mean()),
                match_full=float(mine == answer), answer=engine.tokenizer.decode(mine, skip_special_tokens=True))


def run_eval(engine: Engine, records: list[RagRecord], modes: list[str], ratios: list[float],
             answer_tokens: int = 32, tf_positions: int = 16, progress: bool = True) -> dict:
    vs = variants(modes, ratios)
    per: dict[Variant, list[dict]] = {v: [] for v in vs}
    lengths = []
    for record in tqdm(records, desc="eval", disable=not progress):
        ids = prompt_ids(engine, record)
        engine.check_ids(ids, answer_tokens)
        lengths.append(len(ids))
        engine.precompute(ids)
        ref_logits, ref_answer = None, None
        for v in vs:
            cfg = replace(engine.blend_cfg, ratios=[v.ratio or 0.0] * len(engine.blend_cfg.check_layers))
            t0 = time.perf_counter()
            _, out = engine.prefill(ids, v.mode, extra_capacity=answer_tokens, blend_cfg=cfg)
            int(out.logits.argmax())
            ttft = time.perf_counter() - t0
            if v.mode == "full":
                ref_answer = greedy(engine, out, len(ids), answer_tokens)
                ref_logits = teacher_forced(engine, out, len(ids), ref_answer, tf_positions)
                answer = ref_answer
                logits = ref_logits
            else:
                logits = teacher_forced(engine, out, len(ids), ref_answer, tf_positions)
                answer = greedy(engine, out, len(ids), answer_tokens)
            kl = kl_divergence(ref_logits, logits)
            text = engine.tokenizer.decode(answer, skip_special_tokens=True)
            ref_text = engine.tokenizer.decode(ref_answer, skip_special_tokens=True)
            per[v].append(dict(
                kl_answer=float(kl.mean()), kl_first=float(kl[0]),
                top1_agree=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                rougeL_vs_full=rouge_l(text, ref_text), match_full=float(answer == ref_answer),
                gold=gold_score(text, record.answers, record.metric), ttft_s=ttft,
                recompute_frac=out.stats.compute_frac, answer=text))
    return summarize(engine, lengths, vs, per)


def summarize(engine: Engine, lengths: list[int], vs: list[Variant], per: dict) -> dict:
    full_ttft = statistics.mean(r["ttft_s"] for r in per[vs[0]])
    rows = []
    for v in vs:
        rs = per[v]
        mean = lambda key: statistics.mean(r[key] for r in rs)  # noqa: E731
        ttft = [r["ttft_s"] for r in rs]
        rows.append(dict(mode=v.mode, ratio=v.ratio, n=len(rs), kl_answer=mean("kl_answer"),
                         top1_agree=mean("top1_agree"), kl_first=mean("kl_first"),
                         rougeL_vs_full=mean("rougeL_vs_full"), match_full=mean("match_full"),
                         gold=mean("gold"), ttft_mean_s=statistics.mean(ttft), ttft_median_s=statistics.median(ttft),
                         ttft_ratio_vs_full=statistics.mean(ttft) / full_ttft, recompute_frac=mean("recompute_frac")))
    s = engine.settings
    meta = dict(n_prompts=len(lengths), model=s.model, dtype=str(engine.model.dtype).removeprefix("torch."),
                device=str(engine.model.device), chunk_context=s.chunk_context,
                neighbour_chunks=len(engine.keys.neighbours or []), neighbour_count=s.neighbour_count,
                exact_first_chunk=s.exact_first_chunk, chunk_adapter=engine.keys.adapter or "none",
                deviation=s.deviation,
                check_layers=list(engine.blend_cfg.check_layers), check_layer_kv=s.check_layer_kv,
                weight_by_attention=s.weight_by_attention, stale_key_scale=engine.blend_cfg.stale_key_scale,
                probe_layers=s.probe_layers, check_candidates=s.check_candidates,
                probe_separators=s.probe_separators, probe_attention_from=s.probe_attention_from,
                probe_suffix_tokens=s.probe_suffix_tokens,
                mean_prompt_tokens=round(statistics.mean(lengths)), threads=torch.get_num_threads())
    per_prompt = {v.label: [{k: r[k] for k in ("ttft_s", "kl_answer", "top1_agree", "recompute_frac")} for r in per[v]]
                  for v in vs}
    return {"meta": meta, "rows": rows, "answers": {v.label: [r["answer"] for r in per[v]] for v in vs},
            "per_prompt": per_prompt}
