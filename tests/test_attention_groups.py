"""How query rows are grouped into attention calls, and that the grouping never changes a row."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvblend.model.runner import KEY_BLOCK, attend, biased_groups, one_call_group, query_groups


def _check_partition(groups, q_pos, n_keys):
    covered = []
    for g in groups:
        rows = list(range(q_pos.shape[0]))[g.rows]
        covered += rows
        assert g.end == n_keys or g.end % KEY_BLOCK == 0  # calls end on a key block
        assert g.end > int(q_pos[rows[-1]])  # every row sees its own position
        key_pos = torch.arange(g.end)
        torch.testing.assert_close(g.mask, key_pos[None, :] <= q_pos[rows][:, None], rtol=0, atol=0)
    assert covered == list(range(q_pos.shape[0]))  # every row once, in order


def test_few_scattered_rows_share_one_call():
    seps = [torch.arange(a, a + 3) for a in range(600, 5600, 600)]  # separators spread over the prompt
    q_pos = torch.cat([*seps, torch.arange(5950, 6000)])  # and a suffix
    groups = query_groups(q_pos, 6000)
    assert len(groups) <= 2
    _check_partition(groups, q_pos, 6000)


def test_many_scattered_rows_split_by_key_blocks():
    g = torch.Generator().manual_seed(0)
    q_pos = torch.randperm(6000, generator=g)[:1200].sort().values
    groups = query_groups(q_pos, 6000)
    assert len(groups) >= 6  # rows early in the prompt do not pay for the keys after them
    _check_partition(groups, q_pos, 6000)


def test_fresh_prefill_and_decode_take_the_plain_kernels():
    (prefill,) = query_groups(torch.arange(700), 700)
    assert prefill.causal and prefill.mask is None
    (decode,) = query_groups(torch.tensor([699]), 700)
    assert decode.mask is None and decode.end == 700
    (short,) = query_groups(torch.tensor([5, 6]), KEY_BLOCK)  # under one block: masked, whole block
    assert short.end == KEY_BLOCK and short.mask.shape == (2, KEY_BLOCK)


@pytest.mark.parametrize("rows", ["suffix", "scattered", "tail"])
def test_rows_attend_exactly_as_in_a_full_causal_pass(rows):
    """A row's attention is the same bit for bit whichever rows share its call."""
    g = torch.Generator().manual_seed(1)
    T = 1500
    q, k, v = (torch.randn(h, T, 16, generator=g) for h in (6, 2, 2))
    full = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
    pick = {"suffix": torch.arange(1400, T), "tail": torch.arange(30, T),
            "scattered": torch.randperm(T, generator=g)[:300].sort().values}[rows]
    out = attend(q[:, pick], k, v, query_groups(pick, T), q.shape[-1] ** -0.5)
    assert torch.equal(out, full[:, pick])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_under_one_key_block_attends_as_the_reference(dtype):
    """A sequence shorter than a key block decodes over the whole block, the keys past its own
    masked out (whatever they hold): its row is softmax(q k^T * scale) over its own keys."""
    g = torch.Generator().manual_seed(4)
    T = 100
    q, k, v = (torch.randn(h, KEY_BLOCK, 16, generator=g).to(dtype) for h in (6, 2, 2))
    k[:, T:], v[:, T:] = 1e4, -1e4  # unwritten slots: a leak of either would show
    (group,) = query_groups(torch.tensor([T - 1]), KEY_BLOCK)
    assert group.mask is not None and group.end == KEY_BLOCK
    out = attend(q[:, T - 1:T], k, v, [group], 16 ** -0.5)
    kk, vv = k[:, :T].float().repeat_interleave(3, dim=0), v[:, :T].float().repeat_interleave(3, dim=0)
    ref = (q[:, T - 1:T].float() @ kk.transpose(1, 2) * 16 ** -0.5).softmax(-1) @ vv
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", ["scattered", "decode", "causal"])
def test_biased_groups_add_the_key_bias_to_the_logits(rows):
    """Float masks from biased_groups: softmax(q k^T * scale + bias) over the keys a row sees."""
    g = torch.Generator().manual_seed(2)
    T = 900
    q, k, v = (torch.randn(h, T, 16, generator=g) for h in (4, 2, 2))
    bias = torch.where(torch.rand(T, generator=g) < 0.5, math.log(0.3), 0.0)
    pick = {"scattered": torch.randperm(T, generator=g)[:200].sort().values, "decode": torch.tensor([T - 1]),
            "causal": torch.arange(T)}[rows]
    scale = 16 ** -0.5
    out = attend(q[:, pick], k, v, biased_groups(query_groups(pick, T), bias), scale)
    kk, vv = k.repeat_interleave(2, dim=0), v.repeat_interleave(2, dim=0)
    logits = q[:, pick] @ kk.transpose(1, 2) * scale + bias
    logits = logits.masked_fill(torch.arange(T)[None, :] > pick[:, None], float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ vv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ["suffix", "scattered", "tail"])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("window", [None, 200])
def test_one_call_groups_attend_as_the_reference(rows, biased, window):
    """The grouping CUDA takes (one call, the tail by the lower-right causal kernel) gives every
    row softmax(q k^T * scale + bias) over the keys it sees, here on the CPU's kernels."""
    g = torch.Generator().manual_seed(3)
    T = 1500
    q, k, v = (torch.randn(h, T, 16, generator=g) for h in (6, 2, 2))
    bias = torch.where(torch.rand(T, generator=g) < 0.5, math.log(0.3), 0.0) if biased else torch.zeros(T)
    pick = {"suffix": torch.arange(1400, T), "tail": torch.arange(30, T),
            "scattered": torch.randperm(T, generator=g)[:300].sort().values}[rows]
    group = one_call_group(pick, window)
    assert group.causal == (rows != "scattered" and window is None)
    groups = biased_groups([group], bias) if biased else [group]
    out = attend(q[:, pick], k, v, groups, 16 ** -0.5)
    kk, vv = k.repeat_interleave(3, dim=0), v.repeat_interleave(3, dim=0)
    logits = q[:, pick] @ kk.transpose(1, 2) * 16 ** -0.5 + bias
    key_pos = torch.arange(T)[None, :]
    hidden = key_pos > pick[:, None]
    if window is not None:
        hidden |= key_pos <= pick[:, None] - window
    logits = logits.masked_fill(hidden, float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ vv, atol=1e-5, rtol=1e-5)
