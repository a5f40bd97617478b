"""The one settings object of kvblend and where its values come from.

Sources, highest priority first:

1. explicit keyword arguments (what the CLI passes for the flags a user set),
2. environment variables: ``KVBLEND_<FIELD>`` (e.g. ``KVBLEND_MODEL``), and for the blending
   and storage fields also the ``LMCACHE_*`` names LMCache users already know,
3. a YAML file whose keys are the field names (``load_settings(yaml_path)``),
4. the defaults below.

When a ``KVBLEND_*`` name and its ``LMCACHE_*`` twin are both set, the ``KVBLEND_*`` one wins.

LMCache name                      -> field
``LMCACHE_ENABLE_BLENDING``       -> ``mode`` (true: "blend", false: "full")
``LMCACHE_BLEND_SPECIAL_STR``     -> ``separator``
``LMCACHE_BLEND_CHECK_LAYERS``    -> ``check_layers``
``LMCACHE_BLEND_RECOMPUTE_RATIOS``-> ``recompute_ratios`` (``KVBLEND_BLEND_RATIOS`` works too)
``LMCACHE_USE_LAYERWISE``         -> ``layerwise``
``LMCACHE_CHUNK_SIZE``            -> ``chunk_size``
``LMCACHE_LOCAL_CPU``             -> ``local_cpu``
``LMCACHE_MAX_LOCAL_CPU_SIZE``    -> ``max_local_cpu_size`` (GiB)
``LMCACHE_LOCAL_DISK``            -> ``local_disk`` (a ``file://`` scheme is stripped)
``LMCACHE_MAX_LOCAL_DISK_SIZE``   -> ``max_local_disk_size`` (GiB)
``LMCACHE_REMOTE_URL``            -> ``remote_url`` (a ``redis://`` URL)
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import yaml
from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

# The shared tier's URLs: one Redis server, or (+cluster) any node of a Redis Cluster.
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")

# The YAML file for the Settings object being built right now. A context variable rather than
# a class attribute, so that two threads loading different files don't see each other's path.
_yaml_path: ContextVar[Path | None] = ContextVar("kvblend_yaml_path", default=None)

_TRUE_WORDS = {"1", "true", "yes", "on"}
_FALSE_WORDS = {"0", "false", "no", "off"}


def _env(field: str, lmcache: str | None = None, *extra: str) -> AliasChoices:
    """Environment names of a field: KVBLEND_<FIELD> first, so it beats the LMCache name."""
    names = [f"KVBLEND_{field.upper()}", *extra]
    if lmcache:
        names.append(lmcache)
    return AliasChoices(*names)


def _split_list(value: Any) -> Any:
    """Turn "1", "1,5" or "[1, 5]" (env, CLI, YAML) into a list; leave lists alone."""
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]")
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, (int, float)):
        return [value]
    return value


def namespace_file(folder: Path, ns: str) -> Path:
    """Where a namespace's neighbour index lives in a folder: `neighbours.json` for `default`,
    `neighbours/<namespace, %-quoted>.json` for the others (quoted: no '/' or '..' leaves it)."""
    if ns == "default":
        return folder / "neighbours.json"
    return folder / "neighbours" / (quote(ns, safe="") + ".json")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVBLEND_",
        case_sensitive=False,
        env_ignore_empty=True,  # `KVBLEND_X=` in a shell means "unset", not "empty string"
        populate_by_name=True,  # Settings(check_layers=[1]) works despite the env aliases
        loc_by_alias=False,  # errors name the field, not whichever env alias supplied it
        extra="forbid",  # a mistyped keyword is an error, not silently ignored
    )

    # Model and numerics.
    model: str = "smollm2-135m-instruct"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    weights: Literal["auto", "fp32", "bf16", "int8", "int4", "bf16-fp32", "fp16-fp32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, gt=0)
    seed: int = Field(default=0, ge=0)

    # Blending (docs/architecture.md#how-a-request-walks-through-them).
    mode: Literal["full", "prefix", "reuse", "blend"] = Field(
        default="blend", validation_alias=_env("mode", "LMCACHE_ENABLE_BLENDING")
    )
    separator: str = Field(
        default=" # # ", min_length=1, validation_alias=_env("separator", "LMCACHE_BLEND_SPECIAL_STR")
    )
    check_layers: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [1], validation_alias=_env("check_layers", "LMCACHE_BLEND_CHECK_LAYERS")
    )
    recompute_ratios: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [0.08],  # same TTFT as plain HKVD at 0.15: docs/experiments.md#token-selection
        validation_alias=_env("recompute_ratios", "LMCACHE_BLEND_RECOMPUTE_RATIOS", "KVBLEND_BLEND_RATIOS"),
    )
    # Each check layer recomputes at least this many reused tokens, whatever the ratio: a short
    # prompt's ratio leaves a few dozen, too few to keep greedy answers (docs/experiments.md#short-prompts).
    # Moot from about 256 / 0.08 = 3.2k reused tokens on.
    min_recompute_tokens: int = Field(default=256, ge=0)
    deviation: Literal["k", "v", "kv"] = "v"  # measured best: docs/experiments.md#token-selection
    check_layer_kv: Literal["fresh", "cached"] = "fresh"
    weight_by_attention: bool = True  # HKVD scores times the suffix's attention: docs/experiments.md#token-selection
    # Attention to stale (reused, not recomputed) chunk keys times this; 1.0 = exact attention.
    # None: the value measured for the model on dev records (aliases.py; docs/experiments.md#stale-key-damping).
    stale_key_scale: float | None = Field(default=None, gt=0, le=1)
    probe_layers: int | None = Field(default=None, ge=1)  # layers the attention probe walks; None: all
    # Rows computed before the check: the probe's top reused rows, this many times the first
    # check's budget (0: every row). See BlendConfig.check_candidates and docs/experiments.md#the-probe.
    check_candidates: float = Field(default=3.0, ge=0)
    # The probe computes the separators between chunks too (false: it skips them; the blend pass
    # computes them either way). See BlendConfig.probe_separators and docs/experiments.md#the-probe.
    probe_separators: bool = False
    # The probe sums the suffix's attention from this share of the layers on (0: every layer). See
    # BlendConfig.probe_attention_from and docs/experiments.md#the-probe.
    probe_attention_from: float = Field(default=1 / 3, ge=0, lt=1)
    # The probe computes only the suffix's last this many tokens (0: all of it). See
    # BlendConfig.probe_suffix_tokens and docs/experiments.md#the-probe.
    probe_suffix_tokens: int = Field(default=32, ge=0)
    chunk_context: Literal["bare", "bos", "prefix"] = "prefix"  # measured best: docs/experiments.md#chunk-context
    # When a collection is known (`kvblend store put`, `eval`, `demo`, LLM.store_documents), each of
    # its chunks is precomputed after its most similar other chunk (docs/experiments.md#chunk-context).
    neighbour_context: bool = True
    # How many of its most similar chunks each one is precomputed after (the nearest last). More
    # halved reuse's KL on Qwen 0.5B but did not pay for blend (docs/experiments.md#chunk-context).
    # Applies to chunks indexed from then on: an index keeps what its chunks were precomputed after.
    neighbour_count: int = Field(default=1, ge=1, le=8)
    # Where the index of `namespace` is kept (JSON), so later processes look chunks up by the same
    # neighbours. None: in local_disk (`neighbours.json` for the `default` namespace,
    # `neighbours/<namespace>.json` for others) and in Redis (a key per namespace) when configured,
    # else in this process only. Every namespace has its own index, kept the same way.
    neighbour_index: str | None = None
    # Precompute also stores each chunk exact as it stands first in a prompt (right after the
    # prefix) in the prefix cache, so a prompt's first chunk is never stale: one more encode per
    # chunk precomputed after a neighbour, and twice its storage (docs/experiments.md#chunk-context).
    exact_first_chunk: bool = True
    # The chunk adapter chunk KV is precomputed with (docs/adapters.md): "auto" takes the one shipped
    # for the model where there is one, "none" precomputes with the model alone, else a path to an
    # adapter file (`kvblend adapter train`). Its identity is part of every chunk key.
    chunk_adapter: str = Field(default="auto", min_length=1)
    layerwise: bool = Field(default=True, validation_alias=_env("layerwise", "LMCACHE_USE_LAYERWISE"))

    # Storage (docs/storage.md).
    namespace: str = Field(default="default", min_length=1)
    # A namespace every request also reads and never writes: a chunk or prefix block missing from the
    # request's own namespace is looked up there. How an operator publishes a collection that
    # tenants (one namespace per API key) all hit: `kvblend store put --namespace NAME`, then serve
    # with `--shared-namespace NAME`.
    shared_namespace: str | None = Field(default=None, min_length=1)
    chunk_size: int = Field(default=256, gt=0, validation_alias=_env("chunk_size", "LMCACHE_CHUNK_SIZE"))
    local_cpu: bool = Field(default=True, validation_alias=_env("local_cpu", "LMCACHE_LOCAL_CPU"))
    max_local_cpu_size: float = Field(
        default=4.0, ge=0, validation_alias=_env("max_local_cpu_size", "LMCACHE_MAX_LOCAL_CPU_SIZE")
    )
    local_disk: str | None = Field(default=None, validation_alias=_env("local_disk", "LMCACHE_LOCAL_DISK"))
    max_local_disk_size: float = Field(
        default=20.0, ge=0, validation_alias=_env("max_local_disk_size", "LMCACHE_MAX_LOCAL_DISK_SIZE")
    )
    remote_url: str | None = Field(default=None, validation_alias=_env("remote_url", "LMCACHE_REMOTE_URL"))
    # remote_url names one node of a Redis Cluster (or Valkey cluster): kvblend uses redis-py's cluster
    # client, and the servers' own maxmemory bounds the tier (docs/storage.md#redis-cluster). A
    # redis+cluster:// (rediss+cluster://) URL says the same.
    remote_cluster: bool = False
    max_remote_size: float = Field(default=20.0, ge=0)  # GiB, shared by every process on that Redis
    remote_ttl: int | None = Field(default=None, gt=0)  # seconds a Redis entry lives; None: until evicted
    # Layers of stored KV read and re-encoded ahead of compute by a background thread (with
    # `layerwise`); 0 reads each layer when it is needed. None (the default): every layer, from the
    # moment the request is planned. Reads land straight in the request's cache, so reading far
    # ahead costs no memory, and a slow tier's reads run on through the probe and the blend pass.
    prefetch_depth: int | None = Field(default=None, ge=0)
    # Store chunk KV as int8 with a float16 scale per token and head (exact prefix blocks stay
    # exact): about a quarter of fp32's bytes; its fidelity cost: docs/storage.md#int8.
    kv_int8: bool = False
    # Where the model computes in float32 (CPUs without fast bf16), store chunk KV in bfloat16: half
    # the bytes to keep and read on every tier, converted as it is loaded; its fidelity cost is far
    # below blend's own (docs/storage.md#half-precision). Exact prefix blocks stay exact.
    kv_half: bool = True
    # Disk and Redis entries of chunks also hold a compact int4 copy of their KV (about 28% more
    # bytes at bf16) that only blend's attention probe reads: on a slow tier (a few hundred MB/s
    # or less) the probe then finishes early while the full KV streams in behind it for the blend
    # pass. "auto": stored, and read where the loading controller expects it to pay (with the
    # controller off, never); true: the same, and with the controller off read by every probe
    # (decoding costs CPU that a fast tier does not win back); false: not stored. Chunks in memory
    # are always probed in full (docs/storage.md#compact-probe).
    compact_probe: bool | Literal["auto"] = "auto"
    # Plan each request's reads against its compute (probe and blend pass, from measured tier
    # bandwidth and compute speed) where they would make the prefill wait: read the compact copies
    # for the probe, raise the recompute ratio above recompute_ratios (a floor) where the extra rows
    # fill waits for reads, recompute chunks whose read costs more, read from the fastest tier.
    # Where the plain schedule would wait under 5% of the prefill (memory, a local disk, Redis on
    # the same machine) it changes nothing, so those give what it gives off, bit for bit. Each
    # decision is in the request's metrics; one that dropped no chunk replays exactly with
    # recompute_ratios and compact_probe set to it (docs/storage.md#loading-controller).
    loading_controller: bool = True

    def probe_reads_copies(self) -> bool:
        """Whether blend's probe may read the compact copies: always (true), or where the loading
        controller chooses to ("auto", which it then decides per request)."""
        return self.compact_probe is True or (self.compact_probe == "auto" and self.loading_controller)

    def neighbour_index_path(self) -> Path | None:
        """The file of this namespace's neighbour index (Redis, when configured, keeps it too)."""
        if self.neighbour_index is not None:
            return Path(self.neighbour_index)
        return namespace_file(Path(self.local_disk), self.namespace) if self.local_disk else None

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_from_bool(cls, value: Any) -> Any:
        # LMCACHE_ENABLE_BLENDING shares this field and carries a boolean: on means blend,
        # off means plain full prefill.
        if isinstance(value, bool):
            return "blend" if value else "full"
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE_WORDS:
                return "blend"
            if word in _FALSE_WORDS:
                return "full"
            return word
        return value

    @field_validator("check_layers", "recompute_ratios", mode="before")
    @classmethod
    def _parse_list(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("check_layers")
    @classmethod
    def _check_layers_valid(cls, layers: list[int]) -> list[int]:
        if not layers:
            raise ValueError("check_layers must name at least one layer")
        if any(layer < 0 for layer in layers):
            raise ValueError(f"check_layers must be >= 0, got {layers}")
        # Gradual filtering narrows the selection layer after layer, so order matters.
        if any(a >= b for a, b in zip(layers, layers[1:])):
            raise ValueError(f"check_layers must be strictly increasing, got {layers}")
        return layers

    @field_validator("recompute_ratios")
    @classmethod
    def _ratios_valid(cls, ratios: list[float]) -> list[float]:
        if not ratios:
            raise ValueError("recompute_ratios must hold at least one ratio")
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"recompute_ratios must each be in [0, 1], got {ratios}")
        # Each check layer keeps a subset of the previous one's selection, never more tokens.
        if any(a < b for a, b in zip(ratios, ratios[1:])):
            raise ValueError(f"recompute_ratios must be non-increasing, got {ratios}")
        return ratios

    @field_validator("check_candidates")
    @classmethod
    def _candidates_valid(cls, factor: float) -> float:
        if 0 < factor < 1:  # fewer candidates than the check keeps would leave its budget unspent
            raise ValueError(f"check_candidates must be 0 (every row) or >= 1, got {factor}")
        return factor

    @field_validator("local_disk", mode="before")
    @classmethod
    def _strip_file_scheme(cls, value: Any) -> Any:
        # LMCache writes local_disk as a URL, e.g. "file:///tmp/x/".
        if isinstance(value, str):
            value = value.strip().removeprefix("file://")
            return value or None
        return value

    @field_validator("remote_url", mode="before")
    @classmethod
    def _empty_url_is_none(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value.strip() or None
        return value

    @field_validator("remote_url")
    @classmethod
    def _remote_is_redis(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REMOTE_SCHEMES):
            raise ValueError(f"remote_url {value!r}: the remote tier is Redis; give redis://host:port[/db] "
                             "(or rediss://, unix://; redis+cluster://host:port for a Redis Cluster)")
        return value

    @model_validator(mode="after")
    def _ratios_match_layers(self) -> Settings:
        n_layers, n_ratios = len(self.check_layers), len(self.recompute_ratios)
        if n_ratios == 1 and n_layers > 1:
            # One ratio for several check layers: the same ratio at each of them.
            self.recompute_ratios = self.recompute_ratios * n_layers
        elif n_ratios != n_layers:
            raise ValueError(
                f"recompute_ratios has {n_ratios} values but check_layers has {n_layers}; "
                "give one ratio per check layer, or a single ratio for all of them"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Order is priority: flags > environment > YAML > defaults. No .env or secrets files:
        # configuration should come only from places a user can see.
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _yaml_path.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def _check_yaml(path: Path) -> None:
    """Fail early and clearly on a missing file, a non-mapping, or an unknown key."""
    if not path.is_file():
        raise FileNotFoundError(f"kvblend config file not found: {path}")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if data is None:
        return
    if not isinstance(data, dict):
        raise ValueError(f"kvblend config file {path} must hold a mapping of setting names to values")
    unknown = sorted(str(key) for key in data if key not in Settings.model_fields)
    if unknown:
        raise ValueError(
            f"unknown key(s) in kvblend config file {path}: {', '.join(unknown)}; "
            f"known keys: {', '.join(Settings.model_fields)}"
        )


def load_settings(yaml_path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build Settings from flags (``overrides``), environment, an optional YAML file, defaults.

    Overrides whose value is None are dropped, so CLI flags the user left unset don't hide
    what the environment or the YAML file says.
    """
    path = Path(yaml_path).expanduser() if yaml_path is not None else None
    if path is not None:
        _check_yaml(path)
    flags = {name: value for name, value in overrides.items() if value is not None}
    token = _yaml_path.set(path)
    try:
        return Settings(**flags)
    finally:
        _yaml_path.reset(token)
