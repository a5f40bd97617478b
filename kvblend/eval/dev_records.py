"""What the quality benchmarks share: which records they score (a slice of a dataset, by default
past the first 30 that the held-out tables of docs/results.md use) and the engine that scores them."""

from __future__ import annotations

import argparse

from ..config import load_settings
from ..engine.engine import Engine
from .datasets import RagRecord, load_dataset
from .harness import index_dataset


def add_record_flags(ap: argparse.ArgumentParser, limit: int) -> None:
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--offset", type=int, default=30, help="skip the first records (keep tuning off the eval set)")
    ap.add_argument("--limit", type=int, default=limit)


def open_records(args: argparse.Namespace) -> tuple[Engine, list[RagRecord]]:
    """The records first (a bad slice fails before the model loads), then the engine, with the
    whole file indexed as `kvblend eval` indexes it (KVBLEND_NEIGHBOUR_CONTEXT=false: plain chunks)."""
    records = load_dataset(args.data, limit=args.limit, offset=args.offset)
    settings = load_settings(model=args.model, dtype=args.dtype)
    engine = Engine.from_settings(settings)
    index_dataset(engine, load_dataset(args.data))
    return engine, records
