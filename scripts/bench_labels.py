"""What a label budget costs to read: the one-time copy of the subset into the run directory,
then one training epoch over the subset against one over the whole source.

    python scripts/bench_labels.py --source data/cifar10-train --labels-per-class 500

Each epoch is the fine-tuning loader itself (decode, crop, flip, batches of 64, 1 worker) read
to the end of its first epoch, and the bytes it reads are the shards' sizes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ssl_vit.config import FinetuneDataConfig
from ssl_vit.data import StreamArgs, resolve_shards, train_loader
from ssl_vit.data.labelled import choose_labelled, use_labelled


def epoch_seconds(spec: str, num_images: int, batch: int, image_size: int) -> float:
    """Seconds to read one epoch (`num_images`) of `spec` through the training loader."""
    loader = train_loader(FinetuneDataConfig(train=spec), StreamArgs(batch, 1, image_size))
    t0, seen = time.perf_counter(), 0
    for b in loader:
        seen += len(b.images)
        if seen >= num_images:
            break
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--source", required=True, help="labelled shards (or folder, HF dataset)")
    p.add_argument("--labels-per-class", type=int, required=True)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subset = choose_labelled(args.source, args.labels_per_class)
        t_choose = time.perf_counter() - t0
        spec = use_labelled(subset, tmp, write=True)
        t_write = time.perf_counter() - t0 - t_choose
        sizes = {
            "subset": sum(Path(u).stat().st_size for u in resolve_shards(spec)),
            "source": sum(Path(u).stat().st_size for u in resolve_shards(args.source)),
        }
        n_source = sum(subset.available.values())
        shape = (args.batch_size, args.image_size)
        result = {
            "source": args.source,
            "labels_per_class": args.labels_per_class,
            "images": {"subset": subset.num_labelled, "source": n_source},
            "choose_s": round(t_choose, 2),
            "write_once_s": round(t_write, 2),
            "epoch_s": {
                "subset": round(epoch_seconds(spec, subset.num_labelled, *shape), 2),
                "source": round(epoch_seconds(args.source, n_source, *shape), 2),
            },
            "epoch_mb": {k: round(v / 2**20, 1) for k, v in sizes.items()},
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
