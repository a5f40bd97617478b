"""Times llama.cpp's full prefill of token ids; run by llamacpp_bench.py in the virtualenv that has
llama-cpp-python (never a kvblend dependency), so it imports nothing but llama_cpp, numpy and the
standard library.

Protocol, one JSON object a line: the first line on stdin is {"gguf", "threads"}; the worker loads
the model once (its own quantized weights) and answers {"ready", "version", "system_info"}. Then
each line {"tokens": [...], "n_batch": b} gets {"seconds", "cpu_seconds", "token"}: the wall time
(and this process's CPU time, all threads) from the first llama_decode call to the first token
picked (greedy) from the last row's logits, in a context
created fresh for that prompt (untimed, as a server's would already exist) with n_ubatch = n_batch
and flash attention on.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp as lc
import numpy as np


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def load(gguf: str):
    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(gguf.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    return model


def new_context(model, n_ctx: int, n_batch: int, threads: int):
    p = lc.llama_context_default_params()
    p.n_ctx = n_ctx
    p.n_batch = p.n_ubatch = n_batch
    p.n_seq_max = 1
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(model, p)
    if not ctx:
        raise SystemExit(f"llama.cpp could not create a context of {n_ctx} tokens")
    return ctx


def prefill_seconds(model, n_vocab: int, tokens: list[int], n_batch: int, threads: int) -> tuple[float, float, int]:
    n_ctx = -(-(len(tokens) + 16) // 256) * 256
    ctx = new_context(model, n_ctx, n_batch, threads)
    try:
        # llama_decode takes at most n_batch tokens a call; with no logits flags set it computes
        # the logits of each call's last row only.
        slices = [tokens[i:i + n_batch] for i in range(0, len(tokens), n_batch)]
        arrays = [(lc.llama_token * len(s))(*s) for s in slices]
        start, cpu = time.perf_counter(), time.process_time()
        for arr in arrays:
            if lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(arr))) != 0:
                raise SystemExit("llama_decode failed")
        lc.llama_synchronize(ctx)
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        token = int(logits.argmax())
        return time.perf_counter() - start, time.process_time() - cpu, token
    finally:
        lc.llama_free(ctx)


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    model = load(setup["gguf"])
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    reply({"ready": True, "version": lc.__version__, "system_info": lc.llama_print_system_info().decode()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        seconds, cpu, token = prefill_seconds(model, n_vocab, req["tokens"], int(req["n_batch"]), int(setup["threads"]))
        reply({"seconds": seconds, "cpu_seconds": cpu, "token": token})
    lc.llama_model_free(model)


if __name__ == "__main__":
    main()
