"""Weight formats: the quantized layers' numbers, loading a folder layer by layer, the `auto` rule,
and the fingerprint that keeps chunk KV of one format from serving another."""

import pytest
import torch
from tiny_models import tiny_hf

from kvblend.blend.segment import join_segments
from kvblend.config import Settings
from kvblend.engine.engine import Engine
from kvblend.model import weights as weight_formats
from kvblend.model.aliases import int8_checked
from kvblend.model.loader import ModelLoadError, fingerprint, load_model
from kvblend.model.file_embedding import FileEmbedding
from kvblend.model.runner import DECODE_ROW_BLOCK
from kvblend.model.weights import (Int4Linear, Int8Linear, WeightsError, WidenedEmbedding, WidenedLinear, hadamard,
                                   resolve_weights, rotation_block)

CPU = torch.device("cpu")


def dense(n_in=128, n_out=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, n_in, generator=g) * 0.05, torch.randn(n_out, generator=g) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_dense_product_and_each_row_is_its_own(dtype):
    w, b = dense()
    lin = Int8Linear(w, b, dtype)
    x = torch.randn(2, 9, 128).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w, b)
    y = lin(x)
    assert y.shape == (2, 9, 96) and y.dtype == dtype
    assert (y.float() - ref).norm() / ref.norm() < 0.02
    # Rows in whole decode blocks give the same output as in a larger batch: each row is quantized
    # alone, int32 sums are exact, and the rotation's product rounds a row alike in whole blocks.
    block = x[1, :DECODE_ROW_BLOCK]
    assert torch.equal(lin(block), y[1, :DECODE_ROW_BLOCK])
    x_before = x.clone()
    lin(x)
    assert torch.equal(x, x_before)  # the caller's activations are never quantized in place


def test_int8_rotates_rows_and_weights_by_one_orthonormal_hadamard_block(monkeypatch):
    for n in (32, 64, 128):
        h = hadamard(n)
        assert torch.equal(h @ h.t(), n * torch.eye(n)) and torch.equal(h.abs(), torch.ones(n, n))
    assert (rotation_block(896), rotation_block(576), rotation_block(1504), rotation_block(100)) == (128, 64, 32, 0)
    # One outlier channel in every row, as a norm's output has: rotated, int8 rounds the rest less.
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 128, generator=g) * 0.05, torch.randn(64, 128, generator=g)
    x[:, 7] *= 40
    ref = torch.nn.functional.linear(x, w)
    rotated = Int8Linear(w, None, torch.float32)
    monkeypatch.setattr(weight_formats, "ROTATION_BLOCKS", ())
    plain = Int8Linear(w, None, torch.float32)
    assert rotated.h is not None and plain.h is None
    err = [((lin(x) - ref).norm() / ref.norm()).item() for lin in (rotated, plain)]
    assert err[0] < 0.5 * err[1]
    # No block divides the input: the layer runs unrotated.
    odd = Int8Linear(torch.randn(8, 100) * 0.05, None, torch.float32)
    assert odd.h is None and odd(torch.randn(3, 100)).shape == (3, 8)


def test_int4_linear_is_close_to_the_dense_product():
    w, b = dense()
    y = Int4Linear(w, b, torch.bfloat16)(torch.randn(5, 128).bfloat16())
    assert y.shape == (5, 96) and y.dtype == torch.bfloat16
    x = torch.randn(5, 128)
    ref = torch.nn.functional.linear(x, w, b)
    assert (Int4Linear(w, b, torch.float32)(x) - ref).norm() / ref.norm() < 0.15
    with pytest.raises(WeightsError, match="divisible by 64"):
        Int4Linear(torch.randn(8, 100), None, torch.float32)


def test_auto_keeps_dense_weights_in_the_activation_dtype(monkeypatch):
    monkeypatch.setattr(weight_formats, "cpu_flags", lambda: {"avx2"})
    assert resolve_weights("auto", CPU, torch.bfloat16) == "bf16"
    assert resolve_weights("auto", CPU, torch.float32) == "fp32"
    assert resolve_weights("auto", CPU, torch.bfloat16, int8_checked=True) == "bf16"
    assert resolve_weights("auto", torch.device("cuda"), torch.float16) == "fp16"
    assert resolve_weights("int8", CPU, torch.bfloat16) == "int8"


def test_auto_picks_int8_for_a_checked_model_where_int8_pays(monkeypatch):
    monkeypatch.setattr(weight_formats, "cpu_flags", lambda: {"avx2", "avx512_bf16", "avx512_vnni"})
    assert resolve_weights("auto", CPU, torch.bfloat16, int8_checked=True) == "int8"
    assert resolve_weights("auto", CPU, torch.bfloat16) == "bf16"  # a model nobody checked in int8
    assert resolve_weights("auto", CPU, torch.float32, int8_checked=True) == "fp32"  # measured in bf16 only
    assert resolve_weights("auto", torch.device("cuda"), torch.bfloat16, int8_checked=True) == "bf16"
    assert not weight_formats.int8_pays({"avx512_bf16", "avx512_vnni", "amx_bf16"})  # not measured on AMX
    assert not weight_formats.int8_pays({"avx512_vnni"})  # no bf16: fp32 activations, not measured
    assert int8_checked("qwen2.5-coder-1.5b-instruct") and not int8_checked("qwen2.5-coder-0.5b-instruct")
    assert not int8_checked("/some/model.gguf")


def test_formats_that_cannot_run_are_refused():
    with pytest.raises(WeightsError, match="unknown weights 'int3'"):
        resolve_weights("int3", CPU, torch.float32)
    with pytest.raises(WeightsError, match="CPU kernels only"):
        resolve_weights("int8", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(WeightsError, match="activation dtype"):
        resolve_weights("bf16", CPU, torch.float32)
    with pytest.raises(WeightsError, match="float32 or bfloat16"):
        resolve_weights("int8", CPU, torch.float16)
    with pytest.raises(WeightsError, match="computes in fp32: use dtype float32"):
        resolve_weights("bf16-fp32", CPU, torch.bfloat16)
    with pytest.raises(WeightsError, match="weights=fp16-fp32 computes in fp32"):
        resolve_weights("fp16-fp32", CPU, torch.float16)
    with pytest.raises(WeightsError, match="CPU kernels only"):
        resolve_weights("bf16-fp32", torch.device("cuda"), torch.float32)


def test_auto_holds_weights_in_fp16_only_where_auto_chose_fp32_on_a_cpu():
    assert resolve_weights("auto", CPU, torch.float32, dtype_auto=True) == "fp16-fp32"
    assert resolve_weights("auto", CPU, torch.float32) == "fp32"  # fp32 asked for: fp32's weights
    assert resolve_weights("auto", CPU, torch.bfloat16, dtype_auto=True) == "bf16"
    assert resolve_weights("bf16-fp32", CPU, torch.float32) == "bf16-fp32"
    assert resolve_weights("fp16-fp32", CPU, torch.float32) == "fp16-fp32"


@pytest.mark.parametrize("held", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("widen_bytes", [1 << 26, 96 * 128 * 4 // 3])  # one block; blocks of 32 output rows
@pytest.mark.parametrize("bias", [True, False])
def test_a_widened_linear_is_the_fp32_product_of_its_weights_rounded_once(monkeypatch, held, widen_bytes, bias):
    monkeypatch.setattr(weight_formats, "WIDEN_BYTES", widen_bytes)
    w, b = dense()
    b = b if bias else None
    lin = WidenedLinear(w, b, held=held)
    assert lin.weight.dtype == held and lin.weight.untyped_storage().nbytes() == w.numel() * 2
    x = torch.randn(3, 7, 128)
    ref = torch.nn.functional.linear(x, w.to(held).float(), b)
    with torch.inference_mode():
        y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (3, 7, 96)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)  # blocks change only the sums' kernel
    x.requires_grad_(True)  # adapter training: a gradient through the layer, its weights left frozen
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, w.to(held).float().sum(0).expand(3, 7, 128), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 95, 3]])
    assert torch.equal(WidenedEmbedding(w, held)(ids), w.to(held).float()[ids])


@pytest.mark.parametrize("fmt, half", [("bf16-fp32", torch.bfloat16), ("fp16-fp32", torch.float16)])
def test_a_held_load_holds_every_linear_and_a_tied_table_once_in_half_precision(tmp_path, fmt, half):
    path = tmp_path / "tied"
    tiny_hf("qwen2", tie_word_embeddings=True).save_pretrained(path)
    held = load_model(str(path), dtype="float32", weights=fmt, device="cpu")
    ref = load_model(str(path), dtype="float32", device="cpu")
    assert (held.weights, held.dtype, held.kv_dtype) == (fmt, torch.float32, half)
    assert held.fingerprint != ref.fingerprint
    for layer in held.hf.model.layers:
        assert not any(type(m) is torch.nn.Linear for m in layer.modules())
    embed, head = held.hf.get_input_embeddings(), held.hf.get_output_embeddings()
    assert isinstance(embed, WidenedEmbedding) and isinstance(head, WidenedLinear)
    assert head.weight.data_ptr() == embed.weight.data_ptr()  # one table
    big = [t for t in held.hf.state_dict().values() if t.dim() == 2]
    assert big and all(t.dtype == half for t in big)
    # The same model with its fp32 weights rounded to half precision once gives the same logits.
    for p in ref.hf.parameters():
        if p.dim() == 2:
            p.data = p.data.to(half).float()
    ids = torch.arange(1, 40)[None]
    with torch.inference_mode():
        torch.testing.assert_close(held.hf(ids).logits, ref.hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "qwen2"
    tiny_hf("qwen2").save_pretrained(path)
    return path


def test_the_layer_by_layer_loader_gives_transformers_weights(folder):
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 40)[None]
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(folder), dtype=dtype, device="cpu").hf
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        ours, theirs = model.state_dict(), ref.state_dict()
        # The untied input embedding is read from the file row by row, not loaded.
        assert isinstance(model.get_input_embeddings(), FileEmbedding)
        assert ours.keys() == theirs.keys() - {"model.embed_tokens.weight"}
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert torch.equal(model.get_input_embeddings()(ids), ref.get_input_embeddings()(ids))
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_an_embedding_is_read_from_its_file_only_where_that_is_exact(folder, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvblend.model.file_embedding import embed_from_file, file_rows

    path = folder / "model.safetensors"
    table = file_rows(path, "model.embed_tokens.weight")
    assert table is not None and table.dtype == torch.float32
    with safe_open(path, framework="pt") as f:
        whole = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(table.rows([5, 0, 5, whole.shape[0] - 1]), whole[[5, 0, 5, -1]])
    assert file_rows(path, "no.such.tensor") is None
    save_file({"e": torch.zeros(4, 4, dtype=torch.int8)}, tmp_path / "int8.safetensors")
    assert file_rows(tmp_path / "int8.safetensors", "e") is None  # a dtype not read here
    hf = tiny_hf("qwen2")
    assert embed_from_file(hf, path, "model.embed_tokens.weight", torch.float32)
    with pytest.raises(IndexError, match="out of range"):  # never a short read past the table
        hf.get_input_embeddings()(torch.tensor([1, whole.shape[0]]))
    tied = tiny_hf("qwen2", tie_word_embeddings=True)
    assert not embed_from_file(tied, path, "model.embed_tokens.weight", torch.float32)  # the head reads every row
    gemma = tiny_hf("gemma3")
    assert not embed_from_file(gemma, path, "model.embed_tokens.weight", torch.float32)  # it scales its rows


def test_a_quantized_load_replaces_every_decoder_linear_and_keys_its_kv_apart(folder):
    m8 = load_model(str(folder), dtype="float32", weights="int8", device="cpu")
    m32 = load_model(str(folder), dtype="float32", device="cpu")
    m4 = load_model(str(folder), dtype="float32", weights="int4", device="cpu")
    assert (m8.weights, m32.weights, m4.weights) == ("int8", "fp32", "int4")
    for a, b in zip(m8.hf.model.layers, m4.hf.model.layers):
        # int8: the MLP's gate and up projections; its down projection and attention's stay dense
        assert isinstance(a.mlp.gate_proj, Int8Linear) and isinstance(a.mlp.up_proj, Int8Linear)
        assert type(a.mlp.down_proj) is torch.nn.Linear and type(a.self_attn.q_proj) is torch.nn.Linear
        # int4 (weights only): every MLP projection
        assert not any(isinstance(m, torch.nn.Linear) for m in b.mlp.modules())
        assert isinstance(b.mlp.down_proj, Int4Linear) and type(b.self_attn.q_proj) is torch.nn.Linear
    assert len({m8.fingerprint, m32.fingerprint, m4.fingerprint}) == 3
    # Dense weights are the dtype's: the fingerprint chunk KV was stored under before formats existed.
    assert m32.fingerprint == fingerprint(m32.hf.config, _weights_id(folder), torch.float32)
    ids = torch.arange(1, 30)[None]
    ref = m32.hf(ids).logits
    assert (m8.hf(ids).logits - ref).norm() / ref.norm() < 0.05


def test_auto_int8_reaches_the_loader_and_adapter_training_keeps_dense_weights(folder, monkeypatch):
    from kvblend.cli_adapter import training_engine
    from kvblend.model import loader

    monkeypatch.setattr(weight_formats, "cpu_flags", lambda: {"avx512_bf16", "avx512_vnni"})
    monkeypatch.setattr(loader, "int8_checked", lambda name: name == str(folder))
    assert load_model(str(folder), dtype="bfloat16", device="cpu").weights == "int8"
    # Gradients cannot flow through int8 products: training loads the dense form of `auto`.
    monkeypatch.setattr("kvblend.engine.engine.Engine", lambda model, settings: model)
    assert training_engine(Settings(model=str(folder), dtype="bfloat16", device="cpu")).weights == "bf16"


def test_the_int8_fingerprint_names_what_int8_computes(folder, monkeypatch):
    config, wid = load_model(str(folder), dtype="float32", device="cpu").hf.config, _weights_id(folder)
    now = fingerprint(config, wid, torch.float32, "int8")
    monkeypatch.setattr(weight_formats, "ROTATION_BLOCKS", ())
    unrotated = fingerprint(config, wid, torch.float32, "int8")
    monkeypatch.setitem(weight_formats.DENSE_IN_MLP, "int8", ())
    assert len({now, unrotated, fingerprint(config, wid, torch.float32, "int8")}) == 3


def _weights_id(folder):
    from kvblend.model.loader import weights_identity

    return weights_identity(folder)


def test_load_model_names_a_bad_format(folder):
    with pytest.raises(ModelLoadError, match="unknown weights"):
        load_model(str(folder), weights="int2")


def test_blend_at_ratio_one_equals_full_prefill_with_int8_weights(folder):
    sep = [7, 7, 3]
    engine = Engine(load_model(str(folder), dtype="float32", weights="int8", device="cpu"),
                    Settings(check_layers=[1], recompute_ratios=[0.15], min_recompute_tokens=0, kv_half=False),
                    sep_ids=sep)
    g = torch.Generator().manual_seed(0)
    cs = [torch.randint(10, 300, (24,), generator=g).tolist() for _ in range(3)]
    engine.precompute(join_segments([1, 20, 21], cs, [30, 31, 32], sep))
    ids = join_segments([1, 20, 21], [cs[2], cs[0], cs[1]], [30, 31, 32], sep)
    _, full = engine.prefill(ids, "full")
    from dataclasses import replace

    plan, blend = engine.prefill(ids, "blend", blend_cfg=replace(engine.blend_cfg, ratios=[1.0]))
    assert plan.hits == 3 and blend.stats.reused_tokens == 0
    torch.testing.assert_close(blend.logits, full.logits, atol=1e-4, rtol=1e-4)
