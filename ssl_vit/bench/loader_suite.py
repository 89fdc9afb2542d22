"""`scripts/bench.py --suite loader` (issue 30): data at ImageNet size, on ImageNet-like photos.

In one process, on the same images (`ssl_vit.datasets.photos`, ~500x375 JPEG q90):
  1. `make-shards` wall time with 1 and with 2 workers (as given, and with `--max-size`), and
     whether both wrote the same bytes;
  2. loader images/s with ONE worker each, at the training size: our pretraining loader on the
     shards vs torchvision `ImageFolder` + `RandomResizedCrop` + flip on the folder, on the
     images as given and on the same images stored with `--max-size` (the folder made from
     those shards, so both read identical files). Contenders run in alternating rounds;
  3. the real pipelines/pretrain.py with a tiny model (width 32, depth 2: the loader
     dominates) and one loader worker, on both shard sets: its own logged images/s.
"""

from __future__ import annotations

import filecmp
import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ssl_vit.bench.loaders import imagefolder_loader, interleaved_rates, ours_loader
from ssl_vit.bench.pipeline_rows import run_pretrain
from ssl_vit.data import resolve_shards
from ssl_vit.data.sources import ShardSource
from ssl_vit.data.write.convert import make_shards
from ssl_vit.datasets.photos import write_photo_folder

__all__ = ["export_folder", "loader_suite", "pipeline_rate", "same_files", "time_make_shards"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: pipelines/pretrain.py

log = logging.getLogger(__name__)


def same_files(a: Path, b: Path) -> bool:
    """Whether two directories hold the same file names with the same bytes."""
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def time_make_shards(
    folder: Path, out: Path, workers: list[int], **options: Any
) -> tuple[dict[str, float], bool]:
    """({"<w> workers": seconds}, whether every run wrote the same bytes as the first);
    the shards of the last run stay at `out/w<last>`."""
    seconds, dirs = {}, []
    for w in workers:
        dirs.append(out / f"w{w}")
        t0 = time.perf_counter()
        make_shards(folder, dirs[-1], shard_size=500, progress=False, workers=w, **options)
        seconds[f"{w} workers"] = time.perf_counter() - t0
    return seconds, all(same_files(dirs[0], d) for d in dirs[1:])


def export_folder(shards: Path, folder: Path) -> None:
    """The images of `shards` as an image folder `folder/<class>/<key>.<ext>` (the same bytes):
    torchvision's ImageFolder then reads exactly what our loader reads."""
    src = ShardSource(str(shards))
    for rec in src.iter_records():
        d = folder / src.label_names[rec.label]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{rec.key}.{rec.ext}").write_bytes(rec.data)


def pipeline_rate(shards: Path, out: Path, image_size: int, batch: int, steps: int) -> dict:
    """pipelines/pretrain.py on `shards` with a tiny ViT (patch 16, width 32, depth 2) and one
    loader worker: the median of its logged images/s after the first log line, and its
    data-wait fractions (near 1: the loader decides the speed, as intended here)."""
    every = max(1, steps // 4)
    cmd = [
        *(sys.executable, str(ROOT / "pipelines/pretrain.py"), f"data.train_shards={shards}"),
        *(f"output_dir={out}", f"model.image_size={image_size}", "model.patch_size=16"),
        *("model.width=32", "model.depth=2", "model.heads=2", f"train.batch_size={batch}"),
        *(f"train.steps={steps}", f"train.log_every={every}", "train.warmup_steps=2"),
        *("train.checkpoint_every=0", "data.num_workers=1"),
    ]
    img_per_s, laps = run_pretrain(cmd, ROOT, out, timeout=1800)
    return {
        "img_per_s": img_per_s,
        "data_wait": [r.get("data_wait") for r in laps],
        "steps": steps,
    }


def loader_suite(
    tmp: Path,
    num_images: int = 2000,
    image_size: int = 224,
    max_size: int = 256,
    batch_size: int = 32,
    rounds: int = 3,
    images_per_round: int = 640,
    photos: str | None = None,
    pipeline_steps: int = 40,
) -> dict[str, Any]:
    """Every figure of the section (see the module docstring) as a JSON-able dict."""
    folder = Path(photos) if photos else tmp / "photos"
    if photos is None:
        log.info("[loader] writing %d photos ...", num_images)
        write_photo_folder(folder, n=num_images, seed=0)
    n = sum(len(files) for _, _, files in os.walk(folder))
    log.info("[loader] make-shards, 1 and 2 workers ...")
    full_s, full_same = time_make_shards(folder, tmp / "full", [1, 2])
    small_s, small_same = time_make_shards(folder, tmp / "small", [1, 2], max_size=max_size)
    full, small = tmp / "full/w2", tmp / "small/w2"
    export_folder(small, tmp / "small_folder")
    loaders = {
        "ours": ours_loader(resolve_shards(str(full)), batch_size, image_size, 1),
        "imagefolder": imagefolder_loader(folder, batch_size, image_size, 1),
        "ours_max_size": ours_loader(resolve_shards(str(small)), batch_size, image_size, 1),
        "imagefolder_max_size": imagefolder_loader(tmp / "small_folder", batch_size, image_size, 1),
    }
    log.info("[loader] loaders, 1 worker each, %d rounds ...", rounds)
    rates = interleaved_rates(loaders, images_per_round, rounds)
    del loaders
    gc.collect()
    med = {k: statistics.median(v) for k, v in rates.items()}
    log.info("[loader] pipelines/pretrain.py, tiny model, 1 worker ...")
    pipeline = {
        name: pipeline_rate(shards, tmp / f"run_{name}", image_size, batch_size, pipeline_steps)
        for name, shards in (("as given", full), (f"max-size {max_size}", small))
    }
    return {
        "images": n,
        "image_size": image_size,
        "max_size": max_size,
        "batch_size": batch_size,
        "make_shards_s": {"as given": full_s, f"max-size {max_size}": small_s},
        "make_shards_2_vs_1_workers": {
            "as given": full_s["2 workers"] / full_s["1 workers"],
            f"max-size {max_size}": small_s["2 workers"] / small_s["1 workers"],
        },
        "make_shards_identical_output": full_same and small_same,
        "loader_images_per_s_1_worker": med,
        "loader_rate_spread": {k: [min(v), max(v)] for k, v in rates.items()},
        "ours_vs_imagefolder": med["ours"] / med["imagefolder"],
        "ours_vs_imagefolder_max_size": med["ours_max_size"] / med["imagefolder_max_size"],
        "ours_max_size_vs_imagefolder_as_given": med["ours_max_size"] / med["imagefolder"],
        "pipeline_tiny_model_1_worker": pipeline,
    }


def markdown(result: dict[str, Any]) -> str:
    """The section as the Markdown table docs/performance.md keeps."""
    r, m = result["loader_images_per_s_1_worker"], result["max_size"]
    rows = [
        ("ours, as given", r["ours"]),
        ("ImageFolder + RandomResizedCrop + flip, as given", r["imagefolder"]),
        (f"ours, --max-size {m}", r["ours_max_size"]),
        (f"ImageFolder, --max-size {m} images", r["imagefolder_max_size"]),
    ]
    lines = ["| loader, 1 worker | img/s |", "|---|---|"]
    lines += [f"| {label} | {v:.0f} |" for label, v in rows]
    lines += [
        f"| ours / ImageFolder, as given | {result['ours_vs_imagefolder']:.2f}x |",
        f"| ours / ImageFolder, --max-size {m} | {result['ours_vs_imagefolder_max_size']:.2f}x |",
    ]
    for what, run in result["pipeline_tiny_model_1_worker"].items():
        lines.append(f"| pipelines/pretrain.py, tiny model, {what} | {run['img_per_s']:.0f} |")
    for what, secs in result["make_shards_s"].items():
        ratio = result["make_shards_2_vs_1_workers"][what]
        lines.append(
            f"| make-shards {what}: 1 / 2 workers | {secs['1 workers']:.1f} s / "
            f"{secs['2 workers']:.1f} s ({ratio:.2f}x) |"
        )
    return "\n".join(lines)
