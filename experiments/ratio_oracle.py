"""How much a per-prompt recompute ratio could gain, at most: from a `kvblend eval` results.json
with several blend ratios, an oracle that knows every prompt's kl_answer at every ratio picks one
ratio per prompt, minimising mean KL at no more mean compute than one fixed ratio spends.

No real request knows its KL in advance; this bounds what a run-time signal (the probe's
attention, the check's deviations) could buy by spending recompute where it pays most.

    .venv/bin/python experiments/ratio_oracle.py results/musique0-29-v19/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def allocate(kl: dict[str, list[float]], cost: dict[str, list[float]], lam: float) -> list[str]:
    """Per prompt, the variant minimising kl + lam * cost (one point of the convex frontier)."""
    n = len(next(iter(kl.values())))
    return [min(kl, key=lambda v: kl[v][i] + lam * cost[v][i]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="results.json of a kvblend eval run with several blend ratios")
    ap.add_argument("--steps", type=int, default=4000, help="values of the compute price tried")
    args = ap.parse_args()
    with open(args.results) as f:
        per = json.load(f)["per_prompt"]
    blends = [v for v in per if v.startswith("blend")]
    if len(blends) < 2:
        raise SystemExit(f"{args.results}: needs two or more blend ratios, has {blends}")
    kl = {v: [p["kl_answer"] for p in per[v]] for v in blends}
    top1 = {v: [p["top1_agree"] for p in per[v]] for v in blends}
    cost = {v: [p["recompute_frac"] for p in per[v]] for v in blends}
    n = len(kl[blends[0]])
    # The oracle's frontier, once: (mean compute, mean KL, mean top-1, picks) at each compute price.
    frontier = []
    for step in range(args.steps):
        pick = allocate(kl, cost, step / args.steps * 4)
        frontier.append((statistics.mean(cost[pick[i]][i] for i in range(n)),
                         statistics.mean(kl[pick[i]][i] for i in range(n)),
                         statistics.mean(top1[pick[i]][i] for i in range(n)), pick))
    print("| fixed ratio | kl / top-1 (compute) | oracle per prompt, same compute: kl / top-1 (compute) | ratios picked |")
    print("| --- | --- | --- | --- |")
    for fixed in blends:
        budget = statistics.mean(cost[fixed])
        c, k, t, pick = min((p for p in frontier if p[0] <= budget * 1.001), key=lambda p: p[1])
        picked = ", ".join(f"{v.split()[1]}: {pick.count(v)}" for v in blends if pick.count(v))
        print(f"| {fixed} | {statistics.mean(kl[fixed]):.4f} / {statistics.mean(top1[fixed]):.3f} ({budget:.3f}) "
              f"| {k:.4f} / {t:.3f} ({c:.3f}) | {picked} |")

if __name__ == "__main__":
    main()
