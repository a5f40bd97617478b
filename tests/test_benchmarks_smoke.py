"""Every benchmark the docs cite runs as written, with tiny inputs (two demo questions as a dataset,
a few dozen tokens, one repeat), and writes what the docs say it writes. Nothing here reads its
timings or its scores: they only have to be there. So the benchmarks run on a tiny random model
with the default model's tokenizer (KVBLEND_MODEL, or --model where a script takes its own default):
the same code paths as the real model's, at a hundredth of its compute. The real models' claims
are tested in test_default_model.py, test_qwen_model.py and test_gemma_model.py. Each script runs in a
process of its own, forked from a warm interpreter (warm_python.py): a fresh one spent more time on its
imports than the script on its work."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """Two demo questions in the CacheBlend list format that `--data` reads."""
    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    records = [{"question": q["question"], "answers": [q["answer"]],
                "ctxs": [{"title": "", "text": demo["passages"][i]} for i in q["passages"]]}
               for q in demo["questions"][:2]]
    path = tmp_path_factory.mktemp("data") / "tiny.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(autouse=True)
def serve_tiny_model(tiny_model_folder, monkeypatch):
    """Every script started here loads the tiny model where it would load the default one."""
    monkeypatch.setenv("KVBLEND_MODEL", tiny_model_folder)


def script_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def run(warm_python):
    """Runs `python ARGS` in CWD (forked from a warm interpreter), checks it succeeded, returns its stdout."""

    def run_script(args: list[str], cwd: Path) -> str:
        proc = warm_python.run(args, cwd, script_env())
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    return run_script


def bench(name: str) -> str:
    return str(ROOT / "benchmarks" / f"{name}.py")


def test_prefill_bench(run, tiny_model_folder, tmp_path):
    out = tmp_path / "prefill_bench.json"
    run([bench("prefill_bench"), "--model", tiny_model_folder, "--lengths", "48,96", "--dtype", "float32",
         "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [r["length"] for r in result["results"]] == [48, 96]
    assert all(r["runner_s"] > 0 and r["hf_s"] > 0 for r in result["results"])


def test_blend_phases(run, tmp_path, tiny_data):
    out = tmp_path / "phases.json"
    run([bench("blend_phases"), "--data", str(tiny_data), "--limit", "1", "--repeats", "1", "--ratios", "0.08",
         "--dtype", "float32", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["full", "reuse", "blend 0.08"]
    assert result["phases"]["blend 0.08"]["probe: qkv"] > 0 and result["phases"]["full"]["probe: qkv"] == 0


def test_storage_bench(run, tmp_path, tiny_data):
    out = tmp_path / "storage.json"
    run([bench("storage_bench"), "--data", str(tiny_data), "--limit", "1", "--no-quality", "--bandwidths", "100",
         "--dtype", "float32", "--out", str(out), "--plot", str(tmp_path / "storage.png")], tmp_path)
    assert json.loads(out.read_text())["rows"]


def test_redis_cluster_bench(run, tmp_path):
    out = run([bench("redis_cluster_bench"), "--entries", "8", "--chunks", "4", "--prompts", "2"], tmp_path)
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == ["| cluster, capacity server", "| cluster, capacity kept", "| one server, capacity kept"]


def test_peak_rss(run, tiny_model_folder, tmp_path, tiny_data):
    out = run([bench("peak_rss"), "--model", tiny_model_folder, "--data", str(tiny_data), "--length", "160",
               "--dtype", "float32", "--threads", "1"], tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dtype"] == "float32" and 0 < result["tokens"] <= 160
    assert result["loaded_peak_mib"] <= result["after_full_peak_mib"] <= result["after_blend_peak_mib"]


def test_tier_bandwidth(run, tmp_path):
    out = tmp_path / "tiers.json"
    run([bench("tier_bandwidth"), "--tokens", "32", "--layers", "2", "--repeats", "1", "--out", str(out)], tmp_path)
    assert json.loads(out.read_text())["rows"]


def test_chunk_loading(run, tmp_path, tiny_data):
    printed = run([bench("chunk_loading"), "--data", str(tiny_data), "--offset", "0", "--repeats", "1",
                   "--dtype", "float32"], tmp_path)
    assert "into a fresh cache" in printed


def test_offline_batch(run, tmp_path):
    out = tmp_path / "offline.json"
    run([bench("offline_batch"), "--prompts", "3", "--max-tokens", "3", "--repeats", "1", "--dtype", "float32",
         "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert result["outputs_match"] and [r["run"] for r in result["rows"]] == ["one at a time", "batched"]


def test_serve_bench(run, tmp_path):
    out = tmp_path / "serve.json"
    run([bench("serve_bench"), "--requests", "2", "--concurrency", "2", "--streams", "2", "--decode-tokens", "2",
         "--max-tokens", "2", "--passages", "3", "--docs-per-prompt", "2", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["rag"]] == ["full", "prefix", "blend"]


def test_http_yardstick(run, tmp_path, tiny_data):
    """Both orders in process and through the server, and a second replica on a fresh Redis."""
    out = tmp_path / "yardstick.json"
    run([bench("http_yardstick"), "--data", str(tiny_data), "--offset", "0", "--limit", "1", "--answer-tokens", "4",
         "--tf-positions", "2", "--dtype", "float32", "--redis", "--replicas", "2", "--out", str(out)], tmp_path)
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["in-process order", "in-process shuffled", "HTTP order", "HTTP shuffled",
                          "HTTP replica order", "HTTP replica shuffled"]
    for path, row in rows.items():
        assert row["n"] == 1 and 0 <= row["top1_agree"] <= 1 and row["kl_answer_top20"] >= 0
        if path.startswith("HTTP"):  # every passage was posted: blend hit them all, on either replica
            assert row["chunk_misses"] == 0 and row["kl_answer_exact"] is None
            # The same answer forced in one pass over the same KV: in-process logprobs, bit for bit.
            assert row["full_logprobs_as_in_process"] == row["blend_logprobs_as_in_process"] == 1.0
        else:  # the top-20 KL coarse-grains the exact one: never above it
            assert row["kl_answer_top20"] <= row["kl_answer_exact"] + 1e-6
    # Runs over record ranges combine: here the run twice over, so every mean stays and n doubles.
    both = tmp_path / "both.json"
    run([bench("http_yardstick"), "--merge", str(out), str(out), "--out", str(both)], tmp_path)
    merged = {r["path"]: r for r in json.loads(both.read_text())["rows"]}
    assert list(merged) == list(rows)
    for path, row in merged.items():
        assert row["n"] == 2 and row["top1_agree"] == rows[path]["top1_agree"]
        assert row["kl_answer_top20"] == pytest.approx(rows[path]["kl_answer_top20"])
        assert row.get("full_logprobs_as_in_process") == rows[path].get("full_logprobs_as_in_process")


def test_results_renderer_rebuilds_the_marked_tables_and_the_plots(run, tiny_model_folder, tmp_path, tiny_data):
    """`make results` in small: a tiny eval and a tiny blend_phases run, then the renderer over
    a copy of docs/results.md. Only the marked blocks change; the plots are written."""
    results = tmp_path / "results"
    run(["-m", "kvblend.cli", "eval", "--data", str(tiny_data), "--limit", "1", "--modes", "reuse,blend",
         "--ratios", "0.08,0.3", "--answer-tokens", "4", "--tf-positions", "2", "--dtype", "float32",
         "--out", str(results / "eval" / "tiny")], tmp_path)
    run([bench("blend_phases"), "--data", str(tiny_data), "--limit", "1", "--repeats", "1", "--ratios", "0.08",
         "--dtype", "float32", "--out", str(results / "phases" / "tiny.json")], tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    original = (ROOT / "docs" / "results.md").read_text()
    (docs / "results.md").write_text(original)
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())

    run([bench("results"), "--results", str(results), "--docs", str(docs), "--readme", str(readme)], tmp_path)

    text = (docs / "results.md").read_text()
    heldout = text.split("<!-- results:heldout:start -->")[1].split("<!-- results:heldout:end -->")[0]
    assert f"| {tiny_model_folder} | tiny 0-0 |" in heldout and "30%:" in heldout
    phases = text.split("<!-- results:phases:start -->")[1].split("<!-- results:phases:end -->")[0]
    assert "| blend 0.08 |" in phases
    outside = [part.split("<!-- results:")[0] for part in text.split(":end -->")]
    assert outside == [part.split("<!-- results:")[0] for part in original.split(":end -->")]
    table = readme.read_text().split("<!-- results:readme:start -->")[1].split("<!-- results:readme:end -->")[0]
    assert f"| {tiny_model_folder} | tiny 0-0 (" in table and "| blend 30% |" in table
    assert f"{tiny_model_folder} on tiny: float32," in table  # the dtype the run used, not one assumed
    assert readme.read_text().split("<!-- results:readme:start -->")[0] == (ROOT / "README.md").read_text().split(
        "<!-- results:readme:start -->")[0]
    for png in ("frontier.png", "blend_phases.png", "ttft_vs_length.png"):
        assert (docs / "img" / png).read_bytes()[:4] == b"\x89PNG"


EXPERIMENTS = sorted(p.name for p in (ROOT / "experiments").glob("*.py"))


@pytest.mark.parametrize("script", EXPERIMENTS)
def test_experiment_scripts_find_their_imports(script, run, tmp_path):
    """The research scripts are not run here (they need the evaluation data and minutes each), but
    each must still import what it uses, benchmarks/ helpers included, from any directory."""
    assert "usage:" in run([str(ROOT / "experiments" / script), "--help"], tmp_path)


def test_linear_kernels(run, tmp_path):
    out = tmp_path / "kernels.json"
    run([bench("linear_kernels"), "--rows", "8", "--shapes", "0.5B up", "--repeats", "1", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert {"fp32", "int8 (fp32 activations)"} <= {r["format"] for r in rows}
    assert all(r["ms"] > 0 for r in rows)


def test_weights_speed(run, tiny_model_folder, tmp_path):
    out = tmp_path / "speed.json"
    run([bench("weights_speed"), "--model", tiny_model_folder, "--formats", "fp32,bf16-fp32,fp16-fp32",
         "--lengths", "24,40", "--repeats", "1", "--decode-steps", "2", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert set(result["prefill_s"]) == {"fp32", "bf16-fp32", "fp16-fp32"}
    assert set(result["prefill_s"]["fp32"]) == {"24", "40"}
    assert all(s > 0 for s in result["decode_s"].values())


def test_weight_formats(run, tiny_model_folder, tmp_path, tiny_data):
    out = tmp_path / "formats.json"
    run([bench("weight_formats"), "--model", tiny_model_folder, "--data", str(tiny_data), "--limit", "1",
         "--formats", "bf16-fp32", "--dtype", "float32", "--answer-tokens", "4", "--positions", "2", "--out", str(out)],
        tmp_path)
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"bf16-fp32 full", "bf16-fp32 blend"}
    assert 0 <= result["summary"]["bf16-fp32 full"]["kl_answer"] < 1
