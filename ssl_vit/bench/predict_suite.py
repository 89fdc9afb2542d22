"""`scripts/bench.py --suite predict` (issue 35): `ssl-vit predict` against timm's usual
inference, on the same image files, with the same model shape, batch and loader workers.

  ours: pipelines/predict.py run in-process on a classifier file of the given shape (random
        weights: the speed does not depend on them); its own images/s over its loop (loader
        start-up included), rows written to predictions.jsonl;
  timm: `timm.create_model` of the same shape, torchvision `ImageFolder` with timm's own eval
        transform (`resolve_data_config` + `create_transform`), a DataLoader with the same
        workers, softmax top-k taken to the host per batch (what timm's inference.py does).

Both run in the same precision (the default of predict: bf16 autocast on a GPU with it, fp32
elsewhere) in alternating rounds (ours, timm, timm, ours, ...); medians are reported.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ssl_vit.bench.timing import autocast_dtype
from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.config.schema import ModelConfig
from ssl_vit.config.variants import resolve_variant

__all__ = ["markdown", "predict_suite"]


def _classifier_file(folder: Path, out: Path, variant: str, image_size: int) -> Path:
    """A fine-tuning run directory holding a random classifier of `variant` for `folder`'s
    classes (its model.safetensors is all predict reads)."""
    from ssl_vit.config.loader import to_dict
    from ssl_vit.data.sources import FolderSource
    from ssl_vit.model import Classifier, PixelNorm, build_vit
    from ssl_vit.train.classifier_file import ClassifierSpec, save_classifier

    names = FolderSource(folder).label_names
    cfg = ModelConfig(variant=variant, image_size=image_size).resolved()
    cfg.validate()
    torch.manual_seed(0)
    model = Classifier(build_vit(cfg), len(names), "cls", PixelNorm())
    torch.nn.init.normal_(model.head.weight, std=0.02)  # not zero: no tied logits
    spec = ClassifierSpec(to_dict(cfg), "cls", tuple(names), PIXEL_NORM, PIXEL_NORM)
    out.mkdir(parents=True, exist_ok=True)
    save_classifier(model, out / "model.safetensors", spec)
    return out


def _ours(run: Path, folder: Path, out: Path, batch_size: int, workers: int) -> float:
    from ssl_vit.cli import pipeline_module

    argv = ["--checkpoint", str(run), "--source", str(folder), "--output", str(out)]
    argv += ["--batch-size", str(batch_size), "--workers", str(workers), "--overwrite"]
    return pipeline_module("predict").main(argv)["images_per_s"]


def _timm_model(variant: str, image_size: int, num_classes: int, device):
    import timm

    shape = resolve_variant(variant)
    model = timm.create_model(
        "vit_base_patch16_224", pretrained=False, num_classes=num_classes, img_size=image_size,
        patch_size=shape["patch_size"], embed_dim=shape["width"], depth=shape["depth"],
        num_heads=shape["heads"], global_pool="token",
    )  # fmt: skip
    # The preprocessing a `--to timm` export of ours declares: the same work as predict's.
    model.pretrained_cfg = {
        **model.pretrained_cfg, "input_size": (3, image_size, image_size), "crop_pct": 1.0,
        "interpolation": "bilinear", "mean": PIXEL_NORM, "std": PIXEL_NORM,
    }  # fmt: skip
    return model.to(device).eval()


@torch.no_grad()
def _timm(model, folder: Path, batch_size: int, workers: int, device, autocast) -> float:
    from timm.data import create_transform, resolve_data_config
    from torch.utils.data import DataLoader
    from torchvision import datasets

    transform = create_transform(**resolve_data_config({}, model=model))
    data = datasets.ImageFolder(str(folder), transform=transform)
    loader = DataLoader(
        data, batch_size=batch_size, num_workers=workers, pin_memory=device.type == "cuda"
    )
    t0, n = time.perf_counter(), 0
    for images, _ in loader:
        with autocast:
            logits = model(images.to(device, non_blocking=True))
        p, idx = logits.float().softmax(dim=-1).topk(min(5, logits.shape[-1]), dim=-1)
        rows = list(zip(idx.tolist(), p.tolist(), strict=True))
        n += len(rows)
    return n / (time.perf_counter() - t0)


def predict_suite(
    tmp: Path,
    *,
    photos: str | None,
    num_images: int,
    image_size: int,
    variant: str,
    batch_size: int,
    workers: int,
    rounds: int,
) -> dict[str, Any]:
    """Images/s of ours and timm's inference, `rounds` alternating rounds each."""
    from ssl_vit.datasets.photos import write_photo_folder
    from ssl_vit.train.runtime import resolve_mixed_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_mixed_precision("auto")
    dtype = autocast_dtype(precision)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    folder = Path(photos) if photos else tmp / "photos"
    if not photos:
        write_photo_folder(folder, n=num_images, seed=0)
    run = _classifier_file(folder, tmp / "ft", variant, image_size)
    num_classes = len([d for d in folder.iterdir() if d.is_dir()])
    model = _timm_model(variant, image_size, num_classes, device)
    rates: dict[str, list[float]] = {"ours": [], "timm": []}
    for r in range(rounds):
        for name in ("ours", "timm") if r % 2 == 0 else ("timm", "ours"):
            if name == "ours":
                rates[name].append(_ours(run, folder, tmp / "pred", batch_size, workers))
            else:
                rates[name].append(_timm(model, folder, batch_size, workers, device, autocast))
    ours, timm_ = statistics.median(rates["ours"]), statistics.median(rates["timm"])
    return {
        "images": sum(1 for p in folder.rglob("*") if p.is_file()),
        "model": f"ViT-{variant} at {image_size} px",
        "batch_size": batch_size,
        "workers": workers,
        "precision": precision,
        "device": str(device),
        "images_per_s": {"ours": ours, "timm_imagefolder": timm_},
        "rounds": rates,
        "ours_vs_timm": ours / timm_,
    }


def markdown(result: dict[str, Any]) -> str:
    r = result["images_per_s"]
    head = (
        f"{result['model']}, batch {result['batch_size']}, {result['workers']} workers, "
        f"{result['precision']}, {result['images']} images, {result['device']}"
    )
    return "\n".join(
        [
            f"| predict: {head} | img/s |",
            "|---|---:|",
            f"| `ssl-vit predict` | {r['ours']:.1f} |",
            f"| timm model + ImageFolder DataLoader | {r['timm_imagefolder']:.1f} |",
            f"| ours / timm | {result['ours_vs_timm']:.2f}x |",
        ]
    )
