"""One yardstick for every path: blend against full prefill, in-process and through the real HTTP server.

A tenant posts each record's passages to `POST /v1/chunks` (one request per record, in record
order: they join the tenant's neighbour index as they arrive), then asks each record's question
through `/v1/completions` with its passages in the record's order and shuffled (fixed seed), in
mode full and blend. Full prefill's greedy answer (`--answer-tokens`, from the in-process run, so
both paths score the same text) is fed teacher-forced (`kvblend.forced_tokens`, which the server
computes in one pass, as the harness does) in both modes, and the top-20 logprobs the server
returns at the first `--tf-positions` positions are compared with full's:

- kl_answer (top-20): KL(full || blend) over the tokens both sides list, the rest of the mass one
  bucket per side (eval.metrics.kl_listed): a lower bound of the exact KL;
- top1_agree: share of positions whose most likely token is full's (exact);
- TTFT: client-side time to the first streamed token, full and blend.

The in-process row runs the same prompts through the harness functions of `kvblend eval` on an
Engine of its own with the same settings, its collection indexed as the server's is (record by
record, in order), and reports both its exact kl_answer and the same top-20 one. Both run with the
loading controller off, so that they compute the same thing whatever the machine's load. With
`--replicas 2` (needs `--redis`), a second app with its own Engine and memory tier, on the same
Redis and no shared disk, answers the same questions about what was posted to the first (its
full column is the first replica's reply: full prefill reads nothing stored).

    python benchmarks/http_yardstick.py --data ../shared/data/musique_s.dev.json --offset 0 --limit 30 \\
        --redis --replicas 2 --out results/http_yardstick.json

Runs over consecutive record ranges (each its own tenant collection and Redis, so none holds all
of a long run's KV) combine into one table, every prompt weighing the same:

    python benchmarks/http_yardstick.py --merge results/a.json results/b.json --out results/all.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import httpx
import torch
from blend_phases import cpu_name  # this script's folder is on sys.path
from kvblend.eval.dev_records import add_record_flags
from local_servers import redis_server, serve
from tqdm import tqdm

from kvblend.config import load_settings
from kvblend.engine.engine import Engine
from kvblend.eval.datasets import RagRecord, load_dataset
from kvblend.eval.harness import greedy, index_dataset, prompt_ids, teacher_forced
from kvblend.eval.metrics import kl_divergence, kl_listed, top_logprobs
from kvblend.model.loader import load_model
from kvblend.engine import prompts
from kvblend.server.app import ServerConfig

MODEL_NAME = "yardstick"
API_KEY = "sk-yardstick-tenant"
TOP = 20  # logprobs per position: the server's cap
IN_PROCESS = {"posts": "in-process", "file": "in-process, file index"}  # row names by --in-process-index


# ---- prompts ---------------------------------------------------------------------------------


def orders(records: list[RagRecord], seed: int) -> dict[str, list[RagRecord]]:
    """Each record with its passages in the dataset's order, and shuffled (one fixed seed)."""
    rng = random.Random(seed)
    shuffled = [dataclasses.replace(r, passages=rng.sample(r.passages, len(r.passages))) for r in records]
    return {"order": records, "shuffled": shuffled}


def question_of(record: RagRecord) -> str:
    """What follows the passages in `harness.prompt_ids`: the instruction, then the question."""
    return record.task.instruction + (f"\nQuestion: {record.question}" if record.question else "")


def check_same_prompt(engine: Engine, record: RagRecord) -> list[int]:
    """The ids the server builds from the completion body are the harness's prompt ids."""
    ids = prompt_ids(engine, record)
    served = prompts.completion_prompt(engine.tokenizer, engine.settings.separator, engine.sep_ids, question_of(record),
                                       record.passages, record.task.system).ids
    if served != ids:
        raise SystemExit("the completion body does not build kvblend eval's prompt ids")
    return ids


# ---- in process ------------------------------------------------------------------------------


def in_process(engine: Engine, records: list[RagRecord], args) -> list[dict]:
    """kvblend eval's measurement (harness.greedy, harness.teacher_forced) on these prompts."""
    rows = []
    for record in tqdm(records, desc="in-process", leave=False):
        ids = prompt_ids(engine, record)
        engine.precompute(ids)
        out = {}
        for mode in ("full", "blend"):
            t0 = time.perf_counter()
            _, pre = engine.prefill(ids, mode, extra_capacity=args.answer_tokens)
            int(pre.logits.argmax())
            ttft = time.perf_counter() - t0
            if mode == "full":
                answer = greedy(engine, pre, len(ids), args.answer_tokens)
            out[mode] = (teacher_forced(engine, pre, len(ids), answer, args.tf_positions), ttft)
        (ref, full_ttft), (logits, blend_ttft) = out["full"], out["blend"]
        # As the server lists them, to score both paths alike and to check they computed the same.
        ref_tops = [top_logprobs(ref[i], TOP, answer[i]) for i in range(ref.shape[0])]
        tops = [top_logprobs(logits[i], TOP, answer[i]) for i in range(ref.shape[0])]
        rows.append(dict(kl_exact=float(kl_divergence(ref, logits).mean()),
                         kl_top20=statistics.mean(kl_listed(p, q) for p, q in zip(ref_tops, tops)),
                         top1_agree=top1_listed(ref_tops, tops),
                         ttft_full_s=full_ttft, ttft_blend_s=blend_ttft, answer=answer, positions=ref.shape[0],
                         ref_tops=ref_tops, tops=tops))
    return rows


def top1_listed(ref_tops: list[dict], tops: list[dict]) -> float:
    """Share of positions whose most likely listed token is full's, by one rule on both paths: bf16
    logits tie, and argmax over the vocabulary breaks a tie by index, the listing by rank."""
    return statistics.mean(float(max(p, key=p.get) == max(q, key=q.get)) for p, q in zip(ref_tops, tops))


# ---- over HTTP -------------------------------------------------------------------------------


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"})


def post_collection(url: str, records: list[RagRecord]) -> None:
    """The tenant's collection: each record's passages, one POST per record, in record order."""
    with client(url) as c:
        for record in tqdm(records, desc="POST /v1/chunks", leave=False):
            r = c.post("/v1/chunks", json={"documents": record.passages, "system": record.task.system})
            r.raise_for_status()
            if not all(d["stored"] for d in r.json()["data"]):
                raise SystemExit(f"/v1/chunks did not store every chunk in every tier: {r.json()}")


def ask(c: httpx.Client, record: RagRecord, mode: str, **extra) -> dict:
    """One streamed completion with top-20 logprobs; the client-side TTFT, the tokens (ids) and each
    position's listed logprobs (id -> logprob), and the final usage and kvblend metrics."""
    body = {"model": MODEL_NAME, "prompt": question_of(record), "documents": record.passages,
            "system": record.task.system, "temperature": 0, "logprobs": TOP, "return_tokens_as_token_ids": True,
            "stream": True, **extra, "kvblend": {"mode": mode, **extra.get("kvblend", {})}}
    t0 = time.perf_counter()
    ttft, tokens, tops, last = None, [], [], {}
    with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"/v1/completions answered {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise SystemExit(f"/v1/completions failed mid-stream: {data['error']}")
            lp = data["choices"][0]["logprobs"]
            if lp:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                tokens += [_id(t) for t in lp["tokens"]]
                tops += [{_id(t): v for t, v in top.items()} for top in lp["top_logprobs"]]
            last = data
    return dict(ttft_s=ttft, tokens=tokens, tops=tops, finish=last["choices"][0]["finish_reason"],
                usage=last["usage"], kvblend=last["kvblend"])


def _id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def over_http(url: str, records: list[RagRecord], n_prompt: list[int], answers: list[list[int]], args, desc: str,
              fulls: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Each prompt in full and in blend, with full prefill's greedy answer from the in-process run
    forced in both; with `fulls`, full's replies to these prompts from another replica are used
    (full prefill reads nothing stored: it is the same computation on any replica)."""
    rows, replies = [], []
    with client(url) as c:
        for i, (record, n, answer) in enumerate(tqdm(list(zip(records, n_prompt, answers)), desc=desc, leave=False)):
            forced = answer[:args.tf_positions]
            full = fulls[i] if fulls else ask(c, record, "full", kvblend={"forced_tokens": forced})
            replies.append(full)
            if full["usage"]["prompt_tokens"] != n:
                raise SystemExit(f"the server built a {full['usage']['prompt_tokens']}-token prompt, not {n}")
            blend = ask(c, record, "blend", kvblend={"forced_tokens": forced})
            if blend["usage"]["prompt_tokens"] != n:
                raise SystemExit(f"the server built a {blend['usage']['prompt_tokens']}-token prompt, not {n}")
            ref_tops, tops = full["tops"][:len(forced)], blend["tops"]
            rows.append(dict(
                kl_top20=statistics.mean(kl_listed(p, q) for p, q in zip(ref_tops, tops)),
                top1_agree=top1_listed(ref_tops, tops),
                ttft_full_s=full["ttft_s"], ttft_blend_s=blend["ttft_s"], answer=answer, positions=len(forced),
                ref_tops=ref_tops, tops=tops,
                chunk_hits=blend["kvblend"]["chunk_hits"], chunk_misses=blend["kvblend"]["chunk_misses"],
                chunk_tiers=blend["kvblend"]["chunk_tiers"]))
    return rows, replies


# ---- the table ---------------------------------------------------------------------------------


def summary(path: str, rows: list[dict], reference: list[dict] | None) -> dict:
    mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
    out = dict(path=path, kl_answer_exact=mean("kl_exact") if "kl_exact" in rows[0] else None,
               kl_answer_top20=mean("kl_top20"), top1_agree=mean("top1_agree"), ttft_full_s=mean("ttft_full_s"),
               ttft_blend_s=mean("ttft_blend_s"), n=len(rows))
    out["speedup"] = out["ttft_full_s"] / out["ttft_blend_s"]
    if reference is not None:  # the same prompt, KV and answer: the same logprobs, bit for bit
        same = lambda key: statistics.mean(float(r[key] == ref[key]) for r, ref in zip(rows, reference))  # noqa: E731
        out["full_logprobs_as_in_process"], out["blend_logprobs_as_in_process"] = same("ref_tops"), same("tops")
        out["chunk_misses"] = sum(r["chunk_misses"] for r in rows)
    return out


def print_table(rows: list[dict]) -> None:
    print(f"\n{'path':32s} {'kl exact':>9s} {'kl top20':>9s} {'top1':>6s} {'TTFT full':>10s} {'TTFT blend':>11s}"
          f" {'speed-up':>9s} {'n':>4s}")
    for r in rows:
        exact = f"{r['kl_answer_exact']:9.4f}" if r["kl_answer_exact"] is not None else f"{'-':>9s}"
        print(f"{r['path']:32s} {exact} {r['kl_answer_top20']:9.4f} {r['top1_agree']:6.3f} "
              f"{r['ttft_full_s'] * 1000:8.0f}ms {r['ttft_blend_s'] * 1000:9.0f}ms {r['speedup']:8.2f}x {r['n']:4d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_record_flags(ap, limit=30)
    ap.add_argument("--seed", type=int, default=0, help="the shuffled order's seed")
    ap.add_argument("--answer-tokens", type=int, default=32, help="full's greedy answer (as kvblend eval)")
    ap.add_argument("--tf-positions", type=int, default=16, help="answer positions compared (as kvblend eval)")
    ap.add_argument("--redis", action="store_true", help="a fresh redis-server as the shared tier")
    ap.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                    help="2: a second app on the same Redis answers what was posted to the first")
    ap.add_argument("--in-process-index", choices=("posts", "file"), default="posts",
                    help="posts: the in-process collection grows as the posts do, record by record (like with "
                         "like); file: the whole data file in one addition, as kvblend eval indexes it")
    ap.add_argument("--in-process-only", action="store_true", help="no server: the in-process rows alone")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no run: combine these runs' tables")
    merging = argparse.ArgumentParser(add_help=False)  # --merge needs none of the record flags
    merging.add_argument("--merge", nargs="+")
    merging.add_argument("--out")
    known, _ = merging.parse_known_args()
    if known.merge:
        return merge(known.merge, known.out)
    args = ap.parse_args()
    if args.replicas == 2 and not args.redis:
        ap.error("--replicas 2 needs --redis (the replicas share nothing else)")
    records = load_dataset(args.data, limit=args.limit, offset=args.offset)
    prompts_by_order = orders(records, args.seed)

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvblend-yardstick-")))
        redis_url = stack.enter_context(redis_server() if args.redis else nullcontext())

        def engine(name: str, redis: bool) -> Engine:
            # The loading controller off: it chooses by the read and compute rates of the moment, so
            # on a loaded machine a replica reading Redis could recompute what the in-process run
            # read, and the two paths would differ for a reason that is not theirs.
            settings = load_settings(model=args.model, dtype=args.dtype, local_disk=str(tmp / name),
                                     remote_url=redis_url if redis else None, loading_controller=False)
            return Engine(load_model(settings.model, dtype=args.dtype, device=settings.device), settings)

        here = engine("in-process", redis=False)
        print(f"model {here.settings.model} ({here.model.dtype}), {len(records)} records "
              f"({args.offset}..{args.offset + len(records) - 1} of {args.data}), {cpu_name()}", flush=True)
        if args.in_process_index == "posts":  # the collection grows as the tenant's does: a record at a time
            for record in records:
                here.index_collection([prompt_ids(here, record)])
        else:  # kvblend eval's: every record of the file at once, so neighbours may come from later records
            index_dataset(here, load_dataset(args.data))
        n_prompt = {order: [len(check_same_prompt(here, r)) for r in rs] for order, rs in prompts_by_order.items()}
        per, labels = {}, {}
        for order, rs in prompts_by_order.items():
            per[f"{IN_PROCESS[args.in_process_index]} {order}"] = in_process(here, rs, args)
        meta = dict(model=here.settings.model, dtype=str(here.model.dtype).removeprefix("torch."),
                    cpu=cpu_name(), threads=torch.get_num_threads(), records=[args.offset, args.offset + len(records)],
                    data=args.data, seed=args.seed, answer_tokens=args.answer_tokens, tf_positions=args.tf_positions,
                    recompute_ratios=list(here.blend_cfg.ratios), redis=args.redis, replicas=args.replicas,
                    in_process_index=args.in_process_index,
                    mean_prompt_tokens=statistics.mean(n_prompt["order"]), command=" ".join(sys.argv))
        here.close()
        del here
        release_memory()  # its chunk KV, before two servers and Redis hold theirs
        if not args.in_process_only:
            answers = {order: [r["answer"] for r in per[f"{IN_PROCESS[args.in_process_index]} {order}"]]
                       for order in prompts_by_order}
            per_http, labels = through_servers(stack, engine, records, prompts_by_order, n_prompt, answers, args)
            per.update(per_http)

    finish(per, labels, meta, args)


def release_memory() -> None:
    """Hand freed memory back to the system: glibc keeps the heap a finished Engine's many
    per-layer tensors left fragmented (8 GB after MuSiQue 0-29 in process), which the servers and
    Redis after it would then lack."""
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def through_servers(stack: ExitStack, engine, records: list[RagRecord], prompts_by_order: dict, n_prompt: dict,
                    answers: dict, args) -> tuple[dict, dict]:
    """The tenant posts to the first app and asks it; with --replicas 2, asks a second app too.
    Returns the rows per path and, per HTTP path, the in-process path it compares with."""
    per, labels = {}, {}
    first = engine("replica-a", redis=args.redis)
    url = stack.enter_context(serve(first, ServerConfig(model_name=MODEL_NAME, api_keys=[API_KEY])))
    post_collection(url, records)
    fulls = {}
    for order, rs in prompts_by_order.items():
        per[f"HTTP {order}"], fulls[order] = over_http(url, rs, n_prompt[order], answers[order], args,
                                                       f"HTTP {order}")
        labels[f"HTTP {order}"] = f"{IN_PROCESS[args.in_process_index]} {order}"
    if args.replicas == 2:
        second = engine("replica-b", redis=True)
        url_b = stack.enter_context(serve(second, ServerConfig(model_name=MODEL_NAME, api_keys=[API_KEY])))
        for order, rs in prompts_by_order.items():
            # Full's reply (answer, logprobs, TTFT) is the first replica's: only blend reads the store.
            per[f"HTTP replica {order}"], _ = over_http(url_b, rs, n_prompt[order], answers[order], args,
                                                        f"HTTP replica {order}", fulls[order])
            labels[f"HTTP replica {order}"] = f"{IN_PROCESS[args.in_process_index]} {order}"
    return per, labels


def finish(per: dict, labels: dict, meta: dict, args) -> None:
    rows = [summary(path, rs, per[labels[path]] if path in labels else None) for path, rs in per.items()]
    print_table(rows)
    result = {"meta": meta, "rows": rows,
              "per_prompt": {path: [{k: r[k] for k in r if k not in ("answer", "ref_tops", "tops")} for r in rs]
                             for path, rs in per.items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


def merge(paths: list[str], out: str | None) -> None:
    """One table from runs over other records: the per-prompt rows joined, the same-logprobs
    shares weighted by each run's prompts."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    per = {path: [r for run in runs for r in run["per_prompt"][path]] for path in runs[0]["per_prompt"]}
    rows = []
    for path, rs in per.items():
        row = summary(path, rs, None)
        parts = [next(r for r in run["rows"] if r["path"] == path) for run in runs]
        for key in ("full_logprobs_as_in_process", "blend_logprobs_as_in_process"):
            if key in parts[0]:
                row[key] = sum(p[key] * p["n"] for p in parts) / row["n"]
        if "chunk_misses" in parts[0]:
            row["chunk_misses"] = sum(p["chunk_misses"] for p in parts)
        rows.append(row)
    print_table(rows)
    meta = {**runs[0]["meta"], "records": [run["meta"]["records"] for run in runs], "merged": paths}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows, "per_prompt": per}, indent=2))


if __name__ == "__main__":
    main()
