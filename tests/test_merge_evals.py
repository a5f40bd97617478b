"""benchmarks/merge_evals.py: record slices of one eval merged into one, weighted by their prompt
counts, and speed-ups taken from another run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from merge_evals import main, merge, take_speed  # noqa: E402

META = dict(model="m", dtype="bfloat16", dataset="d.json", chunk_context="prefix", stale_key_scale=0.7,
            check_layers=[1], device="cuda", threads=16)


def run(n: int, records: str, kl: float, full_s: float, blend_s: float) -> dict:
    rows = [dict(mode="full", ratio=None, n=n, kl_answer=0.0, top1_agree=1.0, ttft_mean_s=full_s,
                 ttft_median_s=full_s, ttft_ratio_vs_full=1.0),
            dict(mode="blend", ratio=0.08, n=n, kl_answer=kl, top1_agree=0.9, ttft_mean_s=blend_s,
                 ttft_median_s=blend_s, ttft_ratio_vs_full=blend_s / full_s)]
    return {"meta": dict(META, n_prompts=n, records=records, mean_prompt_tokens=1000 * n),
            "rows": rows, "answers": {"full": ["a"] * n, "blend 0.08": ["b"] * n},
            "per_prompt": {"full": [{"kl_answer": 0.0}] * n, "blend 0.08": [{"kl_answer": kl}] * n}}


def test_rows_are_weighted_by_prompt_counts_and_the_speed_up_is_a_ratio_of_the_merged_means():
    merged = merge([run(1, "0-0", 0.4, 1.0, 0.5), run(3, "1-3", 0.0, 3.0, 1.0)])
    full, blend = merged["rows"]
    assert blend["n"] == 4 and blend["kl_answer"] == pytest.approx(0.1)
    assert full["ttft_mean_s"] == pytest.approx(2.5) and blend["ttft_mean_s"] == pytest.approx(0.875)
    assert blend["ttft_ratio_vs_full"] == pytest.approx(0.875 / 2.5)  # not the mean of 0.5 and 1/3
    assert "ttft_median_s" not in blend
    assert merged["meta"]["n_prompts"] == 4 and merged["meta"]["records"] == "0-0, 1-3"
    assert merged["meta"]["mean_prompt_tokens"] == 2500
    assert merged["answers"]["blend 0.08"] == ["b"] * 4 and len(merged["per_prompt"]["full"]) == 4


def test_runs_of_another_model_or_other_ratios_are_refused():
    other = run(1, "1-1", 0.1, 1.0, 0.5)
    other["meta"]["model"] = "n"
    with pytest.raises(SystemExit, match="model"):
        merge([run(1, "0-0", 0.1, 1.0, 0.5), other])
    fewer = run(1, "1-1", 0.1, 1.0, 0.5)
    fewer["rows"] = fewer["rows"][:1]
    with pytest.raises(SystemExit, match="ratios"):
        merge([run(1, "0-0", 0.1, 1.0, 0.5), fewer])


def test_speed_comes_from_the_other_run_and_the_meta_says_where_each_was_measured():
    merged = merge([run(2, "0-1", 0.2, 0.1, 0.2)])
    cpu = run(1, "0-0", 0.3, 40.0, 5.0)
    cpu["meta"].update(device="cpu", cpu="AMD EPYC", dtype="float32", threads=2)
    cpu["rows"] = cpu["rows"][:1]  # no blend row: its speed-up is unknown, not the GPU's
    take_speed(merged, cpu)
    full, blend = merged["rows"]
    assert full["ttft_ratio_vs_full"] == 1.0 and full["ttft_mean_s"] == 40.0
    assert blend["ttft_ratio_vs_full"] is None and blend["kl_answer"] == pytest.approx(0.2)
    assert "AMD EPYC, float32, 2 threads" in merged["meta"]["speed_measured_on"]
    assert merged["meta"]["quality_measured_on"].startswith("cuda, bfloat16")


def test_the_command_writes_the_report_and_the_frontier(tmp_path):
    paths = []
    for i, r in enumerate([run(1, "0-0", 0.4, 1.0, 0.5), run(1, "1-1", 0.2, 1.0, 0.25)]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    main([str(p) for p in paths] + ["--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["rows"][1]["kl_answer"] == pytest.approx(0.3)
    assert (tmp_path / "out" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
