"""Colour targets checked against hand-computed classes."""

import pytest
import torch

from ssl_vit import mean_color_classes
from ssl_vit.objectives.targets import color_class_to_rgb


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
