"""The strong view of a uint8 batch on the device: FixMatch's RandAugment, then Cutout.

FixMatch (Sohn et al. 2020, section 2.3 and appendix D) trains on a strongly augmented view of
each unlabelled image against the pseudo-label of its weak view. Its strong augmentation is
RandAugment with random magnitudes: K = 2 ops drawn uniformly (with replacement) from the 14
below, each at its own magnitude drawn uniformly, applied in order; then Cutout, one grey
square at a random place. Here it runs on the whole batch at once, on the device, on the same
uint8 batch the weak view is made from: no second decode or loader pass, and the loader workers
stay as they are under `data.augment=device`.

Batched: each of the K op slots computes every op's result for the whole batch and keeps, per
sample, its own op's (`torch.where`); the five geometric ops are one `affine_grid` +
`grid_sample` with a per-sample matrix. A slot costs ~10 batch ops, which at 32-224 px is
small beside the forward pass. The draws are made as `DeviceAugment`'s (`StreamDraws`, from
(seed, STRONG_AUGMENT, index)). No host sync: no `.item()`, no data-dependent shape.

Magnitudes: `v` in [-1, 1] (a draw in `magnitude`, a random sign for the signed ops) scales
each op's largest change, FixMatch's ranges (those of torchvision's RandAugment but translate):
brightness / color / contrast / sharpness factor 1 + 0.9 v; rotate 30 v degrees; shear 0.3 v;
translate 0.3 v S pixels; posterize keeps 8 - round(4 |v|) bits; solarize inverts the values
>= 256 (1 - |v|). Each op's result is rounded and clamped to [0, 255] before the next, as
PIL's (uint8 between ops).

What differs from torchvision's `RandAugment` (and timm's): a magnitude per sample and op,
drawn (FixMatch's random-magnitude variant) rather than one fixed bin for the batch; translate
up to 0.3 S (FixMatch) rather than 0.45 S, in whole pixels as torchvision's; shears about the
image centre (torchvision and PIL: the top-left corner), so the image keeps its place; blank
geometric areas and the Cutout box are grey 127 (FixMatch's), not black; results are rounded,
where PIL and torchvision truncate; contrast blends to the float mean of the grey image (PIL:
its rounded integer mean). Equalize is PIL's `ImageOps.equalize` exactly, per channel.

Cutout (DeVries & Taylor 2017): one square per sample, side round(f S) with f uniform in
`erase_scale` (the FixMatch paper's [0, 0.5]; (0.5, 0.5) is the fixed half-size box of the
kekmodel/FixMatch-pytorch port), centred on a uniformly drawn pixel and clipped at the border
(that port shifts a box clipped on the top or left inside the image; here all sides clip).
Filled with grey 127, not random values: FixMatch fills grey; grey is also what the geometric
ops leave, so the model sees one "missing" value, near 0 after the ImageNet normalization
(mean 124, 116, 104), which removes information without adding noise statistics that no weak
view has.

Shape legend: B batch, K op slots per sample, S image size (square), 3 channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ssl_vit import seeds
from ssl_vit.data.device_augment import StreamDraws

__all__ = [
    "OPS",
    "Draws",
    "StrongAugment",
    "apply_op",
    "build_strong_augment",
    "equalize",
    "erase",
]

# Colour ops first, geometric ops last (one affine warp for all of them: `op >= FIRST_GEOMETRIC`).
OPS = (
    "identity",
    "autocontrast",
    "brightness",
    "color",
    "contrast",
    "equalize",
    "posterize",
    "sharpness",
    "solarize",
    "rotate",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
)
FIRST_GEOMETRIC = OPS.index("rotate")
GREY = 127.0  # FixMatch's fill of blank areas and of the Cutout box
# The largest change of each op (at |v| = 1): FixMatch's RandAugment ranges.
MAX_ENHANCE = 0.9  # factor 1 +- 0.9 of brightness, color, contrast, sharpness
MAX_POSTERIZE = 4  # bits removed
MAX_ROTATE = 30.0  # degrees
MAX_SHEAR = 0.3
MAX_TRANSLATE = 0.3  # of the image size
LUMA = (0.299, 0.587, 0.114)  # PIL's RGB -> L


class Draws(NamedTuple):
    """A batch's strong-augmentation draws."""

    op: torch.Tensor  # long [B,K]: an index in OPS
    v: torch.Tensor  # float [B,K]: the signed magnitude, in [-1, 1]
    box: torch.Tensor  # float [B,3]: the Cutout square's side, centre row, centre column


def _pick(out: torch.Tensor, op_B: torch.Tensor, name: str, result: torch.Tensor) -> torch.Tensor:
    """`result` for the samples whose op is `name`, `out` for the others."""
    return torch.where((op_B == OPS.index(name)).view(-1, 1, 1, 1), result, out)


def _blend(base: torch.Tensor, x: torch.Tensor, factor_B111: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: factor 0 gives `base`, 1 the image, above 1 extrapolates."""
    return base + factor_B111 * (x - base)


def _luma(x_B3SS: torch.Tensor) -> torch.Tensor:
    """[B,1,S,S] grey image (ITU-R 601-2 luma, as PIL's convert('L'))."""
    r, g, b = x_B3SS.unbind(1)
    return (LUMA[0] * r + LUMA[1] * g + LUMA[2] * b)[:, None]


def _autocontrast(x_B3SS: torch.Tensor) -> torch.Tensor:
    """Each channel stretched to [0, 255] (PIL's autocontrast, cutoff 0); a flat channel stays."""
    lo = x_B3SS.amin((2, 3), keepdim=True)
    hi = x_B3SS.amax((2, 3), keepdim=True)
    # (x - lo) * 255 / (hi - lo): integer numerator and denominator, one rounding.
    stretched = (x_B3SS - lo) * 255.0 / (hi - lo).clamp(min=1.0)
    return torch.where(hi > lo, stretched, x_B3SS)


def equalize(x_B3SS: torch.Tensor) -> torch.Tensor:
    """PIL's `ImageOps.equalize` per channel, batched: each channel's lookup table from its
    histogram (`scatter_add`, static shape; `bincount` would sync): step = (pixels - count of
    the highest value) // 255, value i -> (step // 2 + pixels below i) // step; step 0 (one
    value, or too few pixels) leaves the channel. Integer-valued float in and out."""
    B, C, H, W = x_B3SS.shape
    flat = x_B3SS.reshape(B, C, H * W).long()
    hist = torch.zeros(B, C, 256, dtype=torch.long, device=x_B3SS.device)
    hist.scatter_add_(2, flat, torch.ones_like(flat))
    top_count = hist.gather(2, flat.amax(2, keepdim=True))
    step = (H * W - top_count) // 255
    below = hist.cumsum(2) - hist
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)
    out = torch.where(step > 0, lut.gather(2, flat), flat)
    return out.reshape(B, C, H, W).to(x_B3SS.dtype)


def _smoothed(x_B3SS: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH filter ([[1,1,1],[1,5,1],[1,1,1]] / 13, rounded), border pixels kept, as
    ImageEnhance.Sharpness (and torchvision's adjust_sharpness) blur."""
    ones = x_B3SS.new_ones(3, 1, 3, 3)
    # The 3 x 3 sums of integers are exact in float32, so the result is the same at any batch.
    # (padded: images under 3 px have no inside, and keep every pixel)
    smooth = torch.round((F.conv2d(x_B3SS, ones, padding=1, groups=3) + 4.0 * x_B3SS) / 13.0)
    out = x_B3SS.clone()
    out[:, :, 1:-1, 1:-1] = smooth[:, :, 1:-1, 1:-1]
    return out


def _affine(
    x_B3SS: torch.Tensor, op_B: torch.Tensor, v_B: torch.Tensor, interpolation: str
) -> torch.Tensor:
    """Every sample warped by its own matrix (rotate, shear or translate by its op; identity for
    the others), blank areas grey: one `affine_grid` + `grid_sample` for the batch. The matrix
    maps output to input points in [-1, 1] units (square images: a rotation stays one)."""
    B, C, H, W = x_B3SS.shape

    def on(name: str) -> torch.Tensor:
        return (op_B == OPS.index(name)).to(v_B.dtype)

    angle = torch.deg2rad(MAX_ROTATE * v_B) * on("rotate")
    cos, sin = torch.cos(angle), torch.sin(angle)
    shear_x, shear_y = MAX_SHEAR * v_B * on("shear_x"), MAX_SHEAR * v_B * on("shear_y")
    # Whole pixels, as torchvision's RandAugment: no blur; 2 t / size in [-1, 1] units.
    tx = torch.round(MAX_TRANSLATE * W * v_B) * on("translate_x") * (2.0 / W)
    ty = torch.round(MAX_TRANSLATE * H * v_B) * on("translate_y") * (2.0 / H)
    theta_B23 = torch.stack(
        (torch.stack((cos, shear_x - sin, -tx), 1), torch.stack((sin + shear_y, cos, -ty), 1)), 1
    )
    grid = F.affine_grid(theta_B23, [B, C, H, W], align_corners=False)
    # Zero padding of (x - grey) is a grey fill (grid_sample has no fill value).
    out = F.grid_sample(
        x_B3SS - GREY, grid, mode=interpolation, padding_mode="zeros", align_corners=False
    )
    return out + GREY


def apply_op(
    x_B3SS: torch.Tensor, op_B: torch.Tensor, v_B: torch.Tensor, interpolation: str = "nearest"
) -> torch.Tensor:
    """float [B,3,S,S] of integers in [0, 255] -> the same: sample i transformed by op
    `OPS[op_B[i]]` at signed magnitude `v_B[i]` in [-1, 1], rounded and clamped. Every op is
    computed for the whole batch (static shapes, no branching on the draws)."""
    m_B111 = v_B.abs().view(-1, 1, 1, 1)
    factor_B111 = (1.0 + MAX_ENHANCE * v_B).view(-1, 1, 1, 1)
    grey = _luma(x_B3SS)
    out = _pick(x_B3SS, op_B, "autocontrast", _autocontrast(x_B3SS))
    out = _pick(out, op_B, "brightness", x_B3SS * factor_B111)
    out = _pick(out, op_B, "color", _blend(grey, x_B3SS, factor_B111))
    # The mean grey from the channels' sums: sums of integers (< 2**24 up to 256 px) are exact
    # in any order, so a sample's value does not depend on the batch it is reduced in.
    r, g, b = x_B3SS.sum((2, 3)).unbind(1)
    H, W = x_B3SS.shape[-2:]
    mean = ((LUMA[0] * r + LUMA[1] * g + LUMA[2] * b) / (H * W)).view(-1, 1, 1, 1)
    out = _pick(out, op_B, "contrast", _blend(mean, x_B3SS, factor_B111))
    out = _pick(out, op_B, "equalize", equalize(x_B3SS))
    shift = torch.exp2(torch.round(MAX_POSTERIZE * m_B111))  # 2 ** bits removed
    out = _pick(out, op_B, "posterize", torch.floor(x_B3SS / shift) * shift)
    out = _pick(out, op_B, "sharpness", _blend(_smoothed(x_B3SS), x_B3SS, factor_B111))
    solarized = torch.where(x_B3SS >= 256.0 * (1.0 - m_B111), 255.0 - x_B3SS, x_B3SS)
    out = _pick(out, op_B, "solarize", solarized)
    geometric = (op_B >= FIRST_GEOMETRIC).view(-1, 1, 1, 1)
    out = torch.where(geometric, _affine(x_B3SS, op_B, v_B, interpolation), out)
    return out.round_().clamp_(0.0, 255.0)


def erase(x_B3SS: torch.Tensor, box_B3: torch.Tensor) -> torch.Tensor:
    """Cutout: each sample's square (side, centre row, centre column: `Draws.box`), clipped
    at the border, set to grey; any dtype."""
    B, _, H, W = x_B3SS.shape
    side, cy, cx = box_B3.unbind(1)
    top, left = cy - torch.floor(side / 2), cx - torch.floor(side / 2)
    r_H = torch.arange(H, device=x_B3SS.device, dtype=box_B3.dtype)
    c_W = torch.arange(W, device=x_B3SS.device, dtype=box_B3.dtype)
    rows_BH = (r_H >= top[:, None]) & (r_H < (top + side)[:, None])
    cols_BW = (c_W >= left[:, None]) & (c_W < (left + side)[:, None])
    return x_B3SS.masked_fill(rows_BH[:, None, :, None] & cols_BW[:, None, None, :], GREY)


class StrongAugment(StreamDraws):
    """uint8 [B,3,S,S] -> uint8 [B,3,S,S] on the images' device: `ops` RandAugment ops per
    sample, each at a magnitude drawn uniformly in `magnitude`: (lo, hi), or (0, m) for a number
    m (1 is FixMatch's largest change); then Cutout (`erase`; side a uniform fraction of S in
    `erase_scale`). Float input is taken on the same [0, 255] scale and returned as float.

    `stream` (seed, rank, global_micro) and `__call__`'s `index` place the draws (`StreamDraws`).
    `interpolation` of the geometric ops: "nearest" (PIL's default, which FixMatch's code uses,
    and torchvision's) or "bilinear"."""

    stream_id = seeds.STRONG_AUGMENT

    def __init__(
        self,
        generator: torch.Generator,
        stream: tuple[int, int, int] | None = None,
        ops: int = 2,
        magnitude: float | Sequence[float] = (0.0, 1.0),
        erase: bool = True,
        erase_scale: Sequence[float] = (0.0, 0.5),
        interpolation: str = "nearest",
    ) -> None:
        lo, hi = (0.0, magnitude) if isinstance(magnitude, (int, float)) else magnitude
        if not 0.0 <= lo <= hi <= 1.0 or ops < 1:
            raise ValueError(
                f"StrongAugment: ops >= 1, 0 <= magnitude <= 1, got {ops}, {magnitude}"
            )
        self.generator, self.stream, self.ops = generator, stream, ops
        self.magnitude = (float(lo), float(hi))
        self.erase, self.interpolation = erase, interpolation
        self.erase_scale = (float(erase_scale[0]), float(erase_scale[1]))

    def draws(
        self, batch: int, size: int, device: torch.device | str, index: int | None = None
    ) -> Draws:
        """`batch` samples' draws (3K + 3 uniforms each: K ops, K magnitudes, K signs, the
        Cutout side and centre), for S = `size`."""
        K = self.ops
        u = self.stream_uniforms(batch, 3 * K + 3, device, index)
        op_BK = torch.floor(u[:, :K] * len(OPS)).clamp_(max=len(OPS) - 1).long()
        lo, hi = self.magnitude
        sign_BK = torch.where(u[:, 2 * K : 3 * K] < 0.5, -1.0, 1.0)
        v_BK = (lo + (hi - lo) * u[:, K : 2 * K]) * sign_BK
        f_lo, f_hi = self.erase_scale
        side = torch.round(size * (f_lo + (f_hi - f_lo) * u[:, -3]))
        box_B3 = torch.stack((side, torch.floor(u[:, -2] * size), torch.floor(u[:, -1] * size)), 1)
        return Draws(op_BK, v_BK, box_B3)

    def __call__(self, images_B3SS: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """`index`: the micro-batch's index in the run (step x grad_accum + micro-step)."""
        B, _, S, _ = images_B3SS.shape
        d = self.draws(B, S, images_B3SS.device, index)
        x = images_B3SS.float()
        if images_B3SS.dtype != torch.uint8:  # float input: the same integer steps as uint8
            x = x.round().clamp(0.0, 255.0)
        for k in range(self.ops):
            x = apply_op(x, d.op[:, k], d.v[:, k], self.interpolation)
        if self.erase:
            x = erase(x, d.box)
        return x.to(torch.uint8) if images_B3SS.dtype == torch.uint8 else x


def build_strong_augment(
    seed: int, rank: int, global_micro: int, device: torch.device | str, **options: object
) -> StrongAugment:
    """The job's strong view: its own generator on `device` (`StreamDraws`, for the
    `global_micro` images of every process); `options` go to `StrongAugment` (ops, magnitude,
    erase, erase_scale, interpolation)."""
    gen = torch.Generator(device).manual_seed(seeds.derive(seed, seeds.STRONG_AUGMENT))
    return StrongAugment(gen, stream=(seed, rank, global_micro), **options)  # type: ignore[arg-type]
