"""KVBlendConnector: kvblend's blend as a vLLM v1 KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBlendConnector",
        "kv_connector_module_path": "kvblend.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"local_disk": "/var/cache/kvblend"}}'

vLLM builds one instance in its scheduler process (scheduler_side.py: which requests kvblend
prefills) and one in each worker (worker_side.py: the blend, on vLLM's own layers, written into
vLLM's paged cache). Settings come from `kv_connector_extra_config` (kvblend's setting names; a
`config` key names a YAML file), then the KVBLEND_* / LMCACHE_* environment, then the defaults.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ..blend.segment import find_separators, separator_ids
from ..config import Settings, load_settings
from ..model.loader import alias_of_folder
from ..model.rotary import check_rerotation
from ..model.tokenizer import load_tokenizer
from .model_view import transformers_rotary, unsupported
from .scheduler_side import LoadJob, SchedulerSide
from .worker_side import WorkerSide

log = logging.getLogger(__name__)


@dataclass
class KVBlendMetadata(KVConnectorMetadata):
    jobs: list[LoadJob] = field(default_factory=list)


@dataclass
class KVBlendStats(KVConnectorStats):
    """The workers' counters (worker_side.Counters), summed over workers and over a logging interval."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(value, 3) if isinstance(value, float) else value for key, value in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


def connector_settings(vllm_config) -> Settings:
    """kvblend's settings for the model vLLM serves. `model` names it as kvblend knows it (an alias
    or a path) for chunk keys, the shipped adapter and damping; by default the alias whose GGUF
    kvblend dequantized into the folder vLLM loads, else that folder."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    yaml_path = extra.pop("config", None)
    served = vllm_config.model_config.model
    extra.setdefault("model", alias_of_folder(served) or served)
    return load_settings(yaml_path, **extra)


def warn_if_separator_splits(tokenizer, sep: list[int], separator: str) -> None:
    """Text prompts reach vLLM whole and are tokenized whole: a separator whose ids change with the
    text around it (" # # " merges its last space into the next word) is never found in them."""
    sample = tokenizer.encode(f"One fact.{separator}Another fact.{separator}Why?", add_special_tokens=False)
    if len(find_separators(sample, sep)) != 2:
        log.warning("kvblend connector: the separator %r does not keep its token ids inside whole text, so only "
                    "prompts sent as token ids will blend; for text and chat prompts set the separator to one "
                    "special token of this model (KVBLEND_SEPARATOR, or 'separator' in kv_connector_extra_config)",
                    separator)


class KVBlendConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = connector_settings(vllm_config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # kvblend is a cache: a load that fails is a miss for vLLM to recompute, never a failed
            # request (vLLM's scheduler reads this after it has built its connector).
            vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
            self.scheduler_side = self._scheduler(vllm_config)
        else:
            self.worker_side = WorkerSide(self.settings, vllm_config)

    def _scheduler(self, vllm_config) -> SchedulerSide:
        mc = vllm_config.model_config
        tokenizer = load_tokenizer(mc.tokenizer)
        sep = separator_ids(tokenizer, self.settings.separator)
        warn_if_separator_splits(tokenizer, sep, self.settings.separator)
        why = unsupported(mc.hf_config, vllm_config.parallel_config)
        if why is None:
            hf_like = SimpleNamespace(config=mc.hf_config,
                                      model=SimpleNamespace(rotary_emb=transformers_rotary(mc.hf_config)))
            ok, gate = check_rerotation(hf_like, mc.max_model_len)
            why = None if ok else f"cached KV cannot be moved between positions for this model ({gate})"
        if why is not None:
            log.warning("kvblend connector: %s; every request is prefilled by vLLM as usual", why)
        return SchedulerSide(sep, self.settings.mode, why is None)

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.matched(request, num_computed_tokens), False  # None: ask again next step

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVBlendMetadata(self.scheduler_side.jobs(scheduler_output))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.finished(request)
        return False, None

    # ---- worker side ------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self.worker_side.load(forward_context, meta.jobs if isinstance(meta, KVBlendMetadata) else [])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward begins

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are stored from kvblend's own encoding (after_step), not read back from vLLM's cache

    def wait_for_save(self) -> None:
        self.worker_side.after_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.worker_side.failed_blocks) if self.worker_side is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        counters = self.worker_side.take_counters() if self.worker_side is not None else None
        return KVBlendStats(data=counters) if counters else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVBlendStats(data=data) if data is not None else KVBlendStats()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
