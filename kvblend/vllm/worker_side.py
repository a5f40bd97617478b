"""The connector in vLLM's worker process: blend a request's prompt on vLLM's own layers and write
its KV into the request's blocks before vLLM computes the prompt's last row.

kvblend's Engine runs unchanged over a view of vLLM's modules (model_view.py): the same plan
(prefix cache, chunk store with kvblend's keys), probe, selection, stale-key damping, exact first
chunk and chunk adapter as kvblend's own engine. What a request missed is stored after it, one
step later, off the step that returns its first token.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from ..config import Settings
from ..engine.engine import Engine
from ..model.loader import dense_fingerprint
from ..model.tokenizer import load_tokenizer
from .model_view import view_model
from .paged import slots, write_rows
from .scheduler_side import LoadJob

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """What the connector did since it was last asked (vLLM sums these across workers and logs them)."""

    requests: int = 0  # prompts blended (or reused) into vLLM's cache
    rows_written: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    bad_entries: int = 0  # stored entries found bad (discarded, recomputed)
    faults: int = 0  # blends that failed: the prompt was prefilled in full instead
    failed_loads: int = 0  # prompts not even that could be written: vLLM recomputes their blocks
    blend_s: float = 0.0

    def add(self, job, stats, seconds: float) -> None:
        self.requests += 1
        self.rows_written += job.end - job.start
        self.reused_tokens += stats.reused_tokens
        self.recomputed_tokens += stats.recomputed_tokens
        self.chunk_hits += stats.chunk_hits
        self.chunk_misses += stats.chunk_misses
        self.bad_entries += stats.bad_entries
        self.blend_s += seconds

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def served_model() -> torch.nn.Module:
    """The model of the vLLM model runner that called into the connector (found on the call stack:
    vLLM hands connectors no model)."""
    frame = sys._getframe(1)
    while frame is not None:
        runner = frame.f_locals.get("self")
        if hasattr(runner, "kv_caches") and callable(getattr(runner, "get_model", None)):
            model = runner.get_model()
            if isinstance(model, torch.nn.Module):
                return model
        frame = frame.f_back
    raise RuntimeError("kvblend's vLLM connector found no model runner on the call stack")


@dataclass
class WorkerSide:
    settings: Settings
    vllm_config: object
    engine: Engine | None = None
    counters: Counters = field(default_factory=Counters)  # since vLLM last took them (its stats interval)
    totals: Counters = field(default_factory=Counters)  # since the worker started
    recent: deque = field(default_factory=lambda: deque(maxlen=16))  # the last jobs loaded, with their stats
    failed_blocks: set[int] = field(default_factory=set)
    _stores: list = field(default_factory=list)  # (step, ids, plan, output, mode): stored a step later
    _step: int = 0

    def _engine(self) -> Engine:
        if self.engine is None:
            mc = self.vllm_config.model_config
            s = self.settings
            tokenizer = load_tokenizer(mc.tokenizer)
            model = view_model(served_model(), mc.hf_config, tokenizer, s.model,
                               dense_fingerprint(s.model, mc.dtype), mc.dtype, torch.device(self.vllm_config.device_config.device))
            self.engine = Engine(model, s)
            log.info("kvblend connector: blending on vLLM's %s (%s), mode %s", s.model, mc.dtype, s.mode)
        return self.engine

    def load(self, forward_context, jobs: list[LoadJob]) -> None:
        """Prefill each job's rows and write them into vLLM's cache, before this step's forward."""
        self.failed_blocks.clear()
        if not jobs:
            return
        block_size = self.vllm_config.cache_config.block_size
        try:
            engine = self._engine()
            layers = attention_layers(forward_context, engine.runner.n_layers)
        except Exception:  # noqa: BLE001 - vLLM recomputes the requests' blocks and keeps serving
            log.exception("kvblend connector: cannot blend on this model; vLLM recomputes the requests")
            for job in jobs:
                self._failed(job, block_size)
            return
        for job in jobs:
            t0 = time.perf_counter()
            try:
                plan, out = self._prefill(engine, job)
                at = slots(job.block_ids, block_size, job.start, job.end)
                for layer, attn in enumerate(layers):
                    write_rows(attn, out.cache.k[layer][:, job.start:job.end], out.cache.v[layer][:, job.start:job.end], at)
            except Exception:  # noqa: BLE001 - the request must still be answered: vLLM recomputes its blocks
                log.exception("kvblend connector: could not write request %s; vLLM recomputes it", job.req_id)
                self._failed(job, block_size)
                continue
            for c in (self.counters, self.totals):
                c.add(job, out.stats, time.perf_counter() - t0)
            self.recent.append((job, out.stats))
            self._stores.append((self._step, job.token_ids, plan, out, job.mode))

    def _failed(self, job: LoadJob, block_size: int) -> None:
        self.counters.failed_loads += 1
        self.totals.failed_loads += 1
        self.failed_blocks.update(job.block_ids[job.start // block_size:])

    def _prefill(self, engine: Engine, job: LoadJob):
        """The job's prefill in its mode; where blending fails, a full prefill on the same layers."""
        try:
            # The namespace bound again for each request: another process (`kvblend store put`) may
            # have grown its neighbour index, and chunks are keyed after the neighbours it names now.
            with engine.namespace(self.settings.namespace):
                cfg = None
                if job.ratio is not None:
                    cfg = replace(engine.blend_cfg, ratios=[job.ratio] * len(engine.blend_cfg.check_layers))
                return engine.prefill(job.token_ids, job.mode, blend_cfg=cfg)
        except Exception:  # noqa: BLE001 - a fault costs speed, never the answer
            log.exception("kvblend connector: blending request %s failed; prefilling it in full", job.req_id)
            self.counters.faults += 1
            self.totals.faults += 1
            return engine.prefill(job.token_ids, "full")

    def after_step(self) -> None:
        """Store what requests of earlier steps missed (their first tokens are out by now)."""
        self._step += 1
        due = [s for s in self._stores if s[0] < self._step - 1]
        self._stores = [s for s in self._stores if s[0] >= self._step - 1]
        for _, ids, plan, out, mode in due:
            try:
                with self.engine.namespace(self.settings.namespace):  # keyed as the request looked them up
                    self.engine.store_after(ids, plan, out, mode)
            except Exception:  # noqa: BLE001 - storing is best effort: a chunk not stored is a later miss
                log.exception("kvblend connector: storing a request's chunks failed")

    def take_counters(self) -> dict | None:
        c, self.counters = self.counters, Counters()
        return c.as_dict() if c.requests or c.faults or c.failed_loads else None

    def close(self) -> None:
        if self.engine is not None:
            self._step += 2  # every store owed is due now
            self.after_step()
            self.engine.close()


def attention_layers(forward_context, n_layers: int) -> list[torch.nn.Module]:
    """vLLM's attention layer of each decoder layer, in order."""
    from vllm.model_executor.models.utils import extract_layer_index

    by_index = {}
    for name, layer in forward_context.no_compile_layers.items():
        if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl"):
            by_index[extract_layer_index(name)] = layer
    if sorted(by_index) != list(range(n_layers)):
        raise RuntimeError(f"expected the attention layers 0-{n_layers - 1} in this worker, found {sorted(by_index)}")
    return [by_index[i] for i in range(n_layers)]
