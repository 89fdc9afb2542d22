"""Colour targets checked against hand-computed classes."""

import pytest
import torch

from ssl_vit import mean_color_classes
from ssl_vit.objectives.targets import (
    cell_bounds,
    cell_color_classes,
    color_class_to_rgb,
    normalize_patches,
    patch_pixels,
    pixels_to_mean_color,
)


def solid(rgb, h=8, w=8):
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, h, w).clone()


@pytest.mark.parametrize(
    "rgb, expected",
    [
        ((0.0, 0.0, 0.0), 0),
        ((1.0, 1.0, 1.0), 511),  # mean 1.0 -> floor(8) = 8 -> clipped to 7
        ((1.0, 0.0, 0.0), 64 * 7),
        ((0.0, 1.0, 0.0), 8 * 7),
        ((0.0, 0.0, 1.0), 7),
        ((0.125, 0.0, 0.0), 64 * 1),  # exactly on the first bin edge -> level 1
        ((0.1249, 0.0, 0.0), 0),
        ((0.5, 0.25, 0.875), 64 * 4 + 8 * 2 + 7),
        ((0.99, 0.624, 0.375), 64 * 7 + 8 * 4 + 3),
    ],
)
def test_pure_colours(rgb, expected):
    for p in (4, 8):
        classes = mean_color_classes(solid(rgb), p)
        assert classes.dtype == torch.long
        assert classes.shape == (1, (8 // p) ** 2)
        assert (classes == expected).all()


def test_mean_over_patch_and_row_major_order():
    # 2x3 grid of 4x4 patches (non-square image 8x12); each patch gets its own colour.
    img = torch.zeros(1, 3, 8, 12)
    # Patch (0, 1): half its pixels red=1.0, half 0 -> mean 0.5 -> level 4.
    img[0, 0, 0:2, 4:8] = 1.0
    # Patch (1, 2): green 0.25 everywhere, blue checkerboard of 0 and 0.25 -> mean 0.125 -> 1.
    img[0, 1, 4:8, 8:12] = 0.25
    img[0, 2, 4:8, 8:12] = torch.tensor([[0.0, 0.25] * 2, [0.25, 0.0] * 2] * 2)
    classes = mean_color_classes(img, 4)
    assert classes.shape == (1, 6)
    assert classes.tolist() == [[0, 64 * 4, 0, 0, 0, 8 * 2 + 1]]


def test_patch16_and_uint8_matches_float():
    torch.manual_seed(0)
    img_u8 = torch.randint(0, 256, (3, 3, 32, 48), dtype=torch.uint8)
    float_cls = mean_color_classes(img_u8.double() / 255, 16)
    assert torch.equal(mean_color_classes(img_u8, 16), float_cls)
    assert float_cls.shape == (3, 2 * 3)
    # Hand check of one patch (row 1, col 2 -> index 5) of image 0.
    patch = img_u8[0, :, 16:32, 32:48].double() / 255
    lv = [min(int(m * 8), 7) for m in patch.mean(dim=(1, 2)).tolist()]
    assert float_cls[0, 5].item() == 64 * lv[0] + 8 * lv[1] + lv[2]


def test_uint8_bin_edge_is_exact():
    # Two white pixels among 16 in a 4x4 patch: mean exactly 2/16 = 0.125 -> level 1.
    img = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    img[0, :, 0, :2] = 255
    assert mean_color_classes(img, 4).item() == 64 + 8 + 1


def test_rejects_sizes_not_multiple_of_patch():
    with pytest.raises(ValueError, match="multiple"):
        mean_color_classes(torch.zeros(1, 3, 10, 8), 4)


def test_class_to_rgb_roundtrip():
    classes = torch.arange(512)
    rgb = color_class_to_rgb(classes)
    img = rgb.view(512, 3, 1, 1).expand(512, 3, 4, 4)
    assert torch.equal(mean_color_classes(img, 4).squeeze(1), classes)


# --- color_4x4: cells of a patch ---------------------------------------------------------


def test_cell_bounds_cover_every_pixel_once():
    assert cell_bounds(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert cell_bounds(6) == [(0, 1), (1, 3), (3, 4), (4, 6)]  # floor(i * 6 / 4)
    assert cell_bounds(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    for p in range(4, 33):
        b = cell_bounds(p)
        assert b[0][0] == 0 and b[-1][1] == p
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(b[:-1], b[1:], strict=True))  # contiguous
        assert all(e > s for s, e in b)  # no empty cell
    with pytest.raises(ValueError, match="smaller"):
        cell_bounds(3)


def test_cells_of_a_6px_patch_hand_computed():
    # One 6x6 patch; cells along each side cover pixels [0,1) [1,3) [3,4) [4,6).
    img = torch.zeros(1, 3, 6, 6, dtype=torch.float64)
    img[0, 0, :, 3:] = 1.0  # red in cell columns 2 and 3
    img[0, 1, 0, :] = 1.0  # green in cell row 0
    img[0, 2, 1, 1] = 0.5  # blue: one of the 4 pixels of cell (1, 1) -> mean 0.125 -> 1
    img[0, 2, 4, 4] = 0.5  # one of the 4 pixels of cell (3, 3): mean 0.125 -> level 1
    img[0, 2, 3, 0] = 0.4  # the single pixel of cell (2, 0): 0.4 -> level 3
    red, green = 64 * 7, 8 * 7
    expected = [
        [green, green, green + red, green + red],
        [0, 1, red, red],
        [3, 0, red, red],
        [0, 0, red, red + 1],
    ]
    got = cell_color_classes(img, 6)
    assert got.shape == (1, 1, 16)
    assert got.view(4, 4).tolist() == expected


def test_cells_of_8px_patches_are_2px_mean_colours():
    # With P = 8 every cell is 2x2 pixels: the same classes as mean colours of 2px patches.
    torch.manual_seed(1)
    img = torch.randint(0, 256, (2, 3, 16, 24), dtype=torch.uint8)
    cells = cell_color_classes(img, 8)  # [2, 2*3, 16]
    small = mean_color_classes(img, 2).view(2, 2, 4, 3, 4).permute(0, 1, 3, 2, 4)
    assert torch.equal(cells, small.reshape(2, 6, 16))


def test_cells_uint8_matches_float_for_odd_patch():
    torch.manual_seed(2)
    img = torch.randint(0, 256, (2, 3, 10, 15), dtype=torch.uint8)
    assert torch.equal(cell_color_classes(img, 5), cell_color_classes(img.double() / 255, 5))


# --- pixels_l2 -----------------------------------------------------------------------------


def test_patch_pixels_order_and_scale():
    img = torch.arange(3 * 4 * 8, dtype=torch.float32).view(1, 3, 4, 8) / 255.0
    px = patch_pixels((img * 255).round().to(torch.uint8), 4)
    assert px.shape == (1, 2, 4 * 4 * 3)
    # Patch 1 (columns 4..7), pixel row 2, column 1, then RGB: value = c * 32 + 2 * 8 + 5.
    offset = (2 * 4 + 1) * 3
    assert [round(v * 255) for v in px[0, 1, offset : offset + 3].tolist()] == [21, 53, 85]
    assert torch.allclose(patch_pixels(img, 4), px)


def test_normalize_patches_and_mean_colour_of_pixels():
    torch.manual_seed(3)
    img = torch.rand(4, 3, 8, 8)
    px = patch_pixels(img, 4)
    z = normalize_patches(px)
    assert torch.allclose(z.mean(-1), torch.zeros(4, 4), atol=1e-5)
    assert torch.allclose(z.std(-1, unbiased=False), torch.ones(4, 4), atol=1e-4)
    assert torch.equal(pixels_to_mean_color(px), mean_color_classes(img, 4))
