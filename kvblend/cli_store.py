"""`kvblend store put|ls|evict|verify|size`: fill, inspect and clean the persistent tiers (local
disk, Redis: one server or a cluster) that the settings name, and size them. Only `put` loads the
model; `size` reads its config, the others entry headers.

It sits beside cli.py, above every layer it uses: `put` runs the engine through the API and reads
datasets through the eval, which both sit above the store."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from .config import Settings
from .store.entry_format import BadEntry
from .store.tiered import TieredStore, build_store


def persistent_store(settings: Settings) -> TieredStore:
    """The disk and Redis tiers of the settings, checked for consistency only (no model)."""
    store = build_store(settings.model_copy(update={"local_cpu": False}), spec=None)
    if not store.tiers:
        raise ValueError("no persistent tier configured: set local_disk and/or remote_url "
                         "(--local-disk, --remote-url, KVBLEND_LOCAL_DISK, LMCACHE_REMOTE_URL or YAML)")
    return store


def _tiers(store: TieredStore, name: str | None):
    tiers = [t for t in store.tiers if name in (None, t.name)]
    if not tiers:
        raise ValueError(f"tier {name!r} is not configured; configured: {', '.join(t.name for t in store.tiers)}")
    return tiers


def document_text(path: Path) -> str:
    """A file's document: its text without the newline(s) editors end a file with, so that a client
    sending the same text without them hits the same chunk."""
    return path.read_text(encoding="utf-8").rstrip("\r\n")


def cmd_put(settings: Settings, files: list[str], data: str | None, limit: int | None) -> int:
    from .api import LLM
    from .eval.datasets import load_dataset
    from .eval.harness import prompt_ids

    if not files and not data:
        raise ValueError("give text files (one document each) and/or --data DATASET")
    llm = LLM(settings=settings)
    engine = llm.engine
    if not any(t.name in ("disk", "redis") for t in engine.store.tiers):
        print("kvblend: warning: no disk or Redis tier configured; entries live in this process only",
              file=sys.stderr)
    prompts = []
    if files:
        docs = [document_text(Path(f)) for f in files]
        prompts += [llm.rag_prompt_ids("", [doc]) for doc in docs]
    if data:
        prompts += [prompt_ids(engine, record) for record in load_dataset(data, limit=limit)]
    # Everything given is one collection: its neighbours are chosen before any chunk is encoded.
    indexed = engine.index_collection(prompts)
    if indexed:
        where = [p for p in ("Redis" if settings.remote_url else None, settings.neighbour_index_path()) if p]
        print(f"indexed {indexed} chunks' neighbours of namespace {settings.namespace!r} into "
              f"{' and '.join(map(str, where)) or 'memory only'}", file=sys.stderr)
    stored = 0
    for ids in tqdm(prompts, desc="documents" if not data else "prompts", unit="prompt"):
        stored += engine.precompute(ids)
        engine.store.flush()  # keep the write-behind backlog to one prompt: nothing dropped
    # Chunks of earlier puts that a chunk given now is much closer to: encoded after it, in the
    # first prompt's context (one system prompt is the common case).
    reencoded = engine.reencode_neighbours(prompts[0]) if prompts else 0
    engine.close()  # the background writes finish before we report
    if reencoded:
        print(f"re-encoded {reencoded} earlier chunks after a much closer new neighbour", file=sys.stderr)
    print(f"stored {stored} new chunks; tiers: "
          + ", ".join(f"{t.name} {t.used_bytes / 1e6:.1f} MB" for t in engine.store.tiers))
    return 0


def cmd_ls(settings: Settings, tier: str | None) -> int:
    store = persistent_store(settings)
    table = Table(title="kvblend store")
    for col in ("tier", "key", "tokens", "bytes", "dtype", "model"):
        table.add_column(col)
    total = 0
    for t in _tiers(store, tier):
        for key in reversed(t.keys()):  # most recently used first
            meta = t.header(key)
            if meta is None:
                continue
            total += 1
            dtype = meta.dtype + (f" ({meta.quant})" if meta.quant else "")
            table.add_row(t.name, key, str(meta.n_tokens), str(meta.nbytes), dtype, meta.fingerprint)
    Console().print(table)
    for t in _tiers(store, tier):
        print(f"{t.name}: {t.used_bytes} of {t.capacity_bytes} bytes")
    print(f"{total} entries")
    return 0


def cmd_evict(settings: Settings, keys: list[str], all_: bool, tier: str | None) -> int:
    if not keys and not all_:
        raise ValueError("name entries to evict (a key or a key prefix), or --all")
    store = persistent_store(settings)
    n = 0
    for t in _tiers(store, tier):
        for key in t.keys():
            if all_ or any(key.startswith(k) for k in keys):
                n += bool(t.delete(key))
    print(f"evicted {n} entries")
    return 0


def cmd_verify(settings: Settings, tier: str | None) -> int:
    """Read every entry and check every layer's checksum (and its compact copy's); bad ones are
    reported and deleted."""
    store = persistent_store(settings)
    good = bad = 0
    for t in _tiers(store, tier):
        keys = t.keys()
        for key in tqdm(keys, desc=f"verify {t.name}", unit="entry", disable=not keys):
            before = t.bad_entries
            entry = t.get(key)
            if entry is None:
                if t.bad_entries > before:
                    bad += 1
                    print(f"{t.name} {key}: bad header, deleted")
                continue
            try:
                entry.verify()
                good += 1
            except BadEntry as e:
                t.discard(key, e.reason)
                bad += 1
                print(f"{t.name} {key}: {e.reason}, deleted")
    print(f"{good} good, {bad} bad (deleted)")
    return 1 if bad else 0  # a script or cron job sees that the store held bad entries


GB = 1e9


def cmd_size(model: str | None, dtype: str, chunk_tokens: int, tokens: int | None) -> int:
    """Bytes a token of chunk KV takes in each stored form, for a model and dtype (auto: what this
    machine would run); with `tokens`, what a collection that large takes."""
    from .model.loader import _read_config, auto_device, auto_dtype, check_architecture, resolve_model_path
    from .store.entry_format import dtype_name
    from .store.sizing import Shape, entry_bytes, forms

    model = model or Settings.model_fields["model"].default
    config = _read_config(resolve_model_path(model))
    check_architecture(config, model)
    shape = Shape(config.num_hidden_layers, config.num_key_value_heads,
                  getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    dt = dtype_name(auto_dtype(dtype, auto_device()))
    table = Table(title=f"{model}: {shape.n_layers} layers, {shape.n_kv_heads} KV heads of {shape.head_dim}, "
                        f"computing in {dt}; chunks of {chunk_tokens} tokens")
    for col in ("stored as", "bytes / token", "with compact copy (disk, Redis)", "chunks / GB (with copy)"):
        table.add_column(col, justify="right")
    rows = []
    for label, quant in forms(dt):
        plain, copy = (entry_bytes(shape, dt, quant, compact, chunk_tokens) for compact in (False, True))
        rows.append((label, plain, copy))
        table.add_row(label, f"{plain / chunk_tokens:,.0f}", f"{copy / chunk_tokens:,.0f}", f"{GB / copy:,.0f}")
    Console().print(table)
    if tokens:
        for label, plain, copy in rows:
            print(f"{tokens:,} tokens stored as {label}: {tokens * copy / chunk_tokens / GB:,.2f} GB on disk or "
                  f"Redis, {tokens * plain / chunk_tokens / GB:,.2f} GB without compact copies")
    return 0
