"""The vLLM benchmarks the docs cite run as written, on SmolLM2 with tiny inputs; nothing reads their timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_data(tmp_path: Path) -> Path:
    """Two records of the CacheBlend format, from the demo's passages."""
    from importlib import resources

    demo = json.loads(resources.files("kvblend.demo").joinpath("passages.json").read_text())
    records = [{"question": q["question"], "answers": [q["answer"]],
                "ctxs": [{"title": "", "text": demo["passages"][i]} for i in q["passages"]]}
               for q in demo["questions"][:2]]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(records))
    return path


def run(script: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run them
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_vllm_bench(tmp_path):
    out = tmp_path / "bench.json"
    run("vllm_bench.py", "--model", "smollm2-135m-instruct", "--data", str(tiny_data(tmp_path)),
        "--lengths", "200", "--repeats", "1", "--quality-limit", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report["rows"][0]["ttft_s"]) == {"vllm", "vllm+kvblend", "kvblend full", "kvblend blend"}
    assert len(report["quality"]["per_record"]) == 1


def test_vllm_serve_bench(tmp_path):
    out = tmp_path / "serve.json"
    run("vllm_serve_bench.py", "--model", "smollm2-135m-instruct", "--data", str(tiny_data(tmp_path)),
        "--requests", "2", "--concurrency", "2", "--max-tokens", "4", "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"vllm", "vllm+kvblend"}
    assert all(run["requests"] == 2 for run in report["runs"].values())
