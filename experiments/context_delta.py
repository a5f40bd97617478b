"""Does a chunk's own response to more context predict its stale keys' shift?

Each chunk is stored after the prompt's prefix and a neighbour. Encoding it once more after the
prefix alone gives, per layer and KV head, the mean unrotated key difference "stored minus
prefix-only" (delta): how this chunk's keys move when context is put in front of it. If the shift
that blend's stale keys lack (full prefill's minus the stored, the oracle of key_drift.py) points
the same way, a per-model scale on delta, calibrated once, corrects each chunk in its own
direction from what is known at precompute time.

Calibration (--calib-offset/--calib-limit; --calib-cache keeps it): per layer, the cosine of
delta with each chunk's shift, and the least-squares scale alpha (per layer, and per layer and
chunk index in the prompt), with the share of the shift each explains.
Then, on the scored records, teacher-forced against full's greedy answer:
- `blend r`: the engine as it is;
- `blend r, delta x alpha`: its stale rows, at the layers after the check, shifted by alpha[layer]
  times their chunk's delta (`per index`: alpha[layer, chunk index]);
- `blend r, oracle`: shifted by each chunk's own mean shift (from full prefill; an upper bound).

    python experiments/context_delta.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --calib-offset 50 --calib-limit 10 --offset 36 --limit 6
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from kvblend.blend.encode import encode_chunks
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import prompt_ids

from exact_selected import print_scores
from key_drift import (cached, mean_shift, reused_rows, score_chunk_shifts, score_oracle_shift,
                       scored_record, unrotated)

from kvblend.eval.dev_records import add_record_flags, open_records


@torch.inference_mode()
def chunk_deltas(engine, ids, segs, reuse_cache, reused) -> dict[int, torch.Tensor]:
    """Per chunk index with reused rows: mean unrotated keys, stored minus encoded after the
    prefix alone, over those rows [L, Hkv, d]."""
    runner = engine.runner
    context = engine.keys.context_ids(ids, segs)
    alone = encode_chunks(runner, context, [ids[s:e] for s, e in segs.chunks])
    out = {}
    for i, (span, kv) in enumerate(zip(segs.chunks, alone)):
        local = reused[span[0]:span[1]].nonzero().squeeze(1)
        if local.numel() == 0:
            continue
        rows = local + span[0]
        out[i] = torch.stack([(unrotated(runner, la, reuse_cache.k[la][:, rows], rows)
                               - unrotated(runner, la, kv.k[la][:, local], kv.positions[local])).mean(1)
                              for la in range(runner.n_layers)])
    return out


@torch.inference_mode()
def calibrate(engine, records) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per reused chunk of `records`: its oracle shift and its delta [C, L, Hkv, d], and its index."""
    runner, L = engine.runner, engine.runner.n_layers
    shifts, deltas, index = [], [], []
    for record in tqdm(records, desc="calibration"):
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        _, full = engine.prefill(ids, "full", 0)
        _, reuse = engine.prefill(ids, "reuse", 0)
        segs = engine.segments(ids)
        reused = reused_rows(ids, segs, reuse)
        for i, d in chunk_deltas(engine, ids, segs, reuse.cache, reused).items():
            span = segs.chunks[i]
            rows = torch.arange(*span)[reused[span[0]:span[1]]]
            shifts.append(torch.stack([mean_shift(runner, la, full.cache.k, reuse.cache.k, rows) for la in range(L)]))
            deltas.append(d)
            index.append(i)
    return torch.stack(shifts).cpu(), torch.stack(deltas).cpu(), torch.tensor(index)


def fit(shifts, deltas, index) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """alpha per layer [L], and per chunk index {i: [L]}: least squares of shift on delta."""

    def alpha(sel):
        s, d = shifts[sel], deltas[sel]
        return (s * d).sum((0, 2, 3)) / (d * d).sum((0, 2, 3)).clamp(min=1e-9)

    a = alpha(torch.ones_like(index, dtype=torch.bool))
    by_index = {int(i): alpha(index == i) for i in index.unique()}
    cos = torch.nn.functional.cosine_similarity(shifts, deltas, dim=-1)  # [C, L, H]

    def explained(scale):  # scale [C, L]
        fitted = scale[:, :, None, None] * deltas
        return 1 - ((shifts - fitted) ** 2).sum(-1) / (shifts ** 2).sum(-1).clamp(min=1e-9)

    e_a = explained(a[None].expand(len(index), -1))
    e_i = explained(torch.stack([by_index[int(i)] for i in index]))
    print("layer | mean |shift| | mean |delta| | cos(shift, delta) median | alpha | explained (median): alpha, per index")
    for la in range(shifts.shape[1]):
        print(f"{la:5d} | {shifts[:, la].norm(dim=-1).mean():.3f} | {deltas[:, la].norm(dim=-1).mean():.3f} "
              f"| {cos[:, la].median():.3f} | {a[la]:.3f} | {e_a[:, la].median():.3f}, {e_i[:, la].median():.3f}")
    print("chunk index | chunks | alpha, mean over layers")
    for i, v in by_index.items():
        print(f"{i:11d} | {int((index == i).sum()):6d} | {v.mean():.3f}")
    return a, by_index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=6)
    ap.add_argument("--calib-offset", type=int, default=50)
    ap.add_argument("--calib-limit", type=int, default=10)
    ap.add_argument("--calib-cache", help="a .pt file: the calibration is loaded from it if it exists, else saved")
    ap.add_argument("--ratios", default="0.08")
    ap.add_argument("--scales", default="1", help="scales on the fitted alpha, comma-separated")
    args = ap.parse_args()
    engine, records = open_records(args)
    runner, L = engine.runner, engine.runner.n_layers
    measured = cached(args.calib_cache, lambda: calibrate(
        engine, load_dataset(args.data, limit=args.calib_limit, offset=args.calib_offset)))
    a, by_index = fit(*measured)
    fits = {"delta x alpha": lambda i: a,
            "delta x alpha per index": lambda i: by_index.get(i, by_index[max(by_index)])}
    after = range(min(engine.blend_cfg.check_layers) + 1, L)
    scores: dict[str, list] = {}
    for record in tqdm(records, desc="records"):
        ids, full, segs, score, prefill = scored_record(engine, record, scores)
        reuse = prefill("reuse")
        reused = reused_rows(ids, segs, reuse)
        deltas = chunk_deltas(engine, ids, segs, reuse.cache, reused)
        score("reuse", reuse.cache)
        for r in [float(x) for x in args.ratios.split(",")]:
            blend = prefill("blend", r)
            score(f"blend {r:g}", blend.cache)
            stale = reused.clone()
            stale[torch.tensor(blend.stats.recomputed_positions, dtype=torch.long)] = False
            for s in [float(x) for x in args.scales.split(",")]:
                for name, alpha in fits.items():
                    score_chunk_shifts(runner, prefill, r, segs, stale, after,
                                       {i: s * alpha(i)[:, None, None] * d for i, d in deltas.items()},
                                       f"blend {r:g}, {name} x{s:g}", score)
            score_oracle_shift(runner, prefill, r, segs, stale, full.cache.k, after, score)
    print_scores(args, engine, len(records), scores)


if __name__ == "__main__":
    main()
