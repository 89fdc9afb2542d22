"""ssl_vit.data.strong_augment: each op gives its hand value, Cutout its box, the draws are
uniform over the ops, a function of (seed, index) and of a sample's place in the global
micro-batch (not of the number of processes), and the batch never syncs with the host."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from ssl_vit.bench.host_sync import HostReads
from ssl_vit.data.strong_augment import (
    OPS,
    StrongAugment,
    apply_op,
    build_strong_augment,
    equalize,
    erase,
)


def _op(x: torch.Tensor, name: str, v: float) -> torch.Tensor:
    """`name` at signed magnitude v on every sample of float [B,3,H,W]."""
    B = x.shape[0]
    return apply_op(x.float(), torch.full((B,), OPS.index(name)), torch.full((B,), v))


def _pixels(*values: float) -> torch.Tensor:
    """[1,3,1,n]: the values in every channel."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, 1, -1).expand(1, 3, 1, -1)


def _image(size: int = 9, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, size, size), generator=g).float()


def test_the_fourteen_ops_of_fixmatch():
    assert len(OPS) == len(set(OPS)) == 14
    assert set(OPS) == {
        "identity", "autocontrast", "brightness", "color", "contrast", "equalize", "posterize",
        "rotate", "sharpness", "shear_x", "shear_y", "solarize", "translate_x", "translate_y",
    }  # fmt: skip


@pytest.mark.parametrize("name", ["identity", "rotate", "shear_x", "shear_y", "translate_x"])
def test_identity_and_zero_warps_leave_the_image_bit_identical(name):
    x = _image(11, batch=3)
    assert torch.equal(_op(x, name, 0.0), x)
    if name == "identity":
        assert torch.equal(_op(x, name, 1.0), x)


def test_identity_twice_without_erasing_is_the_input_uint8():
    x = _image(16, batch=4).to(torch.uint8)
    aug = StrongAugment(torch.Generator().manual_seed(0), erase=False)
    draws = aug.draws(4, 16, "cpu")
    out = x.float()
    for k in range(2):
        out = apply_op(out, torch.zeros_like(draws.op[:, k]), draws.v[:, k])
    assert torch.equal(out.to(torch.uint8), x)


def test_solarize_inverts_from_the_threshold():
    x = _pixels(0, 127, 128, 255)
    assert _op(x, "solarize", 0.5)[0, 0, 0].tolist() == [0, 127, 127, 0]  # threshold 128
    assert _op(x, "solarize", -0.5)[0, 0, 0].tolist() == [0, 127, 127, 0]  # unsigned
    assert _op(x, "solarize", 0.0)[0, 0, 0].tolist() == [0, 127, 128, 255]  # threshold 256
    assert _op(x, "solarize", 1.0)[0, 0, 0].tolist() == [255, 128, 127, 0]  # all


def test_posterize_keeps_the_high_bits():
    x = _pixels(255, 130, 3, 64)
    assert _op(x, "posterize", 0.5)[0, 0, 0].tolist() == [252, 128, 0, 64]  # 6 bits kept
    assert _op(x, "posterize", 1.0)[0, 0, 0].tolist() == [240, 128, 0, 64]  # 4 bits kept
    assert _op(x, "posterize", 0.0)[0, 0, 0].tolist() == [255, 130, 3, 64]


def test_brightness_scales_by_its_factor():
    x = _pixels(0, 100, 200)
    assert _op(x, "brightness", 5 / 9)[0, 0, 0].tolist() == [0, 150, 255]  # x 1.5, clamped
    assert _op(x, "brightness", -5 / 9)[0, 0, 0].tolist() == [0, 50, 100]  # x 0.5


def test_color_blends_towards_the_grey_image():
    x = torch.tensor([200.0, 100.0, 0.0]).view(1, 3, 1, 1)  # grey 0.299*200 + 0.587*100 = 118.5
    # factor 0.1: 118.5 + 0.1 (x - 118.5)
    assert _op(x, "color", -1.0).flatten().tolist() == [127, 117, 107]
    grey = _pixels(30, 60, 90)  # R = G = B: nothing to desaturate
    assert torch.equal(_op(grey, "color", 1.0), grey)


def test_contrast_blends_towards_the_mean_grey():
    x = _pixels(0, 200)  # mean 100
    assert _op(x, "contrast", 5 / 9)[0, 0, 0].tolist() == [0, 250]  # 100 +- 1.5 x 100, clamped
    assert _op(x, "contrast", -5 / 9)[0, 0, 0].tolist() == [50, 150]


def test_autocontrast_stretches_each_channel():
    x = torch.stack([_pixels(50, 100, 150)[0, 0], _pixels(7, 7, 7)[0, 0], _pixels(0, 1, 2)[0, 0]])
    out = _op(x[None], "autocontrast", 0.3)[0]
    assert out[0, 0].tolist() == [0, 128, 255]  # 127.5 rounds to even
    assert out[1, 0].tolist() == [7, 7, 7]  # a flat channel stays
    assert out[2, 0].tolist() == [0, 128, 255]


@pytest.mark.parametrize("size", [13, 40])  # 169 pixels: PIL's step is 0 (unchanged); 1600: 6
def test_equalize_is_pil_equalize(size):
    x = _image(size, batch=6, seed=4).to(torch.uint8)
    x[0] = torch.randint(100, 104, (3, size, size))  # few values
    x[1, 1] = 7  # a flat channel
    x[2, :, :4] = 255  # many at the top value
    x[3] = x[3] // 2  # a dark image
    for i in range(6):
        ref = np.asarray(ImageOps.equalize(Image.fromarray(x[i].permute(1, 2, 0).numpy())))
        got = equalize(x[i : i + 1].float())[0].permute(1, 2, 0).to(torch.uint8).numpy()
        assert (ref == got).all(), i
    assert torch.equal(_op(x.float(), "equalize", 0.7), equalize(x.float()))
    assert torch.equal(equalize(x.float()), x.float()) == (size == 13)


def test_sharpness_blends_with_the_smoothed_image():
    """One bright pixel: SMOOTH gives round(5 x 255 / 13) = 98 there, round(255 / 13) = 20
    around it; borders keep their pixels."""
    x = torch.zeros(1, 3, 5, 5)
    x[:, :, 2, 2] = 255.0
    x[:, :, 0, 0] = 255.0  # a border pixel: not smoothed, and no neighbour of the centre
    soft = _op(x, "sharpness", -1.0)[0, 0]  # factor 0.1: 98 + 0.1 (255 - 98)
    assert soft[2, 2] == 114 and soft[1, 2] == 18 and soft[1, 3] == 18  # 20 + 0.1 (0 - 20)
    assert soft[1, 1] == 35  # beside both: round(510 / 13) = 39, 39 + 0.1 (0 - 39)
    assert soft[0, 0] == 255 and soft[0, 2] == 0
    sharp = _op(x, "sharpness", 1.0)[0, 0]  # factor 1.9: clamped
    assert sharp[2, 2] == 255 and sharp[1, 2] == 0
    flat = torch.full((1, 3, 5, 5), 80.0)
    assert torch.equal(_op(flat, "sharpness", 1.0), flat)


def test_translate_by_whole_pixels_with_a_grey_fill():
    x = _image(10)
    right = _op(x, "translate_x", 1 / 3)  # 0.3 x 10 / 3 = 1 px
    assert torch.equal(right[..., 1:], x[..., :-1]) and (right[..., 0] == 127).all()
    up = _op(x, "translate_y", -2 / 3)  # -2 px
    assert torch.equal(up[..., :-2, :], x[..., 2:, :]) and (up[..., -2:, :] == 127).all()


def test_rotate_and_shear_keep_the_centre_and_fill_grey():
    x = torch.full((1, 3, 9, 9), 200.0)
    x[..., 4, :] = torch.arange(9.0)  # the centre row
    x[..., :, 4] = torch.arange(9.0) + 20  # the centre column
    rot = _op(x, "rotate", 1.0)  # 30 degrees about the centre
    assert rot[0, 0, 4, 4] == x[0, 0, 4, 4]
    assert (rot[..., [0, 0, -1, -1], [0, -1, 0, -1]] == 127).all()  # the corners leave
    shear_x = _op(x, "shear_x", 1.0)  # rows move by 0.3 x their distance from the centre
    assert torch.equal(shear_x[..., 4, :], x[..., 4, :]) and (shear_x[..., 0, 0] == 127).all()
    shear_y = _op(x, "shear_y", -1.0)
    assert torch.equal(shear_y[..., :, 4], x[..., :, 4]) and (shear_y[..., 0, -1] == 127).all()


def test_erase_sets_a_grey_square_clipped_at_the_border():
    x = torch.zeros(2, 3, 10, 10, dtype=torch.uint8)
    box = torch.tensor([[4.0, 5.0, 5.0], [4.0, 0.0, 9.0]])  # side, centre row, centre column
    out = erase(x, box)
    assert out.dtype == torch.uint8
    assert (out[0, :, 3:7, 3:7] == 127).all() and int((out[0] == 127).sum()) == 3 * 16
    assert (out[1, :, 0:2, 7:10] == 127).all() and int((out[1] == 127).sum()) == 3 * 6
    assert int((erase(x, torch.tensor([[0.0, 5.0, 5.0]] * 2)) != 0).sum()) == 0  # side 0


def test_each_sample_gets_its_own_ops_in_order():
    """The batch's output is, per sample, its two ops applied one after the other to it alone
    (the selection picks the right op; no sample's result depends on another's)."""
    x = _image(12, batch=32, seed=1).to(torch.uint8)
    aug = StrongAugment(torch.Generator().manual_seed(5), stream=(3, 0, 32), erase=False)
    out, d = aug(x, 7), aug.draws(32, 12, "cpu", 7)
    assert len(set(d.op.flatten().tolist())) > 10
    for i in range(32):
        one = x[i : i + 1].float()
        for k in range(2):
            one = apply_op(one, d.op[i : i + 1, k], d.v[i : i + 1, k])
        assert torch.equal(out[i : i + 1], one.to(torch.uint8)), i


def test_deterministic_per_index_and_different_across_indices():
    x = _image(16, batch=8).to(torch.uint8)
    make = lambda: build_strong_augment(11, 0, 8, "cpu")  # noqa: E731
    a, b = make(), make()
    assert torch.equal(a(x, 4), b(x, 4))
    b(x, 9)  # earlier calls do not matter
    assert torch.equal(a(x, 4), b(x, 4))
    assert not torch.equal(a(x, 4), a(x, 5))
    assert not torch.equal(a(x, 4), build_strong_augment(12, 0, 8, "cpu")(x, 4))  # seed


def test_ranks_draw_their_slice_of_the_global_micro_batch():
    """Micro-batch u on 2 processes (B = 6 each, global micro-batch 12) is one process's
    strong view of the 12 images, bit for bit."""
    x = _image(20, batch=12, seed=2).to(torch.uint8)
    one = build_strong_augment(5, 0, 12, "cpu")
    two = [build_strong_augment(5, r, 12, "cpu") for r in range(2)]
    for u in (0, 3):
        halves = torch.cat([two[r](x[6 * r : 6 * (r + 1)], u) for r in range(2)])
        assert torch.equal(halves, one(x, u))


def test_state_dict_round_trip_gives_the_same_images():
    x = _image(16, batch=8).to(torch.uint8)
    aug = StrongAugment(torch.Generator().manual_seed(1))  # no stream: continues the generator
    state = aug.state_dict()
    first = aug(x)
    assert not torch.equal(first, aug(x))
    fresh = StrongAugment(torch.Generator().manual_seed(99))
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), first)
    fresh.load_state_dict(None)  # nothing saved: unchanged
    # With a stream nothing need be saved: a new one draws micro-batch u's views again.
    streamed = build_strong_augment(2, 0, 8, "cpu")
    before = streamed(x, 6)
    again = build_strong_augment(2, 0, 8, "cpu")
    again.load_state_dict(streamed.state_dict())
    assert torch.equal(again(x, 6), before)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_a_cifar_batch_keeps_shape_and_dtype_without_host_syncs(dtype):
    x = _image(32, batch=64, seed=3).to(dtype)
    aug = build_strong_augment(0, 0, 64, "cpu")
    with HostReads() as counter:
        out = aug(x, 0)
    assert counter.syncs == 0
    assert out.shape == x.shape and out.dtype == dtype
    assert out.min() >= 0 and out.max() <= 255 and torch.equal(out, out.round())
    if dtype == torch.float32:  # the same images as their uint8 copy
        assert torch.equal(out, aug(x.to(torch.uint8), 0).float())


def test_draws_are_uniform_over_ops_and_in_range():
    """10,000 op draws: each op near 1/14 (2.6e-3 standard deviation; the bound is ~8 of them),
    magnitudes in `magnitude` with both signs, Cutout sides up to half the size."""
    aug = StrongAugment(torch.Generator().manual_seed(0), magnitude=(0.2, 0.6))
    d = aug.draws(5000, 32, "cpu")
    rates = torch.bincount(d.op.flatten(), minlength=len(OPS)) / d.op.numel()
    assert len(rates) == len(OPS) and (rates - 1 / len(OPS)).abs().max() < 0.02
    m = d.v.abs()
    assert m.min() >= 0.2 and m.max() <= 0.6 and 0.45 < float((d.v > 0).float().mean()) < 0.55
    side, cy, cx = d.box.unbind(1)
    assert side.min() >= 0 and side.max() <= 16 and torch.equal(side, side.round())
    assert cy.min() >= 0 and cy.max() <= 31 and cx.min() >= 0 and cx.max() <= 31
    assert StrongAugment(torch.Generator(), magnitude=0.5).magnitude == (0.0, 0.5)


def test_bad_options_are_refused():
    for kw in ({"magnitude": (0.5, 0.2)}, {"magnitude": 1.5}, {"ops": 0}):
        with pytest.raises(ValueError, match="StrongAugment"):
            StrongAugment(torch.Generator(), **kw)
