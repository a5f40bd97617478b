"""Chunk KV precomputed after its most similar chunk (FusionRAG-style), against plain chunks.

With `neighbour_context` (the default), kvblend precomputes each chunk of a known collection
after [prefix, its most similar other chunk of the collection, separator] (`blend/neighbours.py`),
so what it stores already carries some cross-chunk context; plain chunks have seen only the
prefix. This scores both on the same teacher-forced answer positions as `sweep_blend.py`: the
collection is every record of `--data` (as `kvblend eval` indexes it), reuse and blend at each
ratio, the neighbour chunks at each damping scale. `--other-records` indexes every record but the
scored one, so that no neighbour comes from the prompt itself: the worst case for a neighbour's
text leaking into a chunk's KV.

    python experiments/neighbour_context.py --data ../shared/data/hotpotqa_s.dev.json --offset 46 \
        --limit 20 --dtype float32 --ratios 0.08,0.15 --scales 0.35,0.5
"""

from __future__ import annotations

import argparse
import collections
import statistics
from dataclasses import replace

from tqdm import tqdm

from kvblend.blend.neighbours import NeighbourIndex
from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence
from kvblend.model.loader import load_model

from kvblend.eval.dev_records import add_record_flags


def outside_index(engine: Engine, others: list[list[int]], own: list[list[int]]) -> NeighbourIndex:
    """The chunks of `others` indexed as usual, then each of `own` given its nearest chunk of
    `others` only."""
    base = NeighbourIndex()
    base.add([ids[a:b] for ids in others for a, b in engine.segments(ids).chunks])
    at = {tuple(c): j for j, c in enumerate(base.chunks)}
    neighbour = []
    for chunk in own:
        one = NeighbourIndex(list(base.chunks), list(base.neighbour))
        one.add([chunk])
        found = one.neighbour_of(chunk)
        neighbour.append(at[tuple(found)] if found is not None else -1)
    return NeighbourIndex(base.chunks + own, base.neighbour + neighbour)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--ratios", default="0.08,0.15", help="blend recompute ratios; reuse is always scored")
    ap.add_argument("--scales", default="0.35", help="stale_key_scale values for the neighbour-context chunks")
    ap.add_argument("--other-records", action="store_true",
                    help="index every record but the scored one, so no neighbour comes from its own prompt")
    ap.add_argument("--exact-first", choices=("on", "off", "both"), default="on",
                    help="store each chunk exact as a prompt's first chunk (exact_first_chunk); both: "
                         "neighbour chunks scored each way")
    args = ap.parse_args()
    everything = load_dataset(args.data)
    records = everything[args.offset:args.offset + args.limit]
    if not records:
        raise SystemExit(f"no records at offset {args.offset} of {args.data}")
    settings = load_settings(model=args.model, dtype=args.dtype)
    model = load_model(settings.model, dtype=args.dtype)
    # One model, a store each: kvblend's plain chunks, and chunks precomputed after their
    # neighbours (with and without each chunk stored exact as a prompt's first).
    exact = {"on": [True], "off": [False], "both": [True, False]}[args.exact_first]
    plain = Engine(model, settings.model_copy(update={"neighbour_context": False, "exact_first_chunk": exact[0]}))
    fused = {e: Engine(model, settings.model_copy(update={"neighbour_context": True, "neighbour_index": None,
                                                        "exact_first_chunk": e})) for e in exact}
    prompts = [prompt_ids(plain, r) for r in everything]
    if not args.other_records:
        first, *others = fused.values()
        first.index_collection(prompts)  # the whole file, as index_dataset does for kvblend eval
        index = first.keys.neighbours
        for engine in others:
            engine.use_neighbours(index)
    ratios = [0.0] + [float(x) for x in args.ratios.split(",")]
    runs = [("plain", plain, plain.blend_cfg.stale_key_scale)]
    runs += [(f"neighbour s={s}" + (f", first {'exact' if e else 'stale'}" if len(exact) > 1 else ""), engine,
              float(s)) for s in args.scales.split(",") for e, engine in fused.items()]
    scores, in_prompt, n_chunks = collections.defaultdict(list), 0, 0
    for i in tqdm(range(args.offset, args.offset + len(records)), desc="records"):
        ids = prompts[i]
        own = [ids[a:b] for a, b in plain.segments(ids).chunks]
        if args.other_records:  # stored entries stay valid: a key names its neighbour
            index = outside_index(plain, prompts[:i] + prompts[i + 1:], own)
            for engine in fused.values():
                engine.use_neighbours(index)
        _, answer, ref = full_reference(plain, ids)
        for engine in fused.values():
            engine.precompute(ids)
        found = [index.neighbour_of(c) for c in own]
        in_prompt += sum(n is not None and n in own for n in found)
        n_chunks += sum(n is not None for n in found)
        for name, engine, scale in runs:
            for r in ratios:
                cfg = replace(engine.blend_cfg, stale_key_scale=scale, **({"ratios": [r]} if r else {}))
                logits, _ = forced_logits(engine, ids, "blend" if r else "reuse", cfg, answer)
                top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                scores[name, r].append((float(kl_divergence(ref, logits).mean()), top1))
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {model.dtype}; "
          f"{in_prompt} of {n_chunks} chunks' neighbours are chunks of the same prompt")
    print("| chunks | mode | kl_answer | top1_agree |\n| --- | --- | --- | --- |")
    for (name, r), ss in scores.items():
        print(f"| {name} | {'reuse' if not r else f'blend {r:g}'} | {statistics.mean(s[0] for s in ss):.4f} | "
              f"{statistics.mean(s[1] for s in ss):.3f} |")
    for engine in (plain, *fused.values()):
        engine.close()


if __name__ == "__main__":
    main()
