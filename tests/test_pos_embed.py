"""Tests for ssl_vit.model.pos_embed: resizing position embeddings to a new grid."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssl_vit.model.pos_embed import interpolate_pos_embed


def _table(grid_HWD: torch.Tensor, prefix_PD: torch.Tensor) -> torch.Tensor:
    """[H, W, D] grid + [P, D] prefix -> [1, P + H*W, D] table, patches in row-major order."""
    H, W, D = grid_HWD.shape
    return torch.cat([prefix_PD, grid_HWD.reshape(H * W, D)])[None]


def _ramp(H: int, W: int, a: float, b: float, c: float) -> torch.Tensor:
    """[H, W, 1] with v[i, j] = a*i + b*j + c."""
    i = torch.arange(H, dtype=torch.float64)[:, None]
    j = torch.arange(W, dtype=torch.float64)[None, :]
    return (a * i + b * j + c)[..., None].float()


def _source_coord(n_out: int, n_in: int) -> torch.Tensor:
    """align_corners=False: output pixel i' samples input (i' + 0.5) * n_in / n_out - 0.5."""
    return (torch.arange(n_out, dtype=torch.float64) + 0.5) * n_in / n_out - 0.5


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_identity_when_grid_unchanged(mode: str) -> None:
    pe = torch.randn(1, 1 + 7 * 7, 16)
    out = interpolate_pos_embed(pe, 7, mode=mode)
    assert torch.equal(out, pe)
    non_square = torch.randn(1, 2 + 4 * 6, 8).to(torch.bfloat16)
    out = interpolate_pos_embed(non_square, (4, 6), num_prefix_tokens=2, old_grid=(4, 6))
    assert out.dtype == torch.bfloat16 and torch.equal(out, non_square)


@pytest.mark.parametrize("num_prefix", [0, 1, 2])
def test_prefix_tokens_kept_and_shape(num_prefix: int) -> None:
    pe = torch.randn(1, num_prefix + 4 * 4, 8)
    out = interpolate_pos_embed(pe, (6, 5), num_prefix_tokens=num_prefix)
    assert out.shape == (1, num_prefix + 6 * 5, 8)
    assert torch.equal(out[:, :num_prefix], pe[:, :num_prefix])


def test_bilinear_reproduces_ramp_non_square() -> None:
    # 8x6 -> 12x9; a != b so a transposed or column-major layout would fail.
    H, W, new_H, new_W = 8, 6, 12, 9
    a, b, c = 2.0, -3.0, 0.5
    pe = _table(_ramp(H, W, a, b, c), torch.full((1, 1), 7.0))
    out = interpolate_pos_embed(pe, (new_H, new_W), old_grid=(H, W), mode="bilinear")
    assert out[0, 0, 0] == 7.0
    got = out[0, 1:, 0].reshape(new_H, new_W).double()

    si, sj = _source_coord(new_H, H), _source_coord(new_W, W)
    # Interior: sources inside [0, H-1] x [0, W-1] -> the ramp at the mapped coordinate.
    ri = (si >= 0) & (si <= H - 1)
    rj = (sj >= 0) & (sj <= W - 1)
    assert ri.sum() == new_H - 2 and rj.sum() == new_W - 2  # one clamped row/col each side
    expected = a * si[:, None] + b * sj[None, :] + c
    torch.testing.assert_close(got[ri][:, rj], expected[ri][:, rj], rtol=0, atol=1e-5)

    # Border: sources outside the grid are clamped to the first / last row and column.
    expected_clamped = a * si.clamp(0, H - 1)[:, None] + b * sj.clamp(0, W - 1)[None, :] + c
    torch.testing.assert_close(got, expected_clamped, rtol=0, atol=1e-5)
    # Hand values: the first output row samples -1/6 -> row 0; the last samples 7 + 1/6 -> row 7.
    assert si[0] == pytest.approx(-1 / 6) and si[-1] == pytest.approx(7 + 1 / 6)
    torch.testing.assert_close(got[0, 0].item(), a * 0 + b * 0 + c, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[-1, -1].item(), a * 7 + b * 5 + c, rtol=0, atol=1e-5)


def test_bilinear_downsample_by_two_is_block_average() -> None:
    # Halving: output i' samples 2i' + 0.5, exactly between rows 2i' and 2i'+1.
    grid_HWD = torch.randn(8, 8, 4)
    pe = _table(grid_HWD, torch.randn(1, 4))
    out = interpolate_pos_embed(pe, 4, mode="bilinear")
    assert out.shape == (1, 1 + 16, 4)
    pooled_DHW = F.avg_pool2d(grid_HWD.permute(2, 0, 1), 2)
    expected = pooled_DHW.permute(1, 2, 0).reshape(16, 4)
    torch.testing.assert_close(out[0, 1:], expected, rtol=0, atol=1e-6)


def test_bicubic_keeps_constants_and_location() -> None:
    # Cubic weights sum to one: a constant table stays constant.
    pe = torch.full((1, 1 + 5 * 5, 3), 0.25)
    out = interpolate_pos_embed(pe, (9, 7), mode="bicubic")
    torch.testing.assert_close(out, torch.full((1, 1 + 9 * 7, 3), 0.25), rtol=0, atol=1e-6)
    # Matches F.interpolate on the image-shaped grid.
    grid_HWD = torch.randn(6, 4, 5)
    pe = _table(grid_HWD, torch.randn(1, 5))
    out = interpolate_pos_embed(pe, (9, 10), old_grid=(6, 4), mode="bicubic")
    ref = F.interpolate(grid_HWD.permute(2, 0, 1)[None], size=(9, 10), mode="bicubic")
    torch.testing.assert_close(out[0, 1:], ref[0].permute(1, 2, 0).reshape(90, 5))


def test_keeps_low_precision_dtype() -> None:
    pe = torch.randn(1, 1 + 4 * 4, 8)
    out = interpolate_pos_embed(pe.to(torch.bfloat16), 6, mode="bicubic")
    assert out.dtype == torch.bfloat16
    # Computed in float32 from the bf16 values and rounded once.
    ref = interpolate_pos_embed(pe.to(torch.bfloat16).float(), 6, mode="bicubic")
    assert torch.equal(out, ref.to(torch.bfloat16))


def test_errors() -> None:
    with pytest.raises(ValueError, match="perfect square"):
        interpolate_pos_embed(torch.randn(1, 1 + 12, 4), 4)
    with pytest.raises(ValueError, match="old_grid"):
        interpolate_pos_embed(torch.randn(1, 1 + 12, 4), 4, old_grid=(3, 5))
    with pytest.raises(ValueError, match="unknown mode"):
        interpolate_pos_embed(torch.randn(1, 1 + 16, 4), 6, mode="nearest")
    with pytest.raises(ValueError, match="positive"):
        interpolate_pos_embed(torch.randn(1, 1 + 16, 4), (0, 4))
    with pytest.raises(ValueError, match=r"\[B, P \+ H\*W, D\]"):
        interpolate_pos_embed(torch.randn(1 + 16, 4), 6)
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        interpolate_pos_embed(torch.randn(1, 16, 4), 6, num_prefix_tokens=-1)
