"""The `kvblend` command: demo, generate, eval, serve, store."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import cli_adapter
from .cli_flags import STORE, add_setting_flags, overrides


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p)


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, STORE)


def _settings(args):
    from .config import load_settings

    return load_settings(args.config, **overrides(args))


def _llm(args):
    from .api import LLM

    return LLM(settings=_settings(args))


def cmd_generate(args) -> int:
    from .api import SamplingParams

    llm = _llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop or [])
    if args.document:
        out = llm.generate(args.prompt, params, documents=args.document)[0]
    elif args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    m = out.metrics
    print(f"[{m.mode}] prompt {m.prompt_tokens} tok, TTFT {m.ttft_s * 1000:.0f} ms, reused {m.reused_tokens}, "
          f"recomputed {m.recomputed_tokens}, decode {m.decode_tokens_per_s:.1f} tok/s, "
          f"chunks from {','.join(m.chunk_tiers) or '-'}", file=sys.stderr)
    llm.close()
    return 0


def cmd_demo(args) -> int:
    from .api import SamplingParams

    console = Console()
    data = json.loads(resources.files("kvblend.demo").joinpath("collection.json").read_text())
    console.print("[bold]kvblend demo[/]: loading the model ...")
    llm = _llm(args)
    passages = data["passages"]
    stored = llm.store_documents(passages)
    console.print(f"stored KV of {stored} passages (chunk context: {llm.settings.chunk_context}); each question's "
                  "prompt holds all of them, in an order of its own\n")
    params = SamplingParams(max_tokens=args.max_tokens)
    first = data["questions"][0]
    llm.generate(first["question"], SamplingParams(max_tokens=1), documents=passages)  # warm-up, untimed
    table = Table(title="full prefill vs blend (same prompt)", show_lines=True)
    for col in ("question", "mode", "answer", "TTFT ms", "recomputed / prompt tokens"):
        table.add_column(col)
    runs = []  # (full's output, blend's) per question
    for q in data["questions"]:
        docs = [passages[i] for i in q["passages"]]
        pair = [llm.generate(q["question"], params, documents=docs, mode=mode)[0] for mode in ("full", "blend")]
        for mode, out in zip(("full", "blend"), pair):
            m = out.metrics
            table.add_row(q["question"] if mode == "full" else "", mode, out.text.strip(), f"{m.ttft_s * 1000:.0f}",
                          f"{m.recomputed_tokens} / {m.prompt_tokens}")
        runs.append(pair)
    console.print(table)
    console.print(_demo_summary(runs, llm.engine.blend_cfg.ratios[0], llm.settings.min_recompute_tokens))
    llm.close()
    return 0


def _demo_summary(runs, ratio: float, floor: int) -> str:
    """What the table says, in words: how often blend kept full's answer, how much sooner, and why
    short prompts gain little (the recompute floor)."""
    same = sum(full.text.strip() == blend.text.strip() for full, blend in runs)
    full_s = sum(full.metrics.ttft_s for full, _ in runs)
    blend_s = sum(blend.metrics.ttft_s for _, blend in runs)
    share = (sum(blend.metrics.recomputed_tokens for _, blend in runs)
             / max(sum(blend.metrics.prompt_tokens for _, blend in runs), 1))
    text = (f"blend's answer equals full's on {same} of {len(runs)} questions; its first token came "
            f"{full_s / max(blend_s, 1e-9):.1f}x sooner in total.")
    if share > 2 * ratio:
        text += (f" These prompts are short: blend computed {share:.0%} of their tokens (each check recomputes at "
                 f"least {floor} chunk tokens, and the question is always computed). On prompts of a few thousand "
                 f"tokens it recomputes {ratio:.0%} of the chunk tokens and reaches the first token several times "
                 "sooner (README, Results).")
    return text


def cmd_eval(args) -> int:
    from .engine.engine import Engine
    from .eval.datasets import load_dataset
    from .eval.harness import index_dataset, run_eval
    from .eval.machine import cpu_name
    from .eval.report import format_table, write_report

    if args.mode is not None or args.recompute_ratios is not None:  # eval sweeps them: say so, never ignore them
        raise ValueError("kvblend eval runs every mode of --modes and every ratio of --ratios; "
                         "--mode and --recompute-ratios set a single request's")
    settings = _settings(args)
    records = load_dataset(args.data, limit=args.limit, nq_k=args.nq_k, nq_gold_pos=args.nq_gold_pos,
                           offset=args.offset)
    engine = Engine.from_settings(settings)
    index_dataset(engine, load_dataset(args.data, nq_k=args.nq_k, nq_gold_pos=args.nq_gold_pos))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    results = run_eval(engine, records, modes, ratios, answer_tokens=args.answer_tokens,
                       tf_positions=args.tf_positions)
    results["meta"]["dataset"] = str(args.data)
    results["meta"]["records"] = f"{args.offset}-{args.offset + len(records) - 1}"
    results["meta"].update(cpu=cpu_name(), date=time.strftime("%Y-%m-%d"))  # for the results' captions
    paths = write_report(results, Path(args.out))
    print(format_table(results["rows"]))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from .engine.engine import Engine
    from .server.app import ServerConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = _settings(args)
    engine = Engine.from_settings(settings)
    keys = [k for k in (args.api_key or []) if k] or [k for k in os.environ.get("KVBLEND_API_KEY", "").split(",") if k]
    config = ServerConfig(model_name=args.served_model_name or settings.model, api_keys=keys,
                          max_queue=args.max_queue, max_batch=args.max_batch, max_tokens=args.max_tokens_limit,
                          max_documents=args.max_documents, max_body_bytes=int(args.max_body_mb * (1 << 20)))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print(f"kvblend: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    uvicorn.run(create_app(engine, config), host=args.host, port=args.port, log_level="info")
    return 0


def cmd_folder(args) -> int:
    from .model.loader import hf_folder

    print(hf_folder(args.model))
    return 0


def cmd_adapter(args) -> int:
    return cli_adapter.cmd_train(_settings(args), args)


def cmd_store(args) -> int:
    from . import cli_store as commands

    if args.store_command == "put":
        return commands.cmd_put(_settings(args), args.files, args.data, args.limit)
    if args.store_command == "size":
        return commands.cmd_size(args.model, args.dtype, args.chunk_tokens, args.tokens)
    settings = _settings(args)
    if args.store_command == "ls":
        return commands.cmd_ls(settings, args.tier)
    if args.store_command == "evict":
        return commands.cmd_evict(settings, args.keys, args.all, args.tier)
    return commands.cmd_verify(settings, args.tier)


def _add_store_parser(sub) -> None:
    store = sub.add_parser("store", help="precompute, list, evict and verify stored chunk KV")
    ssub = store.add_subparsers(dest="store_command", required=True)
    put = ssub.add_parser("put", help="precompute chunks of text files or a dataset into the tiers")
    _add_engine_flags(put)
    put.add_argument("files", nargs="*", help="text files, one document each")
    put.add_argument("--data", help="a dataset file (as for eval): every record's passages")
    put.add_argument("--limit", type=int)
    size = ssub.add_parser("size", help="bytes a token of chunk KV takes, per stored form, for a model and dtype")
    size.add_argument("--model", help="a known name, a model folder or a .gguf file (default: the default model)")
    size.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    size.add_argument("--chunk-tokens", type=int, default=256, help="tokens an entry holds (default: chunk_size)")
    size.add_argument("--tokens", type=int, help="a collection's tokens: what it takes in each form")
    for name, text in (("ls", "entries: key, tokens, bytes, tier"), ("evict", "delete entries"),
                       ("verify", "check every entry's checksums; delete bad ones")):
        p = ssub.add_parser(name, help=text)
        _add_store_flags(p)
        p.add_argument("--tier", choices=["disk", "redis"], help="only this tier")
        if name == "evict":
            p.add_argument("keys", nargs="*", help="keys or key prefixes")
            p.add_argument("--all", action="store_true")
    store.set_defaults(func=cmd_store)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvblend", description="CacheBlend RAG serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="store passages, ask questions, compare full and blend")
    _add_engine_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate for one prompt")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--document", action="append", help="a retrieved document (repeat); the prompt is the question")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append")
    gen.set_defaults(func=cmd_generate)

    ev = sub.add_parser("eval", help="modes side by side on a RAG dataset, against full prefill")
    _add_engine_flags(ev)
    ev.add_argument("--data", required=True, help="CacheBlend .json, LongBench .jsonl or NQ-open .jsonl(.gz)")
    ev.add_argument("--limit", type=int, help="evaluate this many records (default: all)")
    ev.add_argument("--offset", type=int, default=0,
                    help="skip the first N records: choose settings on some records, report on others")
    ev.add_argument("--modes", default="reuse,blend", help="besides full: prefix, reuse, blend")
    ev.add_argument("--ratios", default="0,0.05,0.08,0.15,0.3,1.0", help="blend recompute ratios to sweep")
    ev.add_argument("--answer-tokens", type=int, default=32)
    ev.add_argument("--tf-positions", type=int, default=16)
    ev.add_argument("--nq-k", type=int, default=10)
    ev.add_argument("--nq-gold-pos", type=int, default=0)
    ev.add_argument("--out", default="results/eval")
    ev.set_defaults(func=cmd_eval)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", action="append",
                     help="require 'Authorization: Bearer <key>' (repeat for several tenants; or KVBLEND_API_KEY)")
    srv.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    srv.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    srv.add_argument("--max-batch", type=int, default=32, help="requests decoded together")
    srv.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask")
    srv.add_argument("--max-documents", type=int, default=64, help="documents per request")
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body")
    srv.set_defaults(func=cmd_serve)
    folder = sub.add_parser("folder", help="the Hugging Face folder of a model (vLLM loads it): written once, printed")
    folder.add_argument("model", nargs="?", default="smollm2-135m-instruct", help="a known name or a .gguf file")
    folder.set_defaults(func=cmd_folder)
    _add_store_parser(sub)
    cli_adapter.add_parser(sub, _add_engine_flags).set_defaults(func=cmd_adapter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pydantic import ValidationError

    from .engine.engine import RequestError
    from .model.loader import ModelLoadError

    try:
        return args.func(args)
    except (ModelLoadError, RequestError, ValidationError, FileNotFoundError, ValueError) as e:
        print(f"kvblend: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a command whose extra is not installed
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"kvblend: error: `kvblend {args.command}` needs {e.name}, in the [{extra}] extra: "
              f"pip install 'kvblend[{extra}]'", file=sys.stderr)
        return 2


# Modules of the optional extras (pyproject.toml): the offline engine runs without them.
EXTRAS = {"fastapi": "server", "uvicorn": "server", "prometheus_client": "server", "redis": "redis",
          "matplotlib": "eval", "rouge_score": "eval"}


if __name__ == "__main__":
    sys.exit(main())
