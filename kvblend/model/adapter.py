"""Chunk adapters: low-rank deltas on a model's attention projections, applied only while chunk KV
is precomputed.

A chunk stored apart from the others is read by the user's own, unchanged model; the adapter
changes only how that stored KV is made, so that the reader finds it closer to what a full
prefill of the whole prompt would have given it. The reader (full prefill, the question, the
rows blend recomputes, the decode) never runs with it. Learned from the model's own full prefill
(kvblend/train).

Each targeted projection W (q, k, v, o of every layer) gains `scale * B @ A @ x`, A [rank, in],
B [out, rank]. B starts at zero, so an untrained adapter changes nothing. An adapter's identity
(a hash of its weights and shape) is part of every chunk key made with it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT = "kvblend-chunk-adapter-1"
TARGETS = ("q", "k", "v", "o")


class AdapterError(ValueError):
    """An adapter file that cannot be read, or that does not fit the model."""


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each targeted projection of a transformers config."""
    hidden = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden)}


class ChunkAdapter(torch.nn.Module):
    def __init__(self, n_layers: int, shapes: dict[str, tuple[int, int]], rank: int = 8, alpha: float = 16.0,
                 info: dict | None = None, seed: int = 0):
        super().__init__()
        if rank < 1:
            raise AdapterError(f"adapter rank must be >= 1, got {rank}")
        self.n_layers, self.shapes, self.rank, self.alpha = n_layers, dict(shapes), rank, alpha
        self.info = dict(info or {})  # what it was trained for and on: kept in the file, not in the identity
        gen = torch.Generator().manual_seed(seed)
        self.a = torch.nn.ParameterDict()
        self.b = torch.nn.ParameterDict()
        for layer in range(n_layers):
            for t in TARGETS:
                n_in, n_out = shapes[t]
                # A as in LoRA (uniform, fan-in scaled); B zero: the untrained adapter is the identity.
                bound = 1 / n_in ** 0.5
                a = torch.empty(rank, n_in).uniform_(-bound, bound, generator=gen)
                self.a[f"{layer}_{t}"] = torch.nn.Parameter(a)
                self.b[f"{layer}_{t}"] = torch.nn.Parameter(torch.zeros(n_out, rank))
        self._identity: str | None = None

    @classmethod
    def for_model(cls, hf_config, rank: int = 8, alpha: float = 16.0, info: dict | None = None,
                  seed: int = 0) -> "ChunkAdapter":
        return cls(hf_config.num_hidden_layers, projection_shapes(hf_config), rank, alpha, info, seed)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to projection `target` of `layer` for inputs x [n, in]."""
        a, b = self.a[f"{layer}_{target}"], self.b[f"{layer}_{target}"]
        return (x @ a.to(x.device, x.dtype).T) @ (b.to(x.device, x.dtype).T * self.scale)

    def check_fits(self, hf_config) -> None:
        if hf_config.num_hidden_layers != self.n_layers or projection_shapes(hf_config) != self.shapes:
            raise AdapterError(f"the chunk adapter ({self.n_layers} layers, projections {self.shapes}) does not fit "
                               f"this model ({hf_config.num_hidden_layers} layers, {projection_shapes(hf_config)})")

    @property
    def identity(self) -> str:
        """A short hash of the weights and shape: part of every chunk key made with this adapter.
        Computed once; an adapter being trained is keyed by `fresh_identity` instead."""
        if self._identity is None:
            self._identity = self.fresh_identity()
        return self._identity

    def fresh_identity(self) -> str:
        h = hashlib.sha256(json.dumps([FORMAT, self.n_layers, self.shapes, self.rank, self.alpha]).encode())
        for name, p in sorted(self.state_dict().items()):
            h.update(name.encode() + b"\0")
            h.update(p.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "n_layers": str(self.n_layers), "rank": str(self.rank), "alpha": repr(self.alpha),
                "shapes": json.dumps(self.shapes), "info": json.dumps(self.info)}
        tensors = {name: p.detach().float().contiguous() for name, p in self.state_dict().items()}
        tmp = path.with_name(f".tmp-{path.name}")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)  # a reader never sees half a file

    @classmethod
    def load(cls, path: str | Path) -> "ChunkAdapter":
        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"chunk adapter file not found: {path}")
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
            if meta.get("format") != FORMAT:
                raise AdapterError(f"{path} is not a {FORMAT} file")
            shapes = {k: tuple(v) for k, v in json.loads(meta["shapes"]).items()}
            adapter = cls(int(meta["n_layers"]), shapes, int(meta["rank"]), float(meta["alpha"]),
                          json.loads(meta.get("info", "{}")))
            adapter.load_state_dict(tensors)
        except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
            if isinstance(e, AdapterError):
                raise
            raise AdapterError(f"chunk adapter {path} cannot be read: {e}") from e
        return adapter


SHIPPED = Path(__file__).parent / "adapters"  # <model alias>.safetensors, trained by `kvblend adapter train`


def shipped_adapter_path(model: str) -> Path | None:
    path = SHIPPED / f"{model}.safetensors"
    return path if path.is_file() else None


def resolve_adapter(setting: str, model: str, hf_config) -> ChunkAdapter | None:
    """The chunk adapter a `chunk_adapter` setting names for this model: "auto" the shipped one
    (None where the model has none), "none" none, else the file at that path, checked to fit."""
    if setting == "none":
        return None
    path = shipped_adapter_path(model) if setting == "auto" else Path(setting).expanduser()
    if path is None:
        return None
    adapter = ChunkAdapter.load(path)
    adapter.check_fits(hf_config)
    adapter.requires_grad_(False)
    return adapter
