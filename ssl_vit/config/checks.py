"""Value checks shared by the config schemas: each raises one `ConfigError` line naming the key."""

from __future__ import annotations

import os
from typing import Any

from ssl_vit.errors import ConfigError

__all__ = [
    "MAX_AUTO_WORKERS",
    "auto_num_workers",
    "available_cpus",
    "check_batch_memory",
    "check_data_loading",
    "check_fraction",
    "check_min",
    "check_pixels_norm",
    "check_positive",
    "check_seed",
    "check_source_job",
]

MAX_AUTO_WORKERS = 8
# A micro-batch's decoded float form may take at most this share of a process's part of the
# host's memory (`check_batch_memory`).
BATCH_MEMORY_SHARE = 0.25


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a SLURM allocation)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def auto_num_workers(requested: int) -> int:
    """`data.num_workers`; -1 (auto) -> min(8, usable CPUs // processes on this node).

    Each process of a node starts its own workers; LOCAL_WORLD_SIZE (set by accelerate launch
    and torchrun) says how many share the node's CPUs."""
    if requested >= 0:
        return requested
    return max(min(MAX_AUTO_WORKERS, available_cpus() // _local_processes()), 1)


def _local_processes() -> int:
    """The job's processes on this node: LOCAL_WORLD_SIZE (set by accelerate launch and
    torchrun), 1 without a launcher."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def _host_memory() -> int | None:
    """The host's physical memory in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_batch_memory(key: str, value: int, per_unit: int, image_size: int) -> None:
    """A process's micro-batch of `value` x `per_unit` RGB images at `image_size` px (`value`:
    the config key `key`'s) fits in memory: its decoded float batch (images x 3 x H x W x 4
    bytes) takes at most `BATCH_MEMORY_SHARE` of this process's part of the host's memory.

    Why a quarter: the host holds each micro-batch as uint8 about 4 times over (each loader
    worker's 2 prefetched messages, the assembled batch, its pinned copy), as much as the float
    batch, and a CPU job the float batch and its activations (many times larger) besides. The
    bound refuses the absurd (a batch that takes the machine down before step 1), not the
    merely large: one within it may still be too large for the device (out of memory at step
    1)."""
    memory = _host_memory()
    if memory is None:
        return
    share = memory / _local_processes()
    per_image = 3 * image_size * image_size * 4
    images = value * per_unit
    if images * per_image <= share * BATCH_MEMORY_SHARE:
        return
    most = int(share * BATCH_MEMORY_SHARE // (per_image * per_unit))  # the largest that fits
    raise ConfigError(
        f"{key}={value}: {images:,} images of 3 x {image_size} x {image_size} px in a process's "
        f"micro-batch are {images * per_image / 2**30:,.1f} GiB as floats, over "
        f"{BATCH_MEMORY_SHARE:.0%} of this process's part of the host's memory "
        f"({share / 2**30:,.1f} GiB); lower {key}" + (f" (at most {most})" if most else "")
    )


def check_data_loading(num_workers: int, load_size: int) -> None:
    """The loading keys shared by the data configs (the run plan resolves an auto worker
    count: `auto_num_workers`)."""
    if num_workers < -1:
        raise ConfigError(f"data.num_workers: must be >= 0 or -1 (auto), got {num_workers}")
    if load_size < 0:
        raise ConfigError(f"data.load_size: must be >= 0 (0: auto), got {load_size}")


def check_min(prefix: str, obj: Any, names: tuple[str, ...], minimum: int) -> None:
    """Every `obj.<name>` (a number) is >= `minimum`; the error names `prefix + name`."""
    for name in names:
        if getattr(obj, name) < minimum:
            raise ConfigError(f"{prefix}{name}: must be >= {minimum}, got {getattr(obj, name)}")


def check_positive(prefix: str, obj: Any, names: tuple[str, ...]) -> None:
    """Every `obj.<name>` (a number, None skipped) is > 0; the error names `prefix + name`."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{prefix}{name}: must be > 0, got {value}")


def check_fraction(key: str, value: float, low_open: bool = True) -> None:
    """`value` in (0, 1] (low_open) or [0, 1)."""
    ok = 0.0 < value <= 1.0 if low_open else 0.0 <= value < 1.0
    if not ok:
        raise ConfigError(f"{key}: must be in {'(0, 1]' if low_open else '[0, 1)'}, got {value}")


def check_pixels_norm(
    prefix: str, std: tuple[float, ...] | None, crop_scale: tuple[float, float] | None = None
) -> None:
    """Normalization (std > 0: it divides; None: a checkpoint's, checked when read; the mean
    only needs to be finite, as every float key) and the random-resized-crop area range
    0 < low <= high <= 1 (a crop cannot be larger than the image)."""
    if std is not None and min(std) <= 0:
        raise ConfigError(f"{prefix}std: every value must be > 0, got {list(std)}")
    if crop_scale is not None:
        low, high = crop_scale
        if not 0.0 < low <= high <= 1.0:
            raise ConfigError(
                f"{prefix}crop_scale: need 0 < low <= high <= 1, got {list(crop_scale)}"
            )


def check_seed(seed: int) -> None:
    # Every stream's seed is derived from it (ssl_vit.seeds); kept below 2**31 for old tools.
    if not 0 <= seed < 2**31:
        raise ConfigError(f"seed: must be in [0, 2**31), got {seed}")


def check_source_job(cfg: Any, output: str) -> None:
    """What a job reading `--source` with `--checkpoint` into `--output` (predict, select: its
    PredictConfig or SelectConfig) needs: the three given, and a loader worker count >= 0 or -1
    (auto)."""
    for key, flag in (("checkpoint", "--checkpoint"), ("source", "--source")):
        if not str(getattr(cfg, key)).strip():
            raise ConfigError(f"{flag}: required")
    if not cfg.output_dir.strip():
        raise ConfigError(f"--output: required (a directory for {output})")
    if cfg.num_workers < -1:
        raise ConfigError(f"num_workers: must be >= 0 or -1 (auto), got {cfg.num_workers}")
