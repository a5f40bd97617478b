"""kvblend inside vLLM: time to first token and quality of vLLM with kvblend's connector, against
vLLM alone and kvblend's own engine, on the same RAG prompts. Run it in the vLLM venv (.venv-vllm).

Four systems, one run, each at the machine's defaults:
- vLLM alone: its full prefill (prefix cache off, so every prompt is computed);
- vLLM with the connector: kvblend's blend on vLLM's layers, written into vLLM's cache;
- kvblend's engine: full prefill and blend, on the same token ids.
Prompts: MuSiQue passages made into prompts of each `--lengths` (long_prompts.py), with their
chunks stored ahead untimed (kvblend's engine precomputes them into a disk tier the connector
reads: a RAG server's steady state). vLLM and kvblend's engine take turns in each round; the median
of `--repeats` rounds is reported. TTFT in vLLM is a one-token request's wall time.

Quality, on records `--offset`.. of `--data`: vLLM alone's greedy answer A (17 tokens) is the
reference. The connector's next-token distributions at A's first 16 positions come from requests
whose prompt is the record's prompt and A's first tokens (those rows computed fresh over the
blended KV, as in `kvblend eval`); vLLM alone's from one request's prompt logprobs. kl_answer
compares their top-20 logprobs (kvblend.eval.metrics.kl_listed, a lower bound of the exact KL);
top1 the most likely tokens. kvblend's own blend is scored the same way against its own full prefill.

    .venv-vllm/bin/python benchmarks/vllm_bench.py --model qwen2.5-coder-0.5b-instruct \\
        --lengths 2048,4096,8192 --quality-limit 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache per vLLM: an 8k prompt needs 0.1
# Every vLLM on the same cores as kvblend's engine: by default vLLM binds its worker to the cores it
# does not reserve for its scheduler, and it reserves one more where a KV connector is configured, so
# on a small machine vLLM alone and vLLM with the connector would run on different thread counts.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")

import torch  # noqa: E402

from kvblend.config import load_settings  # noqa: E402
from kvblend.engine.engine import Engine  # noqa: E402
from kvblend.eval.datasets import load_dataset  # noqa: E402
from kvblend.eval.harness import forced_logits, full_answer, index_dataset, prompt_ids  # noqa: E402
from kvblend.eval.metrics import kl_listed, top_logprobs  # noqa: E402
from kvblend.model.loader import hf_folder  # noqa: E402
from blend_phases import cpu_name  # noqa: E402 - this script's folder is on sys.path
from long_prompts import prompt_of_length  # noqa: E402

TOP = 20  # logprobs vLLM lists per position (its maximum)
ANSWER_TOKENS, POSITIONS = 17, 16
# One special token per model family keeps its id inside text that vLLM tokenizes whole.
SEPARATORS = {"qwen2": "<|file_sep|>", "llama": "<file_sep>"}


def vllm_engine(folder: Path, dtype: str, max_len: int, connector: dict | None):
    from vllm import LLM

    kw = dict(model=str(folder), dtype=dtype, max_model_len=max_len, enforce_eager=True, enable_prefix_caching=False,
              disable_log_stats=True)
    if connector is not None:
        kw["kv_transfer_config"] = connector
    return LLM(**kw)


def one_token(llm, ids: list[int], logprobs: int | None = None, max_tokens: int = 1):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - t0, out


def listed(logprobs: dict) -> dict[int, float]:
    return {int(t): lp.logprob for t, lp in logprobs.items()}


def vllm_reference(llm, ids: list[int]) -> tuple[list[int], list[dict]]:
    """vLLM alone: greedy answer A and the top-20 logprobs at its first POSITIONS positions."""
    from vllm import SamplingParams, TokensPrompt

    _, out = one_token(llm, ids, max_tokens=ANSWER_TOKENS)
    answer = list(out.token_ids)
    n = min(POSITIONS, len(answer))
    fed = ids + answer[:n]
    res = llm.generate([TokensPrompt(prompt_token_ids=fed)],
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP), use_tqdm=False)[0]
    return answer, [listed(res.prompt_logprobs[len(ids) + i]) for i in range(n)]


def vllm_forced(llm, ids: list[int], answer: list[int], n: int) -> list[dict]:
    """Through the connector: the distribution after the prompt and A's first i tokens, i < n."""
    return [listed(one_token(llm, ids + answer[:i], logprobs=TOP)[1].logprobs[0]) for i in range(n)]


def kvblend_quality(engine: Engine, ids: list[int]) -> dict:
    """kvblend's own blend against its own full prefill, on the top-20 lists as for vLLM."""
    _, answer, ref = full_answer(engine, ids, ANSWER_TOKENS, POSITIONS)
    logits, _ = forced_logits(engine, ids, "blend", None, answer, POSITIONS)
    ref_tops = [top_logprobs(ref[i], TOP, answer[i]) for i in range(ref.shape[0])]
    tops = [top_logprobs(logits[i], TOP, answer[i]) for i in range(ref.shape[0])]
    return scores(ref_tops, tops)


def scores(ref_tops: list[dict], tops: list[dict]) -> dict:
    return dict(kl_answer=statistics.mean(kl_listed(p, q) for p, q in zip(ref_tops, tops)),
                top1_agree=statistics.mean(float(max(p, key=p.get) == max(q, key=q.get)) for p, q in zip(ref_tops, tops)))


def kvblend_ttft(engine: Engine, ids: list[int], mode: str) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        _, out = engine.prefill(ids, mode)
        int(out.logits.argmax())
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a kvblend alias (vLLM loads its folder)")
    ap.add_argument("--data", default="../shared/data/musique_s.dev.json")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--offset", type=int, default=0, help="first record scored for quality")
    ap.add_argument("--quality-limit", type=int, default=10, help="records scored for quality (0: none)")
    ap.add_argument("--dtype", default="auto", help="as kvblend's auto picks it for this CPU, for every system")
    ap.add_argument("--out", type=Path, default=Path("results/vllm_bench.json"))
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]

    store = tempfile.mkdtemp(prefix="kvblend-vllm-bench-")
    folder = hf_folder(args.model)
    probe = load_settings(model=args.model)
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(folder).model_type
    separator = os.environ.get("KVBLEND_SEPARATOR") or SEPARATORS.get(model_type, probe.separator)
    settings = load_settings(model=args.model, dtype=args.dtype, separator=separator, local_disk=store)
    engine = Engine.from_settings(settings, progress=False)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    records = load_dataset(args.data, limit=max(20, args.offset + args.quality_limit))
    prompts = [prompt_of_length(engine.tokenizer, engine.sep_ids, records, n) for n in lengths]
    scored = records[args.offset: args.offset + args.quality_limit]
    index_dataset(engine, records)  # the collection indexed as a RAG server would have it (neighbour context)
    quality_ids = [prompt_ids(engine, r) for r in scored]
    for ids in prompts + quality_ids:
        engine.precompute(ids)
    engine.store.flush()
    max_len = max(len(ids) for ids in prompts + quality_ids) + ANSWER_TOKENS + 8
    connector = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"model": args.model, "separator": separator, "local_disk": store}}
    alone = vllm_engine(folder, dtype, max_len, None)
    blended = vllm_engine(folder, dtype, max_len, connector)

    warm = prompts[0][:256]
    for llm in (alone, blended):
        one_token(llm, warm)
    for ids in prompts + quality_ids:  # the connector's first read of each chunk (disk, then memory)
        one_token(blended, ids)
    for mode in ("full", "blend"):
        kvblend_ttft(engine, warm, mode)

    rows = []
    for n, ids in zip(lengths, prompts):
        samples: dict[str, list[float]] = {}
        for r in range(args.repeats):
            for name, fn in (("vllm", lambda: one_token(alone, ids)[0]), ("vllm+kvblend", lambda: one_token(blended, ids)[0]),
                             ("kvblend full", lambda: kvblend_ttft(engine, ids, "full")),
                             ("kvblend blend", lambda: kvblend_ttft(engine, ids, "blend"))):
                samples.setdefault(name, []).append(fn())
            print(f"{n} tokens, round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in samples.items()), flush=True)
        ttft = {k: statistics.median(v) for k, v in samples.items()}
        rows.append(dict(tokens=len(ids), ttft_s=ttft, samples_s=samples,
                         connector_speedup=ttft["vllm"] / ttft["vllm+kvblend"],
                         kvblend_speedup=ttft["kvblend full"] / ttft["kvblend blend"]))

    quality = []
    for record, ids in zip(scored, quality_ids):
        answer, ref_tops = vllm_reference(alone, ids)
        tops = vllm_forced(blended, ids, answer, len(ref_tops))
        same = one_token(blended, ids, max_tokens=ANSWER_TOKENS)[1].token_ids
        quality.append(dict(tokens=len(ids), connector=scores(ref_tops, tops), kvblend=kvblend_quality(engine, ids),
                            connector_answer_is_full=list(same) == answer))
        print(f"record {len(quality)}: {len(ids)} tokens, connector {quality[-1]['connector']}, "
              f"kvblend {quality[-1]['kvblend']}", flush=True)

    mean = lambda side, key: statistics.mean(q[side][key] for q in quality) if quality else None  # noqa: E731
    report = dict(model=args.model, dtype=dtype, separator=separator, cpu=cpu_name(), data=args.data,
                  torch_threads_kvblend=torch.get_num_threads(), repeats=args.repeats, rows=rows,
                  quality=dict(records=f"{args.offset}-{args.offset + len(quality) - 1}", per_record=quality,
                               connector_kl_answer=mean("connector", "kl_answer"),
                               connector_top1_agree=mean("connector", "top1_agree"),
                               kvblend_kl_answer=mean("kvblend", "kl_answer"),
                               kvblend_top1_agree=mean("kvblend", "top1_agree"),
                               connector_answers_equal_full=sum(q["connector_answer_is_full"] for q in quality)),
                  command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]))
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    engine.close()
    for llm in (alone, blended):  # their engine processes end with them, before this one does
        llm.llm_engine.engine_core.shutdown()
    return report


def print_table(report: dict) -> None:
    print(f"\n{report['model']}, {report['dtype']}, {report['cpu']}")
    print(f"{'tokens':>7} {'vLLM':>8} {'vLLM+kvblend':>13} {'kvblend full':>13} {'kvblend blend':>14} "
          f"{'connector x':>12} {'kvblend x':>10}")
    for r in report["rows"]:
        t = r["ttft_s"]
        print(f"{r['tokens']:7d} {t['vllm']:7.2f}s {t['vllm+kvblend']:12.2f}s {t['kvblend full']:12.2f}s "
              f"{t['kvblend blend']:13.2f}s {r['connector_speedup']:11.1f}x {r['kvblend_speedup']:9.1f}x")
    q = report["quality"]
    if q["per_record"]:
        print(f"quality, records {q['records']}: connector vs vLLM full kl {q['connector_kl_answer']:.4f} top1 "
              f"{q['connector_top1_agree']:.3f}; kvblend blend vs its full kl {q['kvblend_kl_answer']:.4f} top1 "
              f"{q['kvblend_top1_agree']:.3f}; connector answers equal to vLLM full: "
              f"{q['connector_answers_equal_full']}/{len(q['per_record'])}")


if __name__ == "__main__":
    main()
    # The report is written. Leave without running interpreter teardown: vLLM's CPU build can
    # abort there ("terminate called without an active exception") while its engines' threads end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
