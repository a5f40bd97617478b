"""Quality against TTFT speed-up, one line per configuration, from `kvblend eval` runs: blend at
each ratio (and reuse, at the fast end) with and without a chunk adapter, every point against the
full prefill of its own run.

    python experiments/adapter_frontier.py --title "Qwen2.5-Coder-0.5B-Instruct, HotpotQA 0-29" \\
        --run "no adapter=none-8/results.json,none-30-50/results.json" \\
        --run "adapter=adapter-8/results.json,adapter-30-50/results.json" --out frontier.png
"""

from __future__ import annotations

import argparse
import json

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter


def points(paths: list[str]) -> list[tuple[float, float, float, str]]:
    """(speed-up, kl_answer, top1_agree, label) of every reuse and blend row, fastest first."""
    out = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            if r["mode"] in ("reuse", "blend"):
                label = "reuse" if r["mode"] == "reuse" else f"{r['ratio']:.0%}"
                out[label] = (1 / r["ttft_ratio_vs_full"], r["kl_answer"], r["top1_agree"], label)
    return sorted(out.values(), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=RESULTS[,RESULTS]",
                    help="a configuration's eval results.json files (repeat for each configuration)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    fig = Figure(figsize=(10, 4.2))
    ax_kl, ax_top1 = fig.subplots(1, 2)
    for spec in args.run:
        name, _, files = spec.partition("=")
        pts = points(files.split(","))
        for ax, i in ((ax_kl, 1), (ax_top1, 2)):
            line, = ax.plot([p[0] for p in pts], [p[i] for p in pts], "o-", label=name)
            for p in pts:
                ax.annotate(p[3], (p[0], p[i]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=line.get_color())
        print(name + ": " + ", ".join(f"{p[3]} {p[0]:.1f}x kl {p[1]:.3f} top1 {p[2]:.3f}" for p in pts))
    for ax, label in ((ax_kl, "kl_answer against full (nats)"), (ax_top1, "top1_agree with full")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}x" if x in (2, 3, 5) else ""))
        ax.set_xlabel("TTFT speed-up over full prefill")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
