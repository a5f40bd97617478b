"""Every setting's command-line flag, made from Settings in one place: `--name-with-dashes`, its type
from the field's annotation (a yes/no pair for a bool, the choices of a Literal), its help below.
An unset flag leaves the environment's and the YAML file's value alone."""

from __future__ import annotations

import argparse
import types
import typing

from .config import Settings

HELP = {
    "model": "model name, HF folder or .gguf file (default smollm2-135m-instruct)",
    "dtype": "compute dtype (auto: bfloat16 where the CPU has bf16 products, else float32)",
    "weights": "how the decoder layers hold their weights: fp32, bf16, int8 (the MLP's gate and up in int8 "
               "products, Hadamard-rotated), int4, bf16-fp32 or fp16-fp32 (weights and KV held in bf16 or fp16, "
               "fp32 products) "
               "(auto: dense in the --dtype; fp16-fp32 where auto chose float32 on a CPU)",
    "device": "where the model runs",
    "max_model_len": "longest prompt plus answer, in tokens (default: the model's context)",
    "mode": "how a prompt is prefilled: full, prefix (exact prefix cache), reuse or blend",
    "separator": "the text that separates chunks in a raw prompt",
    "check_layers": "layers where blend checks which reused tokens to recompute, e.g. 1 or 1,4",
    "recompute_ratios": "share of reused tokens recomputed at each check layer, e.g. 0.08 or 0.3,0.15",
    "min_recompute_tokens": "each check layer recomputes at least this many reused tokens (default: 256)",
    "deviation": "what a reused token's deviation is measured on: K, V or both",
    "check_layer_kv": "KV the unselected rows keep at the check layer itself",
    "weight_by_attention": "weight HKVD scores by the attention the suffix pays each token",
    "stale_key_scale": "scale the attention paid to stale chunk keys (0 < s <= 1; 1 = exact; default: the model's)",
    "probe_layers": "layers the attention probe walks (default: all)",
    "check_candidates": "rows computed before the check: the probe's top reused rows, this many times the "
                        "recompute budget (0: every row)",
    "probe_separators": "the attention probe computes the separators between chunks too (default: it skips them)",
    "probe_attention_from": "share of the layers below which the probe's attention is not summed (default: 1/3)",
    "probe_suffix_tokens": "the probe computes only the suffix's last this many tokens (default: 32; 0: all of it)",
    "chunk_context": "what a chunk's KV is precomputed after: nothing, BOS, or the prompt's prefix",
    "neighbour_context": "precompute each chunk of a known collection after its most similar chunk (default: on)",
    "neighbour_count": "precompute each chunk of a known collection after this many of its most similar chunks, "
                       "the nearest last (default: 1)",
    "neighbour_index": "file of that index (default: neighbours.json in --local-disk)",
    "exact_first_chunk": "precompute also stores each chunk exact as a prompt's first chunk (default: on)",
    "chunk_adapter": "chunk adapter chunk KV is precomputed with: auto (the model's shipped one, if any), none, "
                     "or an adapter file",
    "layerwise": "read stored KV layer by layer in a background thread while layers compute",
    "namespace": "the cache namespace chunks are stored in and read from (default: default)",
    "shared_namespace": "a namespace also read, never written: a collection published with "
                        "`kvblend store put --namespace NAME` that every API key's requests hit",
    "chunk_size": "tokens of a prefix-cache block (blocks end at segment boundaries too)",
    "local_cpu": "keep chunk KV in this process's memory",
    "max_local_cpu_size": "memory tier capacity, GiB",
    "local_disk": "directory of the disk tier",
    "max_local_disk_size": "disk tier capacity, GiB",
    "remote_url": "Redis of the shared tier, redis://host:port[/db] (a Redis Cluster: any node, "
                  "redis+cluster://host:port or with --remote-cluster)",
    "remote_cluster": "--remote-url is a node of a Redis Cluster (its masters' maxmemory bounds the tier)",
    "max_remote_size": "Redis tier capacity, GiB",
    "remote_ttl": "seconds a Redis entry lives",
    "prefetch_depth": "layers read ahead of compute (default: every layer)",
    "kv_int8": "store chunk KV as int8 with a scale per token and head",
    "kv_half": "where the model computes in float32, store chunk KV in bfloat16 (default: on)",
    "compact_probe": "with the loading controller off, the attention probe always reads the compact int4 copies "
                     "of disk and Redis entries (default: they are stored and read where the controller chooses; "
                     "--no-compact-probe: none stored)",
    "loading_controller": "plan reads against compute where they would make the prefill wait: compact copies for "
                          "the probe, a higher recompute ratio (default: on)",
}

# Accepted in a settings file that carries it, read by nothing: no flag (sampling seeds are per request).
CONFIG_ONLY = ("seed",)
# The settings of where chunk KV is kept and how it is read: all that `kvblend store` commands take.
STORE = ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "remote_url", "remote_cluster",
         "max_remote_size", "remote_ttl", "layerwise", "prefetch_depth", "kv_int8", "kv_half", "compact_probe",
         "loading_controller")


def add_setting_flags(p: argparse.ArgumentParser, names: typing.Iterable[str] | None = None) -> None:
    """A flag for each of these settings (None: every one), and --config."""
    p.add_argument("--config", help="YAML settings file")
    for name in names or [n for n in Settings.model_fields if n not in CONFIG_ONLY]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=HELP[name],
                       **_kind(Settings.model_fields[name].annotation))


def overrides(args: argparse.Namespace) -> dict:
    """The settings the command line sets (flags left unset are None: not overrides)."""
    return {name: getattr(args, name) for name in Settings.model_fields if name not in CONFIG_ONLY and hasattr(args, name)}


def _kind(annotation) -> dict:
    """argparse's type or action for a Settings field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])  # optional: None stays the default
    if annotation is bool or bool in args:  # a yes/no pair (compact_probe also takes 'auto': unset)
        return {"action": argparse.BooleanOptionalAction, "default": None}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(args)}
    if annotation in (int, float):
        return {"type": annotation}
    return {}  # text: a string, or a comma-separated list the settings parse
