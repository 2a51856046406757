"""`cat_rows` (the q rows of a draft batch joined for the verifier) and `inverse_cdf` with a reused CDF
buffer: the same values as `torch.cat` / a fresh draw, and no copy where the rows already lie in order."""

import torch
from deepinfer_spec import cat_rows, inverse_cdf


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_blocks_in_order_in_one_tensor_are_joined_without_a_copy():
    q = torch.randn(4, 3, 11, dtype=torch.float64)  # [requests, drafts, V], as the draft sampler keeps it
    parts = [q[0], q[1][:3], q[2], q[3]]
    joined = cat_rows(parts)
    assert torch.equal(joined, torch.cat(parts)) and _shares(joined, q)
    # empty blocks (requests that verify no drafts, from anywhere) do not break the run
    empty = torch.zeros(0, 11, dtype=torch.float64)
    joined = cat_rows([empty, q[0], empty, q[1], q[2]])
    assert torch.equal(joined, torch.cat([q[0], q[1], q[2]])) and _shares(joined, q)
    # a block starting mid-tensor is fine too
    assert _shares(cat_rows([q[1], q[2]]), q) and torch.equal(cat_rows([q[1], q[2]]), q[1:3].reshape(-1, 11))


def test_blocks_out_of_order_cut_or_foreign_are_copied():
    q = torch.randn(3, 4, 7, dtype=torch.float64)
    other = torch.randn(2, 7, dtype=torch.float64)
    for parts in (
        [q[1], q[0]],  # out of order
        [q[0][:2], q[1][:2]],  # a gap: the first request verifies fewer drafts than it drafted
        [q[0], other],  # another tensor
        [q[0], q[1].float().double()],  # a copy of the right values
        [q[:, 0], q[:, 1]],  # not contiguous
    ):
        joined = cat_rows(parts)
        assert torch.equal(joined, torch.cat(parts)) and not _shares(joined, q)
    assert cat_rows([torch.zeros(0, 7)]).shape == (0, 7)


def test_inverse_cdf_with_a_reused_buffer_draws_the_same_tokens():
    gen = torch.Generator().manual_seed(4)
    buffer = torch.empty(5, 40, dtype=torch.float64)
    for _ in range(3):
        w = torch.rand(5, 40, generator=gen, dtype=torch.float64)
        w[w < 0.6] = 0.0  # filtered tokens
        w[2] = 0.0  # a row without any token
        u = torch.rand(5, generator=gen, dtype=torch.float64)
        assert torch.equal(inverse_cdf(w, u, cdf=buffer), inverse_cdf(w, u))
        assert torch.equal(buffer, torch.cumsum(w, -1))
