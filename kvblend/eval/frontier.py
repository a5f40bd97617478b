"""The quality / speed frontier of an eval: each quality measure against TTFT speed-up over full.

One panel per measure (kl_answer, top1_agree, match_full) and one curve per method: `reuse` is a
point, `blend` a curve over its ratios, `full` the reference at 1x. What matters is quality at a
given speed-up, so a faster blend pass and a better correction compare on one picture. It reads
the rows of the results the report reads (harness -> results -> report and plots).

A row's method is its `method` field when it has one (several blend variants in one results
object), else its mode.
"""

from __future__ import annotations

import math
from pathlib import Path

# (row key, axis label) of each panel, left to right.
PANELS = [
    ("kl_answer", "kl_answer (nats, lower is better)"),
    ("top1_agree", "top1_agree (higher is better)"),
    ("match_full", "match_full (higher is better)"),
]
STYLES = {"full": ("tab:green", "*"), "prefix": ("tab:gray", "D"), "reuse": ("tab:red", "s"),
          "blend": ("tab:blue", "o")}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def method(row: dict) -> str:
    return str(row.get("method") or row.get("mode", "?"))


def speedup(row: dict) -> float | None:
    """Full TTFT / this row's TTFT (the row stores the inverse), or None when unknown."""
    r = row.get("ttft_ratio_vs_full")
    return 1 / r if _number(r) and r > 0 else None


def curves(rows: list[dict], key: str) -> dict[str, list[tuple[float, float, dict]]]:
    """Per method, its (speed-up, value of `key`, row) points in ascending speed-up; rows that
    lack either number are left out."""
    out: dict[str, list[tuple[float, float, dict]]] = {}
    for row in rows:
        x = speedup(row)
        if x is not None and _number(row.get(key)):
            out.setdefault(method(row), []).append((x, float(row[key]), row))
    return {m: sorted(pts, key=lambda p: p[0]) for m, pts in out.items()}


def frontier_figure(results: dict):
    """The figure (a bare matplotlib Figure on the Agg canvas: no pyplot state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    rows = results.get("rows", [])
    fig = Figure(figsize=(14, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    extra = iter(["tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colors: dict[str, tuple[str, str]] = {}
    for ax, (key, label) in zip(axes, PANELS):
        for name, pts in curves(rows, key).items():
            if name not in colors:  # a method named after a mode takes its style; others their own colour
                mode_marker = STYLES.get(str(pts[0][2].get("mode")), ("", "o"))[1]
                colors[name] = STYLES.get(name) or (next(extra, "k"), mode_marker)
            color, marker = colors[name]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker=marker, ls="-" if len(pts) > 1 else "none", color=color, label=name,
                    markersize=11 if marker == "*" else 6)
            for x, y, row in pts:  # name each point of a sweep by its ratio
                if _number(row.get("ratio")) and len(pts) > 1:
                    ax.annotate(f"{row['ratio'] * 100:g}%", (x, y), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color=color)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xlabel("TTFT speed-up over full prefill")
        ax.set_ylabel(label)
        ax.set_title(key)
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no {key} values", transform=ax.transAxes, ha="center", va="center", color="gray")
    meta = results.get("meta", {})
    title = [str(meta[k]) for k in ("dataset", "model") if meta.get(k)]
    title += [f"{k}: {meta[k]}" for k in ("records", "n_prompts", "chunk_context", "neighbour_chunks") if meta.get(k) is not None]
    fig.suptitle("quality against speed   " + "   ".join(title), fontsize=9)
    fig.tight_layout()
    return fig


def write_frontier(results: dict, path: Path) -> Path:
    frontier_figure(results).savefig(path, dpi=120)
    return Path(path)
