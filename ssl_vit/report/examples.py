"""The example strip of the report: images, how the objective corrupted them, the targets it
asked for and what the pretrained model predicted, for a few images of the run's data.

The only objective-specific code is `target_pixels`: it turns the objective's targets and
outputs for the corrupted patches into pixels, for each `objective.target` (mean_color: the
patch in its colour; color_4x4: each cell in its colour; pixels_l2: the pixels). To support a
new target, write one function
`(targets, logits, patch_size) -> (target [M, 3, P, P], predicted [M, 3, P, P])` in [0, 1]
and register it in `PATCH_PIXELS` under the target's name.

Shape legend: B images, N patches, M corrupted patches in all, K classes, P patch size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ssl_vit.config import PretrainConfig, load_config
from ssl_vit.data import eval_loader
from ssl_vit.errors import InputError
from ssl_vit.model import build_vit
from ssl_vit.objectives import MaskedPatchPrediction
from ssl_vit.objectives.targets import cell_bounds, color_class_to_rgb
from ssl_vit.report.runs import Run
from ssl_vit.train.checkpoint import load_checkpoint

__all__ = ["Examples", "PATCH_PIXELS", "target_pixels", "find_data", "run_examples"]


def _mean_color_pixels(
    targets_M: torch.Tensor, logits_MK: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """mean_color: each patch filled with its 3-bit colour class's bin-centre colour."""

    def fill(classes_M: torch.Tensor) -> torch.Tensor:
        rgb_M3 = color_class_to_rgb(classes_M)
        return rgb_M3[:, :, None, None].expand(-1, -1, patch_size, patch_size)

    return fill(targets_M), fill(logits_MK.argmax(dim=-1))


def _cell_color_pixels(
    targets_MC: torch.Tensor, logits_MCK: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """color_4x4: each of the patch's c x c cells filled with its colour class's bin centre,
    with the cell boundaries of the targets (objectives.targets.cell_bounds)."""
    cells = round(targets_MC.shape[-1] ** 0.5)
    # Which cell every pixel row / column belongs to: [P] indices into the c cells.
    side_P = torch.empty(patch_size, dtype=torch.long)
    for i, (start, end) in enumerate(cell_bounds(patch_size, cells)):
        side_P[start:end] = i
    cell_PP = side_P[:, None] * cells + side_P[None, :]  # [P, P] cell of each pixel

    def fill(classes_MC: torch.Tensor) -> torch.Tensor:
        rgb_MC3 = color_class_to_rgb(classes_MC)
        return rgb_MC3[:, cell_PP].permute(0, 3, 1, 2)  # [M, 3, P, P]

    return fill(targets_MC), fill(logits_MCK.argmax(dim=-1))


def _pixels(
    targets_MX: torch.Tensor, preds_MX: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """pixels_l2: the patch pixels (objectives.targets.patch_pixels order: rows, columns,
    RGB), predictions clipped to [0, 1]. Per-patch normalized predictions are mapped back
    with the target patch's own mean and std by `run_examples` before this."""

    def unpatch(x_MX: torch.Tensor) -> torch.Tensor:
        return x_MX.reshape(-1, patch_size, patch_size, 3).permute(0, 3, 1, 2).clamp(0, 1)

    return unpatch(targets_MX), unpatch(preds_MX)


# objective.target -> (targets, logits, patch_size) -> (target pixels, predicted pixels).
PATCH_PIXELS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "mean_color": _mean_color_pixels,
    "color_4x4": _cell_color_pixels,
    "pixels_l2": _pixels,
}


def target_pixels(
    target: str, targets: torch.Tensor, logits: torch.Tensor, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, predicted) pixels [M, 3, P, P] in [0, 1] of the M corrupted patches."""
    if target not in PATCH_PIXELS:
        raise InputError(f"no example rendering for objective.target '{target}'")
    return PATCH_PIXELS[target](targets, logits, patch_size)


@dataclass
class Examples:
    """images [B, 3, H, W] float in [0, 1]; kind [B, N] (objectives.corruption convention);
    target / predicted [B, 3, H, W]: the images with each corrupted patch replaced by its
    target / prediction (untouched patches as in the image)."""

    images: torch.Tensor
    kind: torch.Tensor
    target: torch.Tensor
    predicted: torch.Tensor
    patch_size: int
    checkpoint: Path


def _paste(images_BCHW: torch.Tensor, chosen_BN: torch.Tensor, patches_MCPP: torch.Tensor):
    """The images with the chosen patches replaced by `patches`, which come image by image,
    each image's patches in row-major order: the order MaskedPatchOutput lists the corrupted
    patches' targets and logits in."""
    B, C, H, W = images_BCHW.shape
    P = patches_MCPP.shape[-1]
    h, w = H // P, W // P
    grid = images_BCHW.reshape(B, C, h, P, w, P).permute(0, 2, 4, 1, 3, 5)
    grid = grid.reshape(B, h * w, C, P, P).clone()
    grid[chosen_BN] = patches_MCPP.to(grid.dtype)
    return grid.reshape(B, h, w, C, P, P).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def find_data(spec: str, run: Run) -> str | None:
    """`spec` (a path written in the run's config, maybe relative to the directory the run
    was launched from) as it exists here, or None. Tries it as given, then relative to the
    launch directory implied by the run's output_dir."""
    if not spec:
        return None
    first = spec.split(",")[0].split("{")[0]
    if Path(first).exists():
        return spec
    out = Path(str(run.config.get("output_dir", "")))
    parts = run.path.resolve().parts
    if out.parts and not out.is_absolute() and parts[-len(out.parts) :] == out.parts:
        root = Path(*parts[: -len(out.parts)])
        if (root / first).exists():
            return ",".join(str(root / s) for s in spec.split(","))
    return None


@torch.no_grad()
def run_examples(run: Run, ckpt: Path, num: int = 8, seed: int = 0) -> Examples | str:
    """Run checkpoint `ckpt`'s (one of the run's) full objective model on the first `num`
    images of the run's data (resized, center-cropped), corruption drawn from a seeded
    generator. Returns the examples, or a one-line reason why there are none."""
    cfg = load_config(PretrainConfig, str(run.path / "config.yaml"), [])
    if cfg.objective.target not in PATCH_PIXELS:
        return f"no example rendering for objective.target '{cfg.objective.target}' yet"
    source = find_data(cfg.data.train_shards, run)
    if source is None:
        return f"the run's data ({cfg.data.train_shards}) is not present here"
    state = load_checkpoint(ckpt, rng=False)
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective, cfg.data.mean, cfg.data.std)
    model.load_state_dict(state["model"])
    model.eval()
    batch = next(iter(eval_loader(source, num, cfg.model.image_size, num_workers=0)))
    images = batch.images[:num]
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(seed)))
    P = model.encoder.patch_size
    preds = out.logits
    if cfg.objective.target == "pixels_l2" and cfg.objective.normalize_pixels:
        # Predictions are per-patch standardized pixels: show them in the target's own range.
        mean = out.targets.mean(dim=-1, keepdim=True)
        std = out.targets.var(dim=-1, keepdim=True, unbiased=False).add(1e-6).sqrt()
        preds = preds * std + mean
    tgt, pred = target_pixels(cfg.objective.target, out.targets, preds, P)
    x = images.float() / 255
    chosen = out.kind != 0
    return Examples(x, out.kind, _paste(x, chosen, tgt), _paste(x, chosen, pred), P, ckpt)
