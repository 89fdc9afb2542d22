"""What the layout-independent training stream costs: the loader's images/s with each
sample's augmentation seeded by its place in the stream (what training runs) against the same
loader drawing from the workers' running RNG (no per-sample seeding), and against one lane per
worker (each worker reading its own shards, as the stream read before lanes), measured in
alternating rounds in one run; then the time to the first batch of a fresh stream against one
resumed mid-epoch (a resumed lane re-reads its shard up to its position).

    python scripts/bench_stream.py --shards data/cifar10-train --workers 2 --images 20000

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ssl_vit.bench.loaders import interleaved_rates
from ssl_vit.config import PretrainDataConfig
from ssl_vit.data import StreamArgs, pretrain_loader
from ssl_vit.data.stream_state import StreamTracker


def make(args: argparse.Namespace, seeded: bool = True, resume: dict | None = None, lanes=0):
    data = PretrainDataConfig(train_shards=args.shards, lanes=lanes)
    stream = StreamArgs(args.batch_size, args.workers, args.image_size, resume=resume)
    loader = pretrain_loader(data, stream)
    loader.dataset.seeded = seeded  # before the workers start: they get a copy
    return loader


def first_batch_s(loader) -> float:
    t0 = time.perf_counter()
    next(iter(loader))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shards", required=True, help="training shards (directory or index)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--images", type=int, default=20000, help="images per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--resume-after", type=int, default=20, help="batches before the resume")
    args = p.parse_args()

    loaders = {
        "seeded per sample": make(args),
        "not seeded": make(args, seeded=False),
        "one lane per worker": make(args, lanes=max(args.workers, 1)),
    }
    rates = interleaved_rates(loaders, args.images, args.rounds)
    result = {
        "images_per_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()},
    }
    del loaders

    loader = make(args)
    tracker = StreamTracker(loader.tracker.identity, loader.tracker.lanes)
    it = iter(loader)
    for _ in range(args.resume_after):
        tracker.update(next(it))
    del it, loader
    result["first_batch_s"] = {
        "fresh": round(first_batch_s(make(args)), 3),
        f"resumed after {args.resume_after} batches": round(
            first_batch_s(make(args, resume=tracker.state_dict())), 3
        ),
    }
    result["lanes"] = tracker.lanes
    result.update(workers=args.workers, batch_size=args.batch_size, image_size=args.image_size)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
