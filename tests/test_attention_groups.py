"""How query rows are grouped into attention calls, and that the grouping never changes a row."""

import pytest
import torch
import torch.nn.functional as F

from kvblend.model.runner import KEY_BLOCK, attend, query_groups


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
