"""Where blend's error comes from: token rankings (oracles included) at equal recompute counts,
and where the residual error sits (per layer, per position in a chunk, per answer position).

Rankings forced into the recompute set at each ratio, all else equal (check layer, probe):
- `default`: the engine's own selector with the configured settings;
- `default, exact attention`: the same without stale-key damping;
- `plain HKVD`: V deviation at the check layer, no attention weighting, no stale-key damping;
- `oracle: V drift`: the tokens whose stale V is farthest from full prefill's, summed over layers;
- `oracle: full attention`: the attention the suffix pays each token in the full prefill;
- `oracle: full attention x drift`, `probe attention x drift`: those times the true drift;
- `random`.
Oracles read full prefill's own KV, so no real request can use them: they bound what a better
static ranking could buy. Earlier defaults run beside them on plain chunks (precomputed after the
prefix alone, the first chunk stale too), in a second store:
- `plain chunks, exact attention`: the selector without damping, on plain chunks;
- `plain chunks, damped`: the same with that model's plain-chunk damping (the default before
  neighbour-context chunks).
Teacher-forced against full's greedy answer (docs/results.md):

    python experiments/error_sources.py --data ../shared/data/musique_s.dev.json --offset 30 --limit 4
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from kvblend.blend import fusor
from kvblend.blend.select import attention_mass
from kvblend.engine.engine import Engine
from kvblend.eval.harness import forced_logits, full_reference, prompt_ids
from kvblend.eval.metrics import kl_divergence

from kvblend.eval.dev_records import add_record_flags, open_records

FORCED: dict = {}  # "scores": [T] tensor ranking the reused tokens, while a forced variant runs
PROBED: dict = {}  # "attention": the probe's attention mass of the last blend prefill


class ForcedSelector(fusor.Selector):
    """The engine's selector, but ranking candidates by FORCED["scores"] when set."""

    def keep(self, layer, active, k, v, cache):
        if "scores" not in FORCED or layer not in self.checks:
            return super().keep(layer, active, k, v, cache)
        cand = self.reused[active]
        cand_idx = cand.nonzero().squeeze(1)
        keep = ~cand
        n = fusor.n_selected(self.checks[layer], self.n_reused)
        keep[cand_idx[fusor.top_tokens(FORCED["scores"][active[cand_idx]], n)]] = True
        return keep


def _install() -> None:
    fusor.Selector = ForcedSelector
    run_layers = fusor.run_layers

    def recording(*a, watch=None, **kw):
        out = run_layers(*a, watch=watch, **kw)
        if watch is not None:
            PROBED["attention"] = out.attention
        return out
    fusor.run_layers = recording


@torch.inference_mode()
def suffix_attention(engine: Engine, ids: list[int], cache, suffix_start: int) -> torch.Tensor:
    """The attention the suffix rows pay each position in full prefill (its exact cache), summed
    over layers: the suffix recomputed against the full KV reads what full prefill read."""
    runner = engine.runner
    T = len(ids)
    pos = torch.arange(suffix_start, T)
    rows = runner.rows(torch.tensor(ids[suffix_start:]), pos)
    mass = torch.zeros(T)
    for layer in range(runner.n_layers):
        q, _, _ = runner.qkv(layer, rows)
        mass += attention_mass(q, cache.k[layer][:, :T], pos, runner.layers[layer].self_attn.scaling,
                               runner.windows[layer])
        rows.h = runner.finish(layer, rows, q, cache)
    return mass


def drift(a, b, T: int) -> torch.Tensor:
    """Per layer and position, the squared distance between two caches' V: [L, T]."""
    return (a.v[:, :, :T].float() - b.v[:, :, :T].float()).pow(2).sum(dim=(1, 3))


def answer_margin(ref_logits: torch.Tensor) -> torch.Tensor:
    """Full's top-1 minus top-2 log-probability at each answer position: small = a near-tie."""
    top = ref_logits.log_softmax(-1).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_flags(ap, limit=4)
    ap.add_argument("--ratios", default="0.05,0.15,0.3")
    ap.add_argument("--out", default="results/error_sources.json")
    args = ap.parse_args()
    _install()
    engine, records = open_records(args)
    cfg = engine.blend_cfg
    old = Engine(engine.model, engine.settings.model_copy(update={"neighbour_context": False,
                                                                   "exact_first_chunk": False}))
    plain = replace(cfg, weight_by_attention=False, stale_key_scale=1.0, probe_layers=None)
    ratios = [float(r) for r in args.ratios.split(",")]
    scores = defaultdict(list)  # label -> [(kl, top1)]
    layer_err, pos_err, margin_kl = [], defaultdict(list), []
    for record in tqdm(records, desc="records"):
        ids = prompt_ids(engine, record)
        T = len(ids)
        full, answer, ref = full_reference(engine, ids)
        full.cache.truncate(T)
        old.precompute(ids)
        suffix_start = engine.segments(ids).suffix[0]
        _, reuse = engine.prefill(ids, "reuse", 40, blend_cfg=replace(cfg, stale_key_scale=1.0))
        true_drift = drift(full.cache, reuse.cache, T).sum(0).sqrt()
        full_att = suffix_attention(engine, ids, full.cache, suffix_start)
        engine.prefill(ids, "blend", 0)  # the probe's attention under the default settings
        probe_att = PROBED["attention"]
        g = torch.Generator().manual_seed(len(scores["reuse"]))
        rankings = {"oracle: V drift": true_drift, "oracle: full attention": full_att,
                    "oracle: full attention x drift": full_att * true_drift,
                    "probe attention x drift": probe_att * true_drift, "random": torch.rand(T, generator=g)}

        def score(label, mode, blend_cfg, forced=None, by=engine):
            FORCED.clear()
            if forced is not None:
                FORCED["scores"] = forced
            logits, out = forced_logits(by, ids, mode, blend_cfg, answer)
            FORCED.clear()
            kl = kl_divergence(ref, logits)
            scores[label].append((float(kl.mean()), float((logits.argmax(-1) == ref.argmax(-1)).float().mean())))
            return out, kl

        score("reuse", "reuse", replace(cfg, stale_key_scale=1.0))
        score("reuse, plain chunks", "reuse", replace(old.blend_cfg, stale_key_scale=1.0), by=old)
        for r in ratios:
            out, kl = score(f"default {r:g}", "blend", replace(cfg, ratios=[r]))
            if r == ratios[len(ratios) // 2]:  # residual error of the middle ratio, by layer/position/answer
                out.cache.truncate(T)
                d = drift(full.cache, out.cache, T)  # [L, T]
                norm = full.cache.v[:, :, :T].float().pow(2).sum(dim=(1, 3)).mean(1, keepdim=True)
                layer_err.append((d.mean(1) / norm[:, 0]).tolist())
                seg = engine.segments(ids)
                rel = (d / norm).sum(0)
                for a, b in seg.chunks:
                    for name, sl in (("chunk first 8", slice(a, min(a + 8, b))), ("chunk middle", slice(a + 8, b - 8)),
                                     ("chunk last 8", slice(max(b - 8, a), b))):
                        if sl.stop > sl.start:
                            pos_err[name].append(float(rel[sl].mean()))
                    pos_err["chunk nearest the question" if b == seg.chunks[-1][1] else "other chunks"].append(
                        float(rel[a:b].mean()))
                margin_kl += list(zip(answer_margin(ref).tolist(), kl.tolist()))
            score(f"default, exact attention {r:g}", "blend", replace(cfg, ratios=[r], stale_key_scale=1.0))
            score(f"plain chunks, exact attention {r:g}", "blend", replace(old.blend_cfg, ratios=[r], stale_key_scale=1.0), by=old)
            score(f"plain chunks, damped {r:g}", "blend", replace(old.blend_cfg, ratios=[r]), by=old)
            score(f"plain HKVD {r:g}", "blend", replace(plain, ratios=[r]))
            for name, ranking in rankings.items():
                score(f"{name} {r:g}", "blend", replace(cfg, ratios=[r]), ranking)

    rows = [dict(variant=k, kl_answer=statistics.mean(x[0] for x in v), top1_agree=statistics.mean(x[1] for x in v))
            for k, v in scores.items()]
    print(f"\n{args.data}, records {args.offset}-{args.offset + len(records) - 1}, {engine.model.dtype}, settings: "
          f"stale_key_scale={cfg.stale_key_scale}, probe_layers={cfg.probe_layers}")
    print("| ranking | kl_answer | top1_agree |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['kl_answer']:.4f} | {r['top1_agree']:.3f} |")
    per_layer = [statistics.mean(x) for x in zip(*layer_err)]
    print("\nResidual V error of blend at the middle ratio, relative to full's V norm, per layer:")
    print(" ".join(f"{i}:{e:.3f}" for i, e in enumerate(per_layer)))
    print("\nper position (summed over layers):")
    for name, v in pos_err.items():
        print(f"  {name}: {statistics.mean(v):.3f}")
    margin_kl.sort()
    half = len(margin_kl) // 2
    print("\nKL at answer positions where full's top-2 are close (lower half of the margin) vs clear:")
    print(f"  near-ties: kl {statistics.mean(k for _, k in margin_kl[:half]):.4f}; "
          f"clear: kl {statistics.mean(k for _, k in margin_kl[half:]):.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(data=args.data, offset=args.offset, n=len(records), rows=rows,
                                              per_layer=per_layer, per_position={k: statistics.mean(v) for k, v in pos_err.items()},
                                              margin_kl=margin_kl), indent=2))


if __name__ == "__main__":
    main()
