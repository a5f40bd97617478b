"""Is the stale keys' shift the same for every chunk, so that one vector per layer, measured once
per model on calibration records, could stand for it?

Calibration (--calib-offset/--calib-limit of --calib-data, default the same file; --calib-cache
keeps it for the next run): per layer and KV head, the mean over every reused row of full
prefill's keys minus the stored ones, rotated back to position 0, once over every chunk, once per
chunk index in the prompt, and as a line in the log of the chunk's first position (does the shift
grow with the context in front of a chunk?); printed with how much of each chunk's own mean shift
each explains (1 - |chunk - fit|^2 / |chunk|^2).
Then, on the scored records, teacher-forced against full's greedy answer:
- `blend r`: the engine as it is;
- `blend r, calibrated x s`: its stale rows, at the layers after the check, shifted by s times the
  calibrated vector;
- `blend r, per chunk index x s`: the same with the vector calibrated for the chunk's index in the
  prompt (the last calibrated index stands for any later one);
- `blend r, line in log(start) x s`: the same with the line's vector at the chunk's first position;
- `blend r, oracle`: shifted by each chunk's own mean (from full prefill; an upper bound).

    python experiments/calibrated_shift.py --model qwen2.5-coder-0.5b-instruct \\
        --data ../shared/data/hotpotqa_s.dev.json --calib-offset 50 --calib-limit 20 --offset 36 --limit 12
"""

from __future__ import annotations

import argparse
import math

import torch
from tqdm import tqdm

from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import index_dataset, prompt_ids

from exact_selected import print_scores
from key_drift import (cached, mean_shift, reused_rows, score_chunk_shifts, score_oracle_shift,
                       scored_record)

from kvblend.eval.dev_records import add_record_flags, open_records


@torch.inference_mode()
def calibrate(engine, records) -> tuple[torch.Tensor, ...]:
    """Per reused chunk of `records`: its mean unrotated key shift [C, L, Hkv, d], its reused rows
    (the weights), its index in the prompt and its first position."""
    runner, L = engine.runner, engine.runner.n_layers
    per_chunk, weights, index, starts = [], [], [], []
    for record in tqdm(records, desc="calibration"):
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        _, full = engine.prefill(ids, "full", 0)
        _, reuse = engine.prefill(ids, "reuse", 0)
        segs = engine.segments(ids)
        reused = reused_rows(ids, segs, reuse)
        for i, span in enumerate(segs.chunks):
            rows = torch.arange(*span)[reused[span[0]:span[1]]]
            if rows.numel() == 0:
                continue
            per_chunk.append(torch.stack([mean_shift(runner, la, full.cache.k, reuse.cache.k, rows) for la in range(L)]))
            weights.append(rows.numel())
            index.append(i)
            starts.append(span[0])
    return torch.stack(per_chunk), torch.tensor(weights, dtype=torch.float32), torch.tensor(index), torch.tensor(starts)


def fit(chunks, w, index, starts):
    """The global mean, the mean per chunk index, and a per-element line in log(chunk start)."""

    def mean_of(sel):
        return (chunks[sel] * w[sel, None, None, None]).sum(0) / w[sel].sum()

    g = mean_of(torch.ones_like(index, dtype=torch.bool))
    by_index = {int(i): mean_of(index == i) for i in index.unique()}
    g_idx = torch.stack([by_index[int(i)] for i in index])
    x = torch.log(starts.float())
    X = torch.stack([torch.ones_like(x), x], 1) * w.sqrt()[:, None]  # weighted least squares
    coef = torch.linalg.lstsq(X, chunks.flatten(1) * w.sqrt()[:, None]).solution  # [2, L*H*d]
    line = coef.view(2, *chunks.shape[1:])
    g_pos = line[0] + line[1] * x[:, None, None, None]

    def explained(ref):  # [C, L, H]: 1 - |chunk - ref|^2 / |chunk|^2
        return 1 - ((chunks - ref) ** 2).sum(-1) / (chunks ** 2).sum(-1).clamp(min=1e-9)

    e_g, e_i, e_p = explained(g), explained(g_idx), explained(g_pos)
    print("layer | |global shift| | mean |chunk shift| | share of a chunk's shift explained (median): "
          "global, per chunk index, line in log(start)")
    for la in range(chunks.shape[1]):
        print(f"{la:5d} | {g[la].norm(dim=-1).mean():.3f} | {chunks[:, la].norm(dim=-1).mean():.3f} "
              f"| {e_g[:, la].median():.3f}, {e_i[:, la].median():.3f}, {e_p[:, la].median():.3f}")
    print("chunk index | chunks | mean |shift| over layers and heads")
    for i, v in by_index.items():
        print(f"{i:11d} | {int((index == i).sum()):6d} | {v.norm(dim=-1).mean():.3f}")
    return g, by_index, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=12)
    ap.add_argument("--calib-offset", type=int, default=50)
    ap.add_argument("--calib-limit", type=int, default=20)
    ap.add_argument("--calib-data", help="calibration records' file (default: --data)")
    ap.add_argument("--calib-cache", help="a .pt file: the calibration is loaded from it if it exists, else saved")
    ap.add_argument("--ratios", default="0.08")
    ap.add_argument("--scales", default="0.5,1", help="scales on the calibrated shift, comma-separated")
    args = ap.parse_args()
    engine, records = open_records(args)
    runner, L = engine.runner, engine.runner.n_layers
    calib_data = args.calib_data or args.data

    def calibration():
        if calib_data != args.data:
            index_dataset(engine, load_dataset(calib_data))
        return calibrate(engine, load_dataset(calib_data, limit=args.calib_limit, offset=args.calib_offset))

    measured = cached(args.calib_cache, calibration)
    g, by_index, line = fit(*measured)
    # Each fit's vector [L, Hkv, d] for the chunk at index i spanning `span`.
    fits = {"calibrated": lambda i, span: g,
            "per chunk index": lambda i, span: by_index.get(i, by_index[max(by_index)]),
            "line in log(start)": lambda i, span: line[0] + line[1] * math.log(span[0])}
    check = min(engine.blend_cfg.check_layers)
    after = range(check + 1, L)
    scores: dict[str, list] = {}
    for record in tqdm(records, desc="records"):
        ids, full, segs, score, prefill = scored_record(engine, record, scores)
        reuse = prefill("reuse")
        reused = reused_rows(ids, segs, reuse)
        score("reuse", reuse.cache)
        for r in [float(x) for x in args.ratios.split(",")]:
            blend = prefill("blend", r)
            score(f"blend {r:g}", blend.cache)
            stale = reused.clone()
            stale[torch.tensor(blend.stats.recomputed_positions, dtype=torch.long)] = False
            for s in [float(x) for x in args.scales.split(",")]:
                for name, vector in fits.items():
                    score_chunk_shifts(runner, prefill, r, segs, stale, after,
                                       {i: s * vector(i, span) for i, span in enumerate(segs.chunks)},
                                       f"blend {r:g}, {name} x{s:g}", score)
            score_oracle_shift(runner, prefill, r, segs, stale, full.cache.k, after, score)
    print_scores(args, engine, len(records), scores)


if __name__ == "__main__":
    main()
