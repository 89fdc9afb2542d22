"""The data sub-commands of `ssl-vit` (`ssl_vit.cli`): `make-shards` (the write side,
`ssl_vit.data.write`) and `make-synthetic` (the dataset generators, `ssl_vit.datasets`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ssl_vit.errors import ConfigError

__all__ = ["add_make_shards", "add_make_synthetic"]


# The commands import their modules when run, so that `ssl-vit --help` does not load torch.


def cmd_make_shards(args: argparse.Namespace) -> int:
    """`ssl-vit make-shards`: image folder / HF dataset -> WebDataset shards + index.json."""
    from ssl_vit.config.checks import available_cpus
    from ssl_vit.data.write.convert import cap_workers, make_shards

    start = time.perf_counter()
    workers = available_cpus() if args.workers is None else args.workers
    workers = cap_workers(workers)  # refuses < 1
    _check_output_owner(Path(args.output), args.source)  # then make_shards: what it holds
    index = make_shards(
        args.source,
        args.output,
        shard_size=args.shard_size,
        verify=args.verify,
        split=args.split,
        source_format=args.format,
        shuffle_seed=None if args.no_shuffle else args.shuffle_seed,
        workers=workers,
        part=args.part,
        max_size=args.max_size,
        quality=args.quality,
        lossless=args.lossless,
        overwrite=args.overwrite,
    )
    seconds = time.perf_counter() - start
    where = args.output if args.part is None else f"{args.output} (part {args.part})"
    print(
        f"wrote {index['num_samples']} images ({len(index['label_names'])} classes, "
        f"{index['num_skipped']} skipped) in {len(index['shards'])} shards to {where} "
        f"in {seconds:.1f}s ({index['num_samples'] / seconds:.0f} img/s, {workers} workers)"
    )
    return 0


def _check_output_owner(out: Path, source: str) -> None:
    """ConfigError (one line, before the source is opened) if make-shards' `out` belongs to a
    job, as predict and export refuse theirs (`ssl_vit.runs.occupancy`): it is a run directory
    (a finished run's files or a live job's lock), or lies in a checkpoint or in what a run
    writes (its checkpoints/, its labelled copy); or it is, holds or lies in `source`. A new
    folder inside a run directory is fine, as for them."""
    from ssl_vit.runs.occupancy import check_not_source

    check_not_source("--output", out, {"--source": source})
    why = _job_owned(out)
    if why is not None:
        raise ConfigError(f"--output {out}: {why}; write the shards to a folder of their own")


def _job_owned(out: Path) -> str | None:
    from ssl_vit.runs.occupancy import is_checkpoint, is_run_dir
    from ssl_vit.train.rundir import run_files

    real = out.expanduser().resolve()
    if is_run_dir(real):
        return "is a run directory"
    for d in (real, *real.parents):
        how = "is" if d == real else "is inside"
        if is_checkpoint(d):
            return f"{how} the training checkpoint {d}"
        if is_run_dir(d.parent) and (d.name == "checkpoints" or d in run_files(d.parent)):
            return f"{how} {d}, written by the run {d.parent}"
    return None


def cmd_make_synthetic(args: argparse.Namespace) -> int:
    """`ssl-vit make-synthetic`: the procedural shapes dataset -> shards + index.json, or
    (`--kind photos`) ImageNet-like JPEGs from real photographs -> shards or an image folder."""
    from ssl_vit.datasets.synthetic import make_synthetic_shards

    start = time.perf_counter()
    if args.kind == "photos":
        return _make_photos(args, start)
    if args.folder or args.overwrite:
        raise ConfigError(f"--{'folder' if args.folder else 'overwrite'} is for --kind photos")
    image_size = 32 if args.image_size is None else args.image_size
    index = make_synthetic_shards(
        args.output,
        n=args.num,
        image_size=image_size,
        seed=args.seed,
        shard_size=args.shard_size,
    )
    print(
        f"wrote {index['num_samples']} synthetic {image_size}px images "
        f"({len(index['label_names'])} classes) in {len(index['shards'])} shards to "
        f"{args.output} in {time.perf_counter() - start:.1f}s"
    )
    return 0


def _make_photos(args: argparse.Namespace, start: float) -> int:
    from ssl_vit.datasets.photos import PHOTO_NAMES, make_photo_shards, write_photo_folder

    if args.num < 1:
        raise ConfigError(f"--num must be >= 1, got {args.num}")
    if args.image_size is not None:  # silently ignored, it would give 500 px images, not S px
        raise ConfigError(
            "--image-size is for --kind shapes: photos have ImageNet's sizes (~500x375); "
            "store them smaller with make-shards --max-size"
        )
    if args.overwrite and not args.folder:
        raise ConfigError("--overwrite is for --folder (shards replace a dataset as they are)")
    if args.folder:
        write_photo_folder(args.output, n=args.num, seed=args.seed, overwrite=args.overwrite)
        what = "an image folder"
    else:
        index = make_photo_shards(args.output, args.num, args.seed, args.shard_size)
        what = f"{len(index['shards'])} shards"
    print(
        f"wrote {args.num} ImageNet-like JPEG photos ({len(PHOTO_NAMES)} classes) as {what} "
        f"to {args.output} in {time.perf_counter() - start:.1f}s"
    )
    return 0


def add_make_shards(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-shards", help="write an image folder or HF dataset as shards")
    p.add_argument("--source", required=True, help="image folder or HF dataset directory")
    p.add_argument("--output", required=True, help="directory for shard-*.tar and index.json")
    p.add_argument("--shard-size", type=int, default=10000, help="images per shard")
    p.add_argument("--split", default="train", help="split of an HF DatasetDict")
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "folder", "hf", "hf-imagefolder"],
        help="auto: HF save_to_disk dir if detected, else image folder",
    )
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the PIL check")
    p.add_argument(
        "--shuffle-seed", type=int, default=0, help="seed of the order images are written in"
    )
    p.add_argument(
        "--no-shuffle", action="store_true", help="write in sorted order (one class per shard)"
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes that read, check and re-encode (default: the CPUs available); the "
        "output is the same for any number",
    )
    p.add_argument(
        "--part",
        metavar="I/N",
        help="write only part I of N (I from 0) of the sorted source, to "
        "OUTPUT/part-IIIII-of-NNNNN: one job of a job array",
    )
    p.add_argument(
        "--max-size",
        type=int,
        metavar="S",
        help="store images with the shorter side at most S (resized, re-encoded); smaller "
        "ones are copied as they are",
    )
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of resized images")
    p.add_argument(
        "--lossless",
        action="store_true",
        help="with --max-size: store resized PNG (lossless) sources as PNG, not JPEG",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier make-shards output (shards and index.json only; with --part, "
        "that part); a folder holding anything else is never written",
    )
    p.set_defaults(func=cmd_make_shards)


def add_make_synthetic(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-synthetic", help="write a synthetic dataset (shapes or photos)")
    p.add_argument("--output", required=True, help="directory for shard-*.tar and index.json")
    p.add_argument("--num", type=int, default=10000, help="number of images")
    p.add_argument(
        "--kind",
        default="shapes",
        choices=["shapes", "photos"],
        help="shapes: procedural PNGs; photos: ImageNet-like JPEGs (~500x375) from the "
        "photographs scikit-image ships (the `photos` extra)",
    )
    p.add_argument("--image-size", type=int, help="image side in pixels (shapes only; default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=int, default=2000, help="images per shard")
    p.add_argument(
        "--folder",
        action="store_true",
        help="photos: write an image folder (OUTPUT/<photo>/<key>.jpg), e.g. for make-shards; "
        "refused if OUTPUT is not empty",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --folder: replace a non-empty OUTPUT folder (everything in it)",
    )
    p.set_defaults(func=cmd_make_synthetic)
