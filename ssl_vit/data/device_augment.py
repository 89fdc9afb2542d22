"""Random-resized-crop + horizontal flip of a whole batch in one static-shape op on the device.

Under `data.augment=device` the loader workers only decode, resize to a square `load_size`
(`images.SquareLoad`) and collate; the training step calls `DeviceAugment` on the uint8 batch
once it is on the accelerator, before the model (outside any compiled region). The boxes are
drawn as torchvision's `RandomResizedCrop.get_params` draws them (area fraction uniform in
`scale`, log aspect uniform in log(ratio), 10 tries, then the central crop of the nearest
allowed ratio), the 10 tries of every sample at once; one bilinear `grid_sample` then resizes
every box to S x S, flipped where drawn. In training, the draws of micro-batch u are made for
the whole global micro-batch from a generator on the device seeded by (seed, u) (`ssl_vit.seeds`),
and each process keeps its slice: a sample's crop depends on its place in the global stream, not
on the number of processes, and a resumed run sees the same batches with nothing saved.
No host sync: no `.item()`, no data-dependent shape.

Differences from the per-sample path (`images.RandomResizedCropFlip`): the crop is taken from
the L x L load, not from the stored image, and the resize is bilinear without antialiasing
(only boxes larger than S are shrunk, by at most L / S, 8/7 by default).

Shape legend: B batch, T tries (10), L load size, S output size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ssl_vit import seeds
from ssl_vit.config.schema import FinetuneDataConfig, PretrainDataConfig
from ssl_vit.data.images import fallback_box

__all__ = [
    "DeviceAugment",
    "StreamDraws",
    "build_device_augment",
    "load_size",
    "resolve_augment",
]

log = logging.getLogger(__name__)
TRIES = 10  # torchvision's RandomResizedCrop.get_params
RATIO = (3.0 / 4.0, 4.0 / 3.0)


def resolve_augment(augment: str, device: torch.device | str) -> str:
    """`data.augment` -> 'device' or 'workers' ('auto': device on CUDA, workers elsewhere)."""
    if augment == "auto":
        return "device" if torch.device(device).type == "cuda" else "workers"
    return augment


def load_size(requested: int, image_size: int) -> int:
    """`data.load_size` (0: auto) -> the workers' square size.

    Auto: `image_size` up to 64 px (small-image sets such as CIFAR are stored at about the
    training size: resizing up only costs memory), 8/7 of it above (256 for 224, the usual
    resize-then-crop margin), rounded up to a multiple of 8."""
    if requested:
        return requested
    return image_size if image_size <= 64 else -(-image_size * 8 // 7 // 8) * 8


class StreamDraws:
    """The randomness of a batched augmentation on the device, shared by `DeviceAugment` and
    `strong_augment.StrongAugment`: with `stream` (seed, rank, global_micro) and micro-batch
    `index`, `generator` is reseeded from (seed, `stream_id`, index) and draws the uniforms of
    the whole global micro-batch, of which this rank keeps its rows (a sample's draws depend on
    its place in the global stream only); without them the draws continue `generator`'s
    sequence. Its state is the generator's."""

    stream_id = seeds.DEVICE_AUGMENT
    generator: torch.Generator
    stream: tuple[int, int, int] | None

    def stream_uniforms(
        self, batch: int, width: int, device: torch.device | str, index: int | None = None
    ) -> torch.Tensor:
        """[B, width] uniforms in [0, 1) for this rank's `batch` samples."""
        if index is None or self.stream is None:
            return torch.rand((batch, width), generator=self.generator, device=device)
        seed, rank, global_micro = self.stream
        self.generator.manual_seed(seeds.derive(seed, self.stream_id, index))
        full = torch.rand((global_micro, width), generator=self.generator, device=device)
        return full[rank * batch : (rank + 1) * batch]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The saved generator state, when it is one for this generator's device type: in
        training it is reseeded per micro-batch from (seed, index) anyway, so a run resumed
        on another device type (a GPU run on the CPU) needs none."""
        saved = None if state is None else state.get("generator")
        if saved is not None and saved.numel() == self.generator.get_state().numel():
            self.generator.set_state(saved)


class DeviceAugment(StreamDraws):
    """uint8 [B,3,L,L] -> uint8 [B,3,S,S] on the images' device: per-sample random resized
    crop (torchvision's box distribution) and horizontal flip with probability 1/2. `stream`
    (seed, rank, global_micro: `RunPlan.global_micro`) and `__call__`'s `index` place the draws
    (`StreamDraws`)."""

    def __init__(
        self,
        size: int,
        generator: torch.Generator,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = RATIO,
        hflip: bool = True,
        load_size: int | None = None,
        stream: tuple[int, int, int] | None = None,
    ) -> None:
        self.size, self.generator, self.hflip = size, generator, hflip
        self.stream = stream
        self.load_size = load_size  # the square size the loader delivers (None: any)
        self.scale, self.ratio = (float(scale[0]), float(scale[1])), tuple(ratio)
        # As torchvision computes them: float32 bounds of the log ratio.
        self.log_ratio = [float(v) for v in torch.log(torch.tensor(ratio))]

    def boxes(
        self, batch: int, height: int, width: int, device: torch.device, index: int | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(top_B, left_B, h_B, w_B, flip_B): float64 pixel boxes and bool flips of `batch`
        images of height x width, all tries drawn at once (2T + 3 uniforms per sample)."""
        u = self.stream_uniforms(batch, 2 * TRIES + 3, device, index).to(torch.float64)
        lo, hi = self.scale
        area_BT = height * width * (lo + (hi - lo) * u[:, :TRIES])
        lr0, lr1 = self.log_ratio
        aspect_BT = torch.exp(lr0 + (lr1 - lr0) * u[:, TRIES : 2 * TRIES])
        # torch.round rounds half to even, as Python's round() in get_params does.
        w_BT = torch.round(torch.sqrt(area_BT * aspect_BT))
        h_BT = torch.round(torch.sqrt(area_BT / aspect_BT))
        ok_BT = (w_BT > 0) & (w_BT <= width) & (h_BT > 0) & (h_BT <= height)
        first_B1 = ok_BT.to(torch.uint8).argmax(dim=1, keepdim=True)  # first try that fits
        found_B = ok_BT.any(dim=1)
        fb_h, fb_w = map(float, fallback_box(height, width, self.ratio))
        h_B = torch.where(found_B, h_BT.gather(1, first_B1)[:, 0], fb_h)
        w_B = torch.where(found_B, w_BT.gather(1, first_B1)[:, 0], fb_w)
        # randint(0, n - h + 1): floor of a uniform over the n - h + 1 positions.
        top_B = torch.minimum(torch.floor(u[:, -3] * (height - h_B + 1)), height - h_B)
        left_B = torch.minimum(torch.floor(u[:, -2] * (width - w_B + 1)), width - w_B)
        top_B = torch.where(found_B, top_B, float((height - fb_h) // 2))
        left_B = torch.where(found_B, left_B, float((width - fb_w) // 2))
        flip_B = (u[:, -1] < 0.5) & self.hflip
        return top_B, left_B, h_B, w_B, flip_B

    def __call__(self, images_B3LL: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """`index`: the micro-batch's index in the run (step x grad_accum + micro-step)."""
        B, _, H, W = images_B3LL.shape
        top, left, h, w, flip = self.boxes(B, H, W, images_B3LL.device, index)
        S = self.size
        # Output pixel j samples box coordinate (j + 0.5) * w / S (pixel centres, as
        # torchvision's resize); in grid_sample's [-1, 1] units (align_corners=False) that is
        # (2 * left + (2j + 1) * w / S) / W - 1. A flipped row reads j from the other end.
        j_S = torch.arange(S, device=images_B3LL.device, dtype=torch.float64)
        col_BS = torch.where(flip[:, None], S - 1 - j_S, j_S)
        gx_BS = (2 * left[:, None] + (2 * col_BS + 1) * (w[:, None] / S)) / W - 1
        gy_BS = (2 * top[:, None] + (2 * j_S + 1) * (h[:, None] / S)) / H - 1
        grid_BSS2 = torch.stack(
            (gx_BS[:, None, :].expand(B, S, S), gy_BS[:, :, None].expand(B, S, S)), dim=-1
        ).to(torch.float32)
        out = F.grid_sample(
            images_B3LL.float(), grid_BSS2, mode="bilinear", padding_mode="border",
            align_corners=False,
        )  # fmt: skip
        if images_B3LL.dtype == torch.uint8:  # uint8 in, uint8 out: the targets stay exact
            return out.round_().clamp_(0, 255).to(torch.uint8)
        return out


def build_device_augment(
    data: PretrainDataConfig | FinetuneDataConfig,
    image_size: int,
    device: torch.device,
    seed: int,
    plan: Any,
    *,
    global_micro: int = 0,
    always: bool = False,
) -> DeviceAugment | None:
    """The job's device augmentation where the run plan puts it (`plan.augment`; None under
    'workers'; `always`: a stream augmented on the device under either mode, self-training's
    unlabelled images), drawing from its own generator on `device` (`StreamDraws`; the global
    micro-batch `global_micro`, 0: the plan's); the loader delivers `plan.load_size` px squares."""
    if not always and plan.augment != "device":
        log.info("augmentation: per sample in the loader workers")
        return None
    gen = torch.Generator(device).manual_seed(seeds.derive(seed, seeds.DEVICE_AUGMENT))
    load = plan.load_size
    what = "the unlabelled images' augmentation" if always else "augmentation"
    log.info("%s: on %s, batched; workers decode and load at %d px", what, device, load)
    return DeviceAugment(
        image_size, gen, data.crop_scale, hflip=data.hflip, load_size=load,
        stream=(seed, plan.rank, global_micro or plan.global_micro),
    )  # fmt: skip
