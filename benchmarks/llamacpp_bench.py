"""Time to first token on RAG prompts: kvblend (full, prefix, blend) against llama.cpp's full
prefill of the same GGUF and transformers' own forward.

The prompts are MuSiQue passages made into prompts of ~1k, ~4k and ~8k tokens (long_prompts.py),
the same token ids for every system. kvblend's chunks and prefix are stored first, untimed (a RAG
server's steady state), then each prompt is timed through the engine: `full` computes every row,
`prefix` reuses the stored prefix-cache blocks (system prompt, and the first chunk where the
settings store it exact), `blend` reuses every chunk and recomputes its default share of rows.
transformers runs its forward on the same loaded model and dtype (last row's logits only).
llama.cpp runs in its own virtualenv (`--llama-python`, where llama-cpp-python is installed;
it is no kvblend dependency) through llamacpp_worker.py: the same GGUF with its own quantized
weights, the same thread count, flash attention on, a fresh context per prompt, and its best
n_batch among `--n-batch` (all are tried in the first round of each length, the fastest is kept).

TTFT is the time from the start of the prefill to the first token picked (greedy). Systems take
turns within each round and the median of `--repeats` rounds is reported, so that on a shared
machine they see the same load; compare ratios within one run. `--weights auto,int8` times
kvblend in a second weight format too, in the same rounds ("kvblend full (int8)").

    python benchmarks/llamacpp_bench.py --model qwen2.5-coder-0.5b-instruct \\
        --llama-python /tmp/llamacpp/v/bin/python --lengths 1024,4096,8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvblend.engine.engine import Engine
from kvblend.eval.datasets import load_dataset
from kvblend.eval.harness import open_engine
from kvblend.model.loader import DEFAULT_MODEL, resolve_model_path
from blend_phases import cpu_name  # this script's folder is on sys.path
from long_prompts import prompt_of_length

WORKER = Path(__file__).with_name("llamacpp_worker.py")
KVBLEND_MODES = ("full", "prefix", "blend")
LLAMA = "llama.cpp full"
HF = "transformers full"
WARMUP_TOKENS = 256


class LlamaWorker:
    """llamacpp_worker.py in the llama-cpp-python virtualenv, spoken to in JSON lines."""

    def __init__(self, python: str, gguf: Path, threads: int, log_path: Path):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True)
        except OSError as e:
            raise SystemExit(f"--llama-python {python}: cannot run it ({e})") from e
        self.info = self._ask({"gguf": str(gguf), "threads": threads})

    def _ask(self, obj: dict) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the llama.cpp worker stopped (exit {self.proc.returncode}); "
                             f"the end of its log ({self.log_path}):\n{tail}")
        return json.loads(line)

    def ttft(self, ids: list[int], n_batch: int) -> tuple[float, float, int]:
        out = self._ask({"tokens": ids, "n_batch": n_batch})
        return out["seconds"], out["cpu_seconds"], out["token"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


# Each timing is (wall seconds, this process's CPU seconds over all its threads, first token). On a
# shared machine the CPU time is the steadier measure of the work: it leaves out time spent waiting
# for a core (but counts the threads' spin-waits for each other).
def kvblend_ttft(engine: Engine, ids: list[int], mode: str) -> tuple[float, float, int]:
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        _, out = engine.prefill(ids, mode)
        token = int(out.logits.argmax())
        return time.perf_counter() - t0, time.process_time() - c0, token


def hf_ttft(engine: Engine, ids: list[int]) -> tuple[float, float, int]:
    model = engine.model
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        logits = model.hf(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        return time.perf_counter() - t0, time.process_time() - c0, token


def stored_prompts(engine: Engine, records, lengths: list[int]) -> list[list[int]]:
    """The prompts, their chunks and prefix stored ahead of the requests: a RAG server's steady state."""
    prompts = [prompt_of_length(engine.tokenizer, engine.sep_ids, records, n) for n in lengths]
    for ids in prompts:
        engine.precompute(ids)
    return prompts


def gguf_of(model: str, gguf: str | None) -> Path | None:
    if gguf:
        return Path(gguf)
    path = resolve_model_path(model)
    return path if path.suffix == ".gguf" else None


def measure_length(engine: Engine, llama: LlamaWorker | None, ids: list[int], repeats: int, n_batches: list[int],
                   with_hf: bool, others: dict[str, Engine] | None = None) -> dict:
    """Every system once per round, `repeats` rounds; llama.cpp tries each n_batch in round one.
    `others`: engines in more weight formats, by format, timed in the same rounds ("kvblend full (int8)")."""
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    batch_times: dict[int, tuple[float, float]] = {}
    best_batch = None

    def add(name: str, timing: tuple[float, float, int]) -> None:
        samples.setdefault(name, []).append(timing[0])
        cpu.setdefault(name, []).append(timing[1])
        tokens[name] = timing[2]

    # A batch at least as long as the prompt decodes it in one call: larger ones are the same run.
    n_batches = sorted(set(n_batches))
    n_batches = [b for b in n_batches if b < len(ids)] + [b for b in n_batches if b >= len(ids)][:1]
    for r in range(repeats):
        if llama is not None:
            if r == 0:
                timings = {b: llama.ttft(ids, b) for b in n_batches}
                batch_times = {b: t[:2] for b, t in timings.items()}
                best_batch = min(timings, key=lambda b: timings[b][0])
                add(LLAMA, timings[best_batch])
            else:
                add(LLAMA, llama.ttft(ids, best_batch))
        for mode in KVBLEND_MODES:
            add(f"kvblend {mode}", kvblend_ttft(engine, ids, mode))
        for fmt, other in (others or {}).items():
            for mode in KVBLEND_MODES:
                add(f"kvblend {mode} ({fmt})", kvblend_ttft(other, ids, mode))
        if with_hf:
            add(HF, hf_ttft(engine, ids))
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s (cpu {cpu[k][-1]:.1f}s)" for k, v in samples.items()),
              flush=True)
    out = {"tokens": len(ids), "ttft_s": {k: statistics.median(v) for k, v in samples.items()},
           "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
           "samples_s": samples, "cpu_samples_s": cpu, "first_token": tokens}
    if llama is not None:
        out["llama_n_batch"] = best_batch
        out["llama_round1_by_n_batch_s"] = batch_times
    return out


def ratios(row: dict) -> dict:
    """TTFT ratios within the row (wall time), and the main ones in CPU time too."""
    t, c = row["ttft_s"], row["cpu_s"]
    out = {}
    if LLAMA in t:
        for name in ("kvblend full", "kvblend prefix", "kvblend blend", HF):
            if name in t:
                out[f"{LLAMA} / {name}"] = t[LLAMA] / t[name]
        for name in t:  # the other weight formats' full and blend
            if name.startswith(("kvblend full (", "kvblend blend (")):
                out[f"{LLAMA} / {name}"] = t[LLAMA] / t[name]
    out["kvblend full / kvblend blend"] = t["kvblend full"] / t["kvblend blend"]
    if LLAMA in c:
        for name in ("kvblend full", "kvblend blend"):
            out[f"{LLAMA} / {name} (CPU time)"] = c[LLAMA] / c[name]
    return out


def print_table(rows: list[dict], systems: list[str]) -> None:
    head = systems + [k for k in rows[0]["ratios"]]
    print("\n| prompt tokens | " + " | ".join(f"{s} TTFT s" if s in systems else s for s in head) + " |")
    print("|---:|" + "---:|" * len(head))
    for row in rows:
        cells = []
        for s in systems:
            cell = f"{row['ttft_s'][s]:.3f}" if s in row["ttft_s"] else "-"
            if s == LLAMA and s in row["ttft_s"]:
                cell += f" (n_batch {row['llama_n_batch']})"
            cells.append(cell)
        cells += [f"{v:.2f}x" for v in row["ratios"].values()]
        print(f"| {row['tokens']} | " + " | ".join(cells) + " |")


def plot(rows: list[dict], systems: list[str], title: str, path: Path) -> None:
    """TTFT against prompt length, one line per system, log y; beside it the same in CPU seconds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    panels = [("ttft_s", "time to first token (s, log scale)"), ("cpu_s", "CPU seconds of its process (log scale)")]
    for ax, (key, label) in zip(fig.subplots(1, 2), panels):
        for s in systems:
            pts = [(r["tokens"], r[key][s]) for r in rows if s in r.get(key, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="alias or GGUF path, as kvblend takes it")
    ap.add_argument("--gguf", default=None, help="GGUF file for llama.cpp (default: the model's own GGUF)")
    ap.add_argument("--llama-python", default=None,
                    help="python of a virtualenv with llama-cpp-python; llama.cpp is skipped without it")
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--lengths", default="1024,4096,8192", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp alike")
    ap.add_argument("--repeats", default="3",
                    help="rounds per length, one number or one per length (e.g. 3,3,2); medians are reported")
    ap.add_argument("--n-batch", default="512,1024,2048", help="llama.cpp batch sizes to try (n_ubatch too)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto",
                    help="weight formats, comma-separated (auto, fp32, bf16, int8, int4): the first is kvblend's "
                         "main row, each other one is timed in the same rounds")
    ap.add_argument("--no-hf", action="store_true", help="leave out transformers' forward")
    ap.add_argument("--out", type=Path, default=Path("results/llamacpp_bench.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    n_batches = [int(x) for x in args.n_batch.split(",") if x.strip()]
    repeats = [int(x) for x in args.repeats.split(",") if x.strip()]
    repeats = repeats * len(lengths) if len(repeats) == 1 else repeats
    if len(repeats) != len(lengths) or min(repeats) < 1 or args.threads < 1 or not lengths or min(lengths) < 1 \
            or not n_batches or min(n_batches) < 1:
        ap.error("--repeats (one number, or one per length) and --threads must be >= 1, "
                 "--lengths and --n-batch non-empty and positive")
    torch.set_num_threads(args.threads)

    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    engine, *rest = [open_engine(args.model, args.dtype, w) for w in formats or ["auto"]]
    others = {e.model.weights: e for e in rest}
    if engine.model.weights in others or len(others) < len(rest):
        ap.error(f"--weights {args.weights} names one format twice (auto is {engine.model.weights} here)")
    if max(lengths) > engine.max_len:
        ap.error(f"--lengths up to {max(lengths)}: beyond the model's context of {engine.max_len} tokens")
    prompts = stored_prompts(engine, load_dataset(args.data, limit=20), lengths)
    for other in others.values():
        for ids in prompts:
            other.precompute(ids)

    llama, gguf, skipped = None, gguf_of(args.model, args.gguf), None
    if args.llama_python is None:
        skipped = "no --llama-python given"
    elif gguf is None:
        skipped = f"{args.model} is no GGUF file and no --gguf was given"
    if skipped:
        print(f"llama.cpp skipped: {skipped} (give --llama-python with the python of a virtualenv "
              "that has llama-cpp-python)", flush=True)
    else:
        llama = LlamaWorker(args.llama_python, gguf, args.threads, args.out.with_suffix(".llamacpp.log"))
        print(f"llama.cpp {llama.info['version']}: {llama.info['system_info']}", flush=True)

    warm = prompts[0][:WARMUP_TOKENS]
    if llama is not None:
        for b in n_batches:
            llama.ttft(warm, b)
    for e in (engine, *others.values()):
        for mode in KVBLEND_MODES:
            kvblend_ttft(e, warm, mode)
    if not args.no_hf:
        hf_ttft(engine, warm)

    import transformers

    systems = ([LLAMA] if llama is not None else []) + [f"kvblend {m}" for m in KVBLEND_MODES] + \
        [f"kvblend {m} ({f})" for f in others for m in KVBLEND_MODES] + ([] if args.no_hf else [HF])
    dtype = f"{str(engine.model.dtype).removeprefix('torch.')}, {' and '.join([engine.model.weights, *others])} weights"
    cpu = cpu_name()
    plot_path = args.plot or args.out.with_suffix(".png")
    report = {"model": args.model, "gguf": str(gguf) if gguf else None, "dtype": dtype, "cpu": cpu,
              "threads": args.threads, "repeats": repeats, "data": args.data, "torch": torch.__version__,
              "transformers": transformers.__version__, "llama_cpp": llama.info if llama else None,
              "llama_skipped": skipped, "n_batch_tried": n_batches, "systems": systems, "rows": [],
              "plot": str(plot_path), "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n, ids, reps in zip(lengths, prompts, repeats):
        print(f"length {n} ({len(ids)} tokens):", flush=True)
        row = measure_length(engine, llama, ids, reps, n_batches, not args.no_hf, others)
        row["ratios"] = ratios(row)
        report["rows"].append(row)
        # written after every length, so that a long run cut short keeps what it measured
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        plot(report["rows"], systems, f"{Path(args.model).name}: TTFT, {cpu}, kvblend {dtype}", plot_path)
    if llama is not None:
        llama.close()

    print(f"\n{cpu}; kvblend and transformers in {dtype}; llama.cpp on {gguf.name if gguf else '-'}; "
          f"medians of {args.repeats} rounds")
    print_table(report["rows"], systems)
    print(f"\nwrote {args.out} and {plot_path}")
    return report


if __name__ == "__main__":
    main()
