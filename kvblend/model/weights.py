"""Weight formats: how a model's linear layers hold their weights and which kernel multiplies them.

- `fp32`, `bf16`: dense weights in that dtype, torch's own matrix product (oneDNN).
- `int8`: weights int8 per output channel, activations int8 per row, quantized at each call;
  products in int32 with `torch._int_mm` (VNNI where the CPU has it), after a Hadamard rotation.
  Rows are quantized alone and int32 sums are exact, so a row's output depends on the rows batched
  with it only as far as the rotation's product does (it rounds rows alike in whole decode blocks).
- `int4`: weights 4-bit in groups of `INT4_GROUP` with a scale and zero each, activations left in
  their dtype (`torch._weight_int4pack_mm_for_cpu`): the smallest form, for memory, not for speed.
- `bf16-fp32`: with fp32 activations, on CPUs without bf16 products: every linear layer's weights
  (and a plain embedding with its tied output head) held in bf16, half fp32's memory, and widened
  to fp32 into one reused buffer for each product (`WidenedLinear`), so the products stay fp32's.
  The model's KV is held in bf16 too (`LoadedModel.kv_dtype`).
- `fp16-fp32`: the same, held in fp16: 11 significant bits where bf16 has 8, the same bytes. fp16
  reaches 65,504; the largest |K| and |V| of a 1k-token HotpotQA prompt were 25 and 17 on SmolLM2,
  216 and 19 on Qwen2.5 0.5B, 98 and 138 on Gemma 3 270M (KV past the range saturates).

int8 and int4 change only the decoder layers' MLP (`QUANTIZED_PART`): it holds nine tenths of a layer's
weights and products, while the attention projections, quantized too, carried most of the error
(dev HotpotQA 36-46, Qwen2.5 0.5B: mean KL against fp32 0.0197 with every projection int8, 0.0085
with the MLP alone). int8 rotates each product's input and weights by a block Hadamard matrix
first (`Int8Linear`), and leaves the down projection dense (`DENSE_IN_MLP`): its input,
silu(gate) * up, has the strongest outlier channels. Chosen on dev HotpotQA 30-59, against fp32
full prefill: gate and up int8 KL 0.0015 unrotated, 0.0010 rotated (rows rotated in fp32
then); the whole MLP 0.0074 and 0.0012; bf16 0.0005. There the embedding, the norms, attention
and the output head keep the activation dtype. `auto` keeps dense weights except where
`auto_weights` picks int8 or fp16-fp32.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

WEIGHTS = ("auto", "fp32", "bf16", "int8", "int4", "bf16-fp32", "fp16-fp32")
HELD = "fp16-fp32"  # what `auto` holds weights and KV in where it computes in fp32 on a CPU
# The formats that hold weights and KV in half precision for fp32 products, and the dtype each holds.
HELD_DTYPES = {"bf16-fp32": torch.bfloat16, "fp16-fp32": torch.float16}
INT4_GROUP = 64
ROTATION_BLOCKS = (128, 64, 32)  # int8's Hadamard block: the largest that divides the input


class WeightsError(ValueError):
    """An unknown weight format, or one the activation dtype cannot use."""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def auto_weights(dtype: torch.dtype, device: torch.device, int8_checked: bool = False,
                 dtype_auto: bool = False) -> str:
    """Dense weights in the activation dtype, except fp16-fp32 where `auto` chose fp32 on a CPU
    (one without bf16 products: half the memory, fp32's prefill speed; fp16 rather than bf16 for its
    3 more significant bits: held out, fp16 changed none of 120 answers across three models where
    bf16 changed 8 on SmolLM2, 3 naming another entity), and int8 for a model whose int8 full prefill held
    its answers on held-out records (`int8_checked`), on a CPU where int8 pays (`int8_pays`). On
    Qwen2.5 1.5B int8 named another entity than fp32 full's on 1 of 30 held-out HotpotQA and 1 of 30
    MuSiQue answers (bf16: 2 and 1); on the 0.5B on 0 and 3 (bf16: 0 and 1), so the 0.5B stays
    dense (docs/results.md#weight-formats)."""
    if int8_checked and device.type == "cpu" and dtype == torch.bfloat16 and int8_pays():
        return "int8"
    if dtype_auto and device.type == "cpu" and dtype == torch.float32:
        return HELD
    return dense_format(dtype)


def int8_pays(flags: set[str] | None = None) -> bool:
    """Where int8 was measured faster than bf16: bf16 products on AVX512-BF16 and int8 ones on
    AVX512-VNNI. Full prefill in int8 ran 1.21-1.24x bf16's on Qwen2.5 1.5B on a Zen 4 EPYC, and
    1.08-1.11x on the 0.5B on an EPYC with full-width AVX512-BF16 (the whole MLP int8 then). Not
    with AMX: oneDNN runs bf16 on its tiles and torch's int8 product does not, and int8 full
    prefill took 1.23-1.37x bf16's time on the 0.5B on an AMX Xeon."""
    flags = cpu_flags() if flags is None else flags
    return {"avx512_bf16", "avx512_vnni"} <= flags and "amx_bf16" not in flags


def dense_format(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def resolve_weights(weights: str, device: torch.device, dtype: torch.dtype, int8_checked: bool = False,
                    dtype_auto: bool = False) -> str:
    """The format to load: `auto` by auto_weights, a named one checked against device and dtype."""
    if weights not in WEIGHTS:
        raise WeightsError(f"unknown weights {weights!r}; choose {', '.join(WEIGHTS)}")
    if weights == "auto":
        return auto_weights(dtype, device, int8_checked, dtype_auto)
    if weights in HELD_DTYPES and dtype != torch.float32:
        raise WeightsError(f"weights={weights} computes in fp32: use dtype float32, "
                           f"not {str(dtype).removeprefix('torch.')}")
    if weights in QUANTIZED and device.type != "cpu":
        raise WeightsError(f"weights={weights} has CPU kernels only; use bf16 on {device.type}")
    if weights in QUANTIZED and dtype not in (torch.float32, torch.bfloat16):
        raise WeightsError(f"weights={weights} needs dtype float32 or bfloat16, "
                           f"not {str(dtype).removeprefix('torch.')}")
    if weights not in QUANTIZED and weights != dense_format(dtype):
        raise WeightsError(f"weights={weights} with dtype={str(dtype).removeprefix('torch.')}: "
                           "dense weights are held in the activation dtype")
    return weights


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's n x n matrix of +-1 with H H^T = n I (n a power of two): exact in any dtype."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def rotation_block(in_features: int) -> int:
    """The largest Hadamard block of ROTATION_BLOCKS that divides in_features (0: none does)."""
    return next((b for b in ROTATION_BLOCKS if in_features % b == 0), 0)


def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [n, in] times the block-diagonal matrix of h's along its input, in x's dtype."""
    n, d = x.shape
    return (x.view(n, d // h.shape[0], h.shape[0]) @ h.to(x.dtype)).view(n, d)


def quantize_rows(x: torch.Tensor, in_features: int,
                  h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., in] (rotated by `rotate` with h first, where given, in x's dtype) -> int8 rows
    [n, in] and their fp32 scales [n, 1] (symmetric, per row). In fp32 from there: torch's
    mixed-dtype and inf-norm paths measured 4-5x slower than these."""
    x2 = x.reshape(-1, in_features)
    if h is not None:
        x2 = rotate(x2, h)
    x2 = x2.to(torch.float32, copy=h is None)  # never the caller's tensor
    scale = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    return x2.div_(scale).round_().to(torch.int8), scale


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W int8 per output channel and x int8 per row (dynamic), both first
    rotated by the same block-diagonal Hadamard matrix H along the input: (x H)(W H / b)^T = x W^T
    for blocks of b, and the rotation spreads a row's outlier channels over its block, so one
    scale per row rounds the rest less (relative error of Qwen2.5 0.5B's gate and up products on
    two HotpotQA prompts: 0.0133 -> 0.0083; its down projection's 0.046 -> 0.011; bf16 0.003;
    experiments/int8_rotation.py). The rows rotate in the activation dtype: H's entries are +-1,
    exact in bf16, and bf16's rounding is small against int8's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        block = rotation_block(self.in_features)
        self.register_buffer("h", hadamard(block).to(dtype) if block else None)
        if block:
            w = rotate(w, self.h) / block  # +-1 entries: exact in any dtype
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        # [in, out], contiguous in the layout _int_mm reads fastest.
        self.register_buffer("qweight_t", (w / scale[:, None]).round().to(torch.int8).t().contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x, self.in_features, self.h)
        y = torch._int_mm(xq, self.qweight_t).float().mul_(xs).mul_(self.scale).to(self.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        rot = f", Hadamard blocks of {self.h.shape[0]}" if self.h is not None else ""
        return f"in={self.in_features}, out={self.out_features}, int8 weights and activations{rot}"


class Int4Linear(torch.nn.Module):
    """y = x W^T + b with W 4-bit, asymmetric in groups of INT4_GROUP along the input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()
        out_f, in_f = w.shape
        if in_f % INT4_GROUP:
            raise WeightsError(f"int4 weights need in_features divisible by {INT4_GROUP}, got {in_f}")
        g = w.view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
        # The kernel's zero is the value at code 8: w = (q - 8) * scale + zero.
        zero = lo + 8 * scale
        self.in_features, self.out_features = in_f, out_f
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(self.dtype), self.packed,
                                              INT4_GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 weights in groups of {INT4_GROUP}"


# The fp32 buffer a product widens into: every decoder linear of the 0.5B (the largest, 4,864 x 896, is
# 16.6 MiB) in one block, so its product writes its output directly instead of through a strided slice.
WIDEN_BYTES = 18 << 20
_widen = threading.local()  # one buffer per thread that runs a model; layers run one after another


def widened(w: torch.Tensor) -> torch.Tensor:
    """w (bf16 or fp16) in fp32, in this thread's reused buffer: valid until the next call. A fresh
    tensor per product would be a fresh mapping too (glibc maps blocks this large), faulting its
    pages in on every call."""
    buf = getattr(_widen, "buf", None)
    if buf is None or buf.numel() < w.numel():
        buf = _widen.buf = torch.empty(max(w.numel(), WIDEN_BYTES // 4), dtype=torch.float32)
    return buf[: w.numel()].view(w.shape).copy_(w)


class WidenedLinear(torch.nn.Module):
    """y = x W^T + b in fp32 with W held in bf16 or fp16: each product widens W, in blocks of output
    rows of at most WIDEN_BYTES (an output head is 544 MB in fp32 on Qwen2.5 0.5B), into one reused
    buffer. Widening is exact, so this is fp32's product with W rounded to `held` once. Where
    gradients flow (adapter training), W is widened into a tensor of its own that autograd keeps."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 held: torch.dtype = torch.bfloat16):
        super().__init__()  # dtype: the quantized formats' signature; the products here are always fp32
        self.register_buffer("weight", weight.detach().to(held))
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() and x.requires_grad:
            return F.linear(x, w.float(), self.bias)
        most = max(1, WIDEN_BYTES // (4 * self.in_features))
        if most >= self.out_features:
            return F.linear(x, widened(w), self.bias)
        blocks = math.ceil(self.out_features / most)
        step = math.ceil(self.out_features / blocks)  # near-equal blocks: no sliver of a few rows
        x2 = x.reshape(-1, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        for i in range(0, self.out_features, step):
            y[:, i:i + step] = x2 @ widened(w[i:i + step]).t()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        held = str(self.weight.dtype).removeprefix("torch.")
        return f"in={self.in_features}, out={self.out_features}, {held} weights, fp32 products"


class WidenedEmbedding(torch.nn.Module):
    """A plain embedding whose table is held in bf16 or fp16: rows looked up, then widened (exact)."""

    def __init__(self, weight: torch.Tensor, held: torch.dtype = torch.bfloat16):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(held))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()


QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear,
             **{f: functools.partial(WidenedLinear, held=d) for f, d in HELD_DTYPES.items()}}
# Per format, the part of a decoder layer it replaces linears in ("": the whole layer).
QUANTIZED_PART = {"int8": "mlp", "int4": "mlp", **{f: "" for f in HELD_DTYPES}}
# Per quantized format, the MLP projections it leaves dense. int8's down projection gained about
# 1 ms a layer over bf16 on Qwen2.5 0.5B (1,024 rows: its 4,864-wide input costs as much to rotate
# and quantize as its product saves) for most of int8's error; int4 quantizes weights only.
DENSE_IN_MLP = {"int8": ("down_proj",), "int4": (), **{f: () for f in HELD_DTYPES}}


def format_key(weights: str) -> str:
    """What a quantized format computes, for the model fingerprint: when it changes (which
    projections, the rotation), chunk KV stored under the old form stops serving the new."""
    key = f"weights={weights}"
    if DENSE_IN_MLP[weights]:
        key += f" dense={','.join(DENSE_IN_MLP[weights])}"
    if weights == "int8":
        key += f" hadamard={','.join(map(str, ROTATION_BLOCKS))}"
    return key


def quantized_linear(weights: str, weight: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.nn.Module:
    """A linear layer in a quantized format, from its dense weight (fp32 where there is one)."""
    return QUANTIZED[weights](weight, bias, dtype)


def quantized_paths(layer: torch.nn.Module, weights: str) -> list[str]:
    """The linear layers of one decoder layer that format `weights` replaces, by module path."""
    part = QUANTIZED_PART[weights]
    return [f"{part}.{n}" if part else n for n, m in layer.get_submodule(part).named_modules()
            if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in DENSE_IN_MLP[weights]]


def quantize_layer(layer: torch.nn.Module, weights: str, dtype: torch.dtype) -> None:
    """Replace the decoder layer's quantized_paths by the format's module, in place."""
    if weights not in QUANTIZED:
        return
    for path in quantized_paths(layer, weights):
        parent, _, attr = path.rpartition(".")
        lin = layer.get_submodule(path)
        setattr(layer.get_submodule(parent), attr, quantized_linear(weights, lin.weight, lin.bias, dtype))
