"""Chunk KV precomputed after its most similar chunk (FusionRAG-style), against kvblend's chunks.

kvblend precomputes each chunk after the prompt's exact prefix only, so its stored KV has seen no
other chunk. FusionRAG precomputes a chunk together with chunks it resembles, so that what it
stores already carries some cross-chunk context. This measures that idea before any storage
change: the corpus is every chunk of every record of `--data`; each chunk of a scored record is
encoded after [prefix, its nearest corpus chunk by TF-IDF cosine over token ids (itself
excluded), separator], and only its own rows are stored, with their positions (the loader moves
them as any chunk's). The first chunk keeps its plain KV by default: after the prefix it is
already exact. Reuse and blend are scored on the same teacher-forced answer positions as
`sweep_blend.py`, with kvblend's chunks and with the neighbour-context ones, at each damping scale:

    python benchmarks/neighbour_context.py --data ../shared/data/hotpotqa_s.dev.json --offset 46 \\
        --limit 20 --dtype float32 --ratios 0.08,0.15 --scales 0.35,0.5
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
from dataclasses import replace

import torch
from tqdm import tqdm

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import load_model
from kvblend.store.chunk_kv import ChunkKV
from dev_records import add_record_flags  # this script's folder is on sys.path


class Corpus:
    """Every distinct chunk of the given prompts, with TF-IDF vectors over token ids."""

    def __init__(self, chunks: list[tuple[int, ...]]):
        self.chunks = list(dict.fromkeys(chunks))
        df = collections.Counter(t for c in self.chunks for t in set(c))
        self.idf = {t: math.log(len(self.chunks) / n) for t, n in df.items()}
        self.vecs = [self.vector(c) for c in self.chunks]

    def vector(self, chunk) -> dict[int, float]:
        v = {t: n * self.idf.get(t, 0.0) for t, n in collections.Counter(chunk).items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {t: x / norm for t, x in v.items()}

    def nearest(self, chunk: tuple[int, ...]) -> tuple[int, ...]:
        q = self.vector(chunk)
        sims = [(sum(x * v.get(t, 0.0) for t, x in q.items()), i)
                for i, v in enumerate(self.vecs) if self.chunks[i] != chunk]
        return self.chunks[max(sims)[1]]


@torch.inference_mode()
def store_with_neighbours(engine: Engine, ids: list[int], corpus: Corpus, first_plain: bool) -> int:
    """Store each chunk of the prompt encoded after its nearest corpus chunk; returns how many of
    those neighbours are chunks of this same prompt."""
    seg = engine.segments(ids)
    context, sep = engine.keys.context_ids(ids, seg), list(engine.sep_ids)
    own = {tuple(ids[a:b]) for a, b in seg.chunks}
    in_prompt = 0
    for j, (a, b) in enumerate(seg.chunks):
        if j == 0 and first_plain:
            continue  # engine.precompute stores it plain
        chunk = tuple(ids[a:b])
        neighbour = corpus.nearest(chunk)
        in_prompt += neighbour in own
        before = context + list(neighbour) + sep
        n, C = len(chunk), len(before)
        cache = engine.runner.new_cache(C + n)
        engine.runner.forward(torch.tensor(before + list(chunk)), torch.arange(C + n), cache)
        kv = ChunkKV(cache.k[:, :, C:C + n].clone(), cache.v[:, :, C:C + n].clone(), torch.arange(C, C + n))
        engine.store.put(engine.keys.chunk_key(list(chunk), context), kv)
    engine.precompute(ids)  # the prefix, and what is not stored yet
    return in_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--ratios", default="0.08,0.15", help="blend recompute ratios; reuse is always scored")
    ap.add_argument("--scales", default="0.35", help="stale_key_scale values for the neighbour-context chunks")
    ap.add_argument("--neighbour-first", action="store_true", help="give the first chunk a neighbour too")
    args = ap.parse_args()
    everything = load_dataset(args.data)
    records = everything[args.offset:args.offset + args.limit]
    if not records:
        raise SystemExit(f"no records at offset {args.offset} of {args.data}")
    settings = load_settings(model=args.model, dtype=args.dtype)
    model = load_model(settings.model, dtype=args.dtype)
    plain, fused = Engine(model, settings), Engine(model, settings)  # one model, two stores
    chunks = []
    for r in everything:
        ids = prompt_ids(plain, r)
        chunks += [tuple(ids[a:b]) for a, b in plain.segments(ids).chunks]
    corpus = Corpus(chunks)
    ratios = [0.0] + [float(x) for x in args.ratios.split(",")]
    runs = [("plain", plain, plain.blend_cfg.stale_key_scale)]
    runs += [(f"neighbour s={s}", fused, float(s)) for s in args.scales.split(",")]
    scores, in_prompt, n_chunks = collections.defaultdict(list), 0, 0
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(plain, record)
        _, answer, ref = full_reference(plain, ids)
        in_prompt += store_with_neighbours(fused, ids, corpus, not args.neighbour_first)
        n_chunks += len(plain.segments(ids).chunks) - (0 if args.neighbour_first else 1)
        for name, engine, scale in runs:
            for r in ratios:
                cfg = replace(engine.blend_cfg, stale_key_scale=scale, **({"ratios": [r]} if r else {}))
                logits, _ = forced_logits(engine, ids, "blend" if r else "reuse", cfg, answer)
                top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                scores[name, r].append((float(kl_divergence(ref, logits).mean()), top1))
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {model.dtype}; "
          f"{in_prompt} of {n_chunks} neighbours are chunks of the same prompt")
    print("| chunks | mode | kl_answer | top1_agree |\n| --- | --- | --- | --- |")
    for (name, r), ss in scores.items():
        print(f"| {name} | {'reuse' if not r else f'blend {r:g}'} | {statistics.mean(s[0] for s in ss):.4f} | "
              f"{statistics.mean(s[1] for s in ss):.3f} |")
    plain.close()
    fused.close()


if __name__ == "__main__":
    main()
