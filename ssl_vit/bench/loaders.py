"""Data-loading measurements of scripts/bench.py: our WebDataset pipeline versus a torchvision
`ImageFolder` + `DataLoader` on the same images with the same transforms, and peak memory
while streaming more and more shards."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

from ssl_vit.bench.timing import PeakRSS
from ssl_vit.config.schema import PretrainDataConfig
from ssl_vit.data import StreamArgs, pretrain_loader, resolve_shards
from ssl_vit.data.images import torchvision_train_transform
from ssl_vit.data.shards import read_index
from ssl_vit.datasets.synthetic import SYNTHETIC_LABELS, make_synthetic_shards, synthetic_shapes

__all__ = [
    "imagefolder_loader",
    "images_per_shard",
    "interleaved_rates",
    "make_synthetic_data",
    "ours_loader",
    "streaming_peak_rss",
]


def ours_loader(urls: Sequence[str], batch_size: int, image_size: int, num_workers: int):
    """Our pretraining loader exactly as pipelines/pretrain.py builds it (default options)."""
    stream = StreamArgs(batch_size, num_workers, image_size)
    return pretrain_loader(PretrainDataConfig(), stream, urls=urls)


def imagefolder_loader(
    root: str | Path, batch_size: int, image_size: int, num_workers: int
) -> DataLoader:
    """The usual torchvision pipeline: ImageFolder (PIL decoding), the same augmentation from
    stock v2 transforms on the uint8 tensor, DataLoader with shuffling, persistent workers,
    pinned memory on GPU."""
    augment = torchvision_train_transform(image_size)
    transform = v2.Compose([v2.PILToTensor(), augment])
    return DataLoader(
        datasets.ImageFolder(str(root), transform=transform),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        drop_last=True,
    )


def _endless(loader: DataLoader) -> Iterator:
    """Batches forever (a finite ImageFolder loader starts a new epoch when it ends)."""
    while True:
        yield from loader


def interleaved_rates(
    loaders: dict[str, DataLoader], images: int, rounds: int = 3
) -> dict[str, list[float]]:
    """Images/s of every loader, measured in alternating rounds over ~`images` images each.
    Before each timed stretch the batches a loader prefetched while idle are drained untimed,
    so every stretch measures production, not a full queue."""
    its = {name: _endless(loader) for name, loader in loaders.items()}
    for it in its.values():
        next(it)  # start the workers, fill shuffle buffers
    names = list(its)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            loader, it = loaders[name], its[name]
            for _ in range(max(1, loader.num_workers) * (loader.prefetch_factor or 1)):
                next(it)
            seen, t0 = 0, time.perf_counter()
            while seen < images:
                batch = next(it)  # ours a Batch, ImageFolder's an (images, labels) pair
                seen += len(batch.images) if hasattr(batch, "images") else len(batch[0])
            rates[name].append(seen / (time.perf_counter() - t0))
    return rates


def images_per_shard(shards: str) -> int:
    """Mean samples per shard from index.json (5000 if the shards have no index)."""
    index = read_index(shards)
    if index is None or not index.get("shards"):
        return 5000
    counts = [s.get("num_samples", 0) for s in index["shards"]]
    return max(1, sum(counts) // len(counts))


def streaming_peak_rss(
    shards: str,
    num_shards: int,
    batch_size: int,
    image_size: int,
    num_workers: int,
) -> float:
    """Peak RSS (MB, main process + workers) while streaming `num_shards` shards' worth of
    images from a list of `num_shards` shard URLs (the given shards repeated as needed)."""
    urls = list(itertools.islice(itertools.cycle(resolve_shards(shards)), num_shards))
    total = num_shards * images_per_shard(shards)
    loader = ours_loader(urls, batch_size, image_size, num_workers)
    with PeakRSS() as rss:
        seen, it = 0, iter(loader)
        while seen < total:
            seen += len(next(it).images)
        del it  # shuts the workers down inside the measured block
    return rss.peak_mb


def make_synthetic_data(out: Path, n: int = 2000, image_size: int = 32) -> tuple[Path, Path]:
    """The same synthetic images as shards and as an ImageFolder tree: (shards, folder)."""
    shards, folder = out / "shards", out / "folder"
    make_synthetic_shards(shards, n=n, image_size=image_size, seed=0, shard_size=max(1, n // 4))
    for key, data, label in synthetic_shapes(n, image_size, seed=0):
        d = folder / SYNTHETIC_LABELS[label]
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{key}.png").write_bytes(data)
    return shards, folder
