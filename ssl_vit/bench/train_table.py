"""The table `scripts/bench.py` prints: one column per model shape, one row per figure."""

from __future__ import annotations

__all__ = ["TABLE", "print_table"]

TABLE = [  # (label, key, sub-key); {d} = default precision, {w} = default worker count
    ("train img/s ours (default precision)", "images_per_s", "ours_{d}"),
    ("train img/s timm (same precision)", "images_per_s", "timm_{d}"),
    ("train img/s ours fp32", "images_per_s", "ours_no"),
    ("train img/s timm fp32", "images_per_s", "timm_no"),
    ("train img/s ours bf16 autocast", "images_per_s", "ours_bf16"),
    ("train img/s timm bf16 autocast", "images_per_s", "timm_bf16"),
    ("train img/s timm defaults (fp32, its AdamW)", "images_per_s", "timm_default"),
    ("ratio ours/timm same precision", "ratio_vs_timm_same_precision", None),
    ("ratio ours/timm fp32", "ratio_vs_timm_fp32", None),
    ("ratio ours-default/timm-default", "ratio_vs_timm_defaults", None),
    ("step GFLOP (counted)", "step_gflop", None),
    ("achieved GFLOP/s (default precision)", "achieved_gflops", "{d}"),
    ("matmul peak GFLOP/s (same dtype)", "matmul_peak_gflops", "{d}"),
    ("utilization (fraction of that peak)", "utilization", None),
    ("utilization fp32", "utilization_by_precision", "no"),
    ("utilization bf16", "utilization_by_precision", "bf16"),
    ("corruption+targets / step", "overhead_fraction", None),
    ("loader img/s ours, 1 worker", "loader_images_per_s", "ours_1"),
    ("loader img/s ImageFolder, 1 worker", "loader_images_per_s", "imagefolder_1"),
    ("loader img/s ours, all workers", "loader_images_per_s", "ours_{w}"),
    ("loader img/s ImageFolder, all workers", "loader_images_per_s", "imagefolder_{w}"),
    ("loader ours/ImageFolder per worker", "loader_vs_imagefolder", None),
    ("loader (all workers) / training", "loader_vs_training", None),
    ("RSS MB before streaming (this process)", "rss_mb_before", None),
    ("peak RSS MB streaming 1x shards", "rss_mb_1x", None),
    ("peak RSS MB streaming 4x shards", "rss_mb_4x", None),
    ("peak accelerator memory MB", "peak_accel_mem_mb", None),
]


def _cell(fig: dict, key: str, sub: str | None) -> str:
    v = fig.get(key)
    if sub is not None and isinstance(v, dict):
        v = v.get(sub.format(d=fig["default_precision"], w=fig.get("loader_workers", 1)))
    if not isinstance(v, int | float):
        return "-"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


def print_table(result: dict) -> None:
    """The figures of every shape side by side, then the machine and the timing note."""
    shapes = result["shapes"]
    print(f"\n{'':46s}" + "".join(f"{s['model']:>14s}" for s in shapes))
    for label, key, sub in TABLE:
        print(f"{label:46s}" + "".join(f"{_cell(s, key, sub):>14s}" for s in shapes))
    m = result["machine"]
    where = f"{result['device']}, {m.get('gpu', m['cpu'])}, {m['threads']} threads"
    print(f"\ndevice {where}, torch {m['torch']}, timm {m.get('timm')}; data: {result['data']}")
    print(result["timing"])
