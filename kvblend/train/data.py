"""Training prompts for a chunk adapter and their teacher: the model's own full prefill.

A prompt is built as the engine builds a RAG prompt (system message, passages as chunks, the
question), from a record's passages in a shuffled order, cut to a token budget. The teacher is
the unmodified model: its greedy answer and, at the answer's first positions teacher-forced, its
top-k next-token log-probs. Both are computed once per prompt and kept on disk, so training
resumes without computing them again. No gold answer is read: any questions over the user's own
documents will do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..blend.segment import Segments
from ..engine.engine import Engine
from ..eval.datasets import RagRecord
from ..eval.harness import full_answer, prompt_ids
from ..model.aliases import cache_dir
from ..store.keys import tokens_hash

TOP_K = 64  # teacher log-probs kept per position; the rest of its mass is one tail bucket


@dataclass
class Example:
    ids: list[int]
    seg: Segments
    answer: list[int]  # the teacher's greedy answer
    logp: torch.Tensor  # [n, TOP_K] the teacher's top log-probs at the answer's first n positions
    idx: torch.Tensor  # [n, TOP_K] their vocabulary ids

    @property
    def n_positions(self) -> int:
        return self.logp.shape[0]


def build_prompts(engine: Engine, records: list[RagRecord], max_tokens: int, min_chunks: int = 2,
                  seed: int = 0) -> list[list[int]]:
    """One prompt per record: its passages shuffled, as many as fit in `max_tokens` (at least
    `min_chunks`, else the record is left out)."""
    rng = random.Random(seed)
    prompts = []
    for record in records:
        passages = list(record.passages)
        rng.shuffle(passages)
        while len(passages) >= min_chunks:
            ids = prompt_ids(engine, RagRecord(record.question, record.answers, passages, record.metric, record.task))
            if len(ids) <= max_tokens:
                prompts.append(ids)
                break
            passages.pop()
    return prompts


def teacher_dir(engine: Engine, root: str | Path | None = None) -> Path:
    """Where a model's teacher outputs are kept: under `root` (default: the kvblend cache), by the
    model's fingerprint (its dtype and weight format included), so no other model reads them."""
    return Path(root or cache_dir() / "adapter-teacher") / engine.model.fingerprint


def teach(engine: Engine, prompts: list[list[int]], positions: int = 16, progress: bool = True,
          root: str | Path | None = None) -> list[Example]:
    """Each prompt with its teacher outputs, computed once (full prefill, no adapter) and kept in
    teacher_dir(engine, root)."""
    where = teacher_dir(engine, root)
    where.mkdir(parents=True, exist_ok=True)
    out = []
    for ids in tqdm(prompts, desc="teacher", disable=not progress):
        path = where / f"{tokens_hash(ids)[:32]}-{positions}.pt"
        saved = _load(path)
        if saved is None:
            _, answer, logits = full_answer(engine, ids, positions + 1, positions)
            logp, idx = torch.log_softmax(logits.float(), -1).topk(TOP_K, dim=-1)
            saved = {"answer": answer, "logp": logp, "idx": idx}
            save_atomic(saved, path)
        out.append(Example(ids, engine.segments(ids), saved["answer"], saved["logp"], saved["idx"]))
    return out


def save_atomic(obj, path: Path) -> None:
    """torch.save under a temporary name, then renamed: an interrupted save leaves the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save(obj, tmp)
    tmp.replace(path)


def _load(path: Path) -> dict | None:
    """A cached teacher output, or None where there is none or it cannot be read (it is redone)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        return saved if {"answer", "logp", "idx"} <= set(saved) else None
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed, whatever the damage
        return None
