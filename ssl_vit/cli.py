"""The `ssl-vit` command: one argparse sub-command per job.

To add a sub-command, write `_add_<name>(subparsers)` that registers its parser with
`set_defaults(func=cmd_<name>)` and a `cmd_<name>(args) -> int` that runs it, and list it in
`build_parser`. Exit status, as the jobs': 0 done, 1 an error (a missing source, a bad value: one
line on stderr, no traceback), 2 a command line argparse cannot parse (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "JOBS",
    "build_parser",
    "cmd_configs",
    "cmd_export",
    "cmd_import",
    "cmd_make_shards",
    "cmd_make_synthetic",
    "cmd_report",
    "entry",
    "main",
]


# Sub-commands import their modules when run, so that `ssl-vit --help` does not load torch.


def cmd_make_shards(args: argparse.Namespace) -> int:
    """`ssl-vit make-shards`: image folder / HF dataset -> WebDataset shards + index.json."""
    from ssl_vit.data.convert import available_cpus, cap_workers, make_shards

    start = time.perf_counter()
    workers = available_cpus() if args.workers is None else args.workers
    workers = cap_workers(workers) if workers >= 1 else workers  # make_shards refuses < 1
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
    )
    seconds = time.perf_counter() - start
    where = args.output if args.part is None else f"{args.output} (part {args.part})"
    print(
        f"wrote {index['num_samples']} images ({len(index['label_names'])} classes, "
        f"{index['num_skipped']} skipped) in {len(index['shards'])} shards to {where} "
        f"in {seconds:.1f}s ({index['num_samples'] / seconds:.0f} img/s, {workers} workers)"
    )
    return 0


def cmd_make_synthetic(args: argparse.Namespace) -> int:
    """`ssl-vit make-synthetic`: the procedural shapes dataset -> shards + index.json, or
    (`--kind photos`) ImageNet-like JPEGs from real photographs -> shards or an image folder."""
    from ssl_vit.data.synthetic import make_synthetic_shards

    start = time.perf_counter()
    if args.kind == "photos":
        return _make_photos(args, start)
    if args.folder or args.overwrite:
        raise ValueError(f"--{'folder' if args.folder else 'overwrite'} is for --kind photos")
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
    from ssl_vit.data.photos import PHOTO_NAMES, make_photo_shards, write_photo_folder

    if args.num < 1:
        raise ValueError(f"--num must be >= 1, got {args.num}")
    if args.image_size is not None:  # silently ignored, it would give 500 px images, not S px
        raise ValueError(
            "--image-size is for --kind shapes: photos have ImageNet's sizes (~500x375); "
            "store them smaller with make-shards --max-size"
        )
    if args.overwrite and not args.folder:
        raise ValueError("--overwrite is for --folder (shards replace a dataset as they are)")
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


def _add_make_shards(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=cmd_make_shards)


def _add_make_synthetic(sub: argparse._SubParsersAction) -> None:
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


def cmd_export(args: argparse.Namespace) -> int:
    """`ssl-vit export`: a checkpoint's encoder, or a fine-tuned classifier, -> timm or
    transformers directory with a model card."""
    from ssl_vit.publish import export_checkpoint, export_classifier, is_classifier
    from ssl_vit.train.checkpoint import CheckpointError, resolve_checkpoint

    if is_classifier(args.checkpoint):  # a fine-tuning run (or its model.safetensors)
        if args.keep_head:
            raise ValueError("--keep-head: a fine-tuned classifier has no masked-prediction head")
        info = export_classifier(args.checkpoint, args.to, args.outdir, overwrite=args.overwrite)
        what = f"{info['num_classes']}-class classifier"
    else:
        try:  # a run directory -> its newest valid checkpoint (logged)
            checkpoint = resolve_checkpoint(args.checkpoint)
            info = export_checkpoint(
                checkpoint, args.to, args.outdir, keep_head=args.keep_head, overwrite=args.overwrite
            )
        except CheckpointError as e:  # a missing or damaged checkpoint: a user error, one line
            raise ValueError(str(e)) from None
        what = "model"
    print(
        f"wrote {info['format']} {what} ({info['parameters']:,} parameters) with config.json "
        f"and README.md to {info['outdir']}"
    )
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's encoder or a fine-tuned classifier for timm or transformers",
    )
    p.add_argument(
        "checkpoint",
        help="checkpoint directory, encoder.safetensors, or a run directory (its newest valid "
        "checkpoint); a fine-tuning run directory or its model.safetensors: the whole classifier",
    )
    p.add_argument("--to", required=True, choices=["timm", "hf"], help="target library")
    p.add_argument("outdir", help="output directory (model.safetensors, config.json, README.md)")
    p.add_argument(
        "--keep-head",
        action="store_true",
        help="also write the masked-prediction head (ssl-vit names) as "
        "masked_patch_head.safetensors",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (never a run directory, checkpoint or "
        "dataset, nor the source)",
    )
    p.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> int:
    """`ssl-vit import`: timm or transformers ViT weights -> an ssl-vit encoder directory."""
    from ssl_vit.publish import import_weights
    from ssl_vit.train.checkpoint import CheckpointError

    try:
        info = import_weights(
            args.source, args.format, args.outdir, heads=args.heads, overwrite=args.overwrite
        )
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    c = info["model_config"]
    print(
        f"wrote encoder.safetensors (width {c['width']}, depth {c['depth']}, heads {c['heads']}, "
        f"patch {c['patch_size']}, {c['image_size']} px) to {info['outdir']}"
    )
    return 0


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="turn timm or transformers ViT weights into an encoder")
    p.add_argument("source", help="timm weights file / directory, or transformers directory")
    p.add_argument(
        "--from",
        dest="format",
        default="auto",
        choices=["auto", "timm", "hf"],
        help="source library (auto: detected from config.json / the key names)",
    )
    p.add_argument("outdir", help="output directory (encoder.safetensors)")
    p.add_argument("--heads", type=int, help="attention heads of a bare timm state dict")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (never a checkpoint or run directory)",
    )
    p.set_defaults(func=cmd_import)


def cmd_report(args: argparse.Namespace) -> int:
    """`ssl-vit report`: run directories -> self-contained report.html + report.md."""
    try:
        import matplotlib  # noqa: F401  (checked here: the figure modules import it late)
    except ImportError as e:  # matplotlib is the `report` extra
        raise ValueError(f"{e}; install it with: pip install 'ssl-vit[report]'") from None
    from ssl_vit.report import build_report

    paths = build_report(args.runs, args.output, num_examples=args.examples, seed=args.seed)
    print(f"wrote {paths['html']} and {paths['md']}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="HTML + Markdown report of run directories")
    p.add_argument("runs", nargs="+", help="run directories (or folders of run directories)")
    p.add_argument("--output", default="report", help="directory for report.html / report.md")
    p.add_argument("--examples", type=int, default=8, help="images in the example strip")
    p.add_argument("--seed", type=int, default=0, help="seed of the examples' corruption")
    p.set_defaults(func=cmd_report)


JOBS = {
    "pretrain": "masked patch prediction pretraining (pipelines/pretrain.py)",
    "finetune": "fine-tune an encoder as a classifier (pipelines/finetune.py)",
    "fewshot": "few-shot linear evaluation of a frozen encoder (pipelines/fewshot.py)",
    "predict": "label a source with a fine-tuned classifier (pipelines/predict.py)",
}


def pipeline_module(name: str) -> ModuleType:
    """The job `name` of pipelines/: `ssl_vit.pipelines.<name>` in an installed package (the
    wheel ships pipelines/ there), else `pipelines/<name>.py` of the checkout."""
    try:
        return importlib.import_module(f"ssl_vit.pipelines.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("ssl_vit.pipelines", f"ssl_vit.pipelines.{name}"):
            raise  # a missing dependency of the pipeline itself
    path = Path(__file__).resolve().parents[1] / "pipelines" / f"{name}.py"
    if not path.is_file():
        raise OSError(f"pipeline {name} not found (neither ssl_vit.pipelines nor {path})")
    spec = importlib.util.spec_from_file_location(f"ssl_vit_pipeline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_pipeline(name: str, argv: list[str]) -> int:
    """`ssl-vit pretrain|finetune|fewshot ARGS`: the pipeline's own command line, unchanged."""
    pipeline_module(name).main(argv)
    return 0


def _add_job(sub: argparse._SubParsersAction, name: str) -> None:
    # Listed for `ssl-vit --help` only: main() hands the arguments to the pipeline as they are.
    sub.add_parser(name, help=f"{JOBS[name]}; `ssl-vit {name} --help` for its arguments")


def cmd_configs(args: argparse.Namespace) -> int:
    """`ssl-vit configs`: list the shipped configs, or copy them (`--copy DIR [NAME ...]`)."""
    from ssl_vit.config.shipped import configs_dir, shipped_configs

    root, names = configs_dir(), shipped_configs()
    if root is None:
        raise OSError("no shipped configs found (neither ssl_vit/configs nor a checkout)")
    unknown = sorted(set(args.names) - set(names))
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; `ssl-vit configs` lists them")
    if args.copy is None:
        for name in args.names or names:
            print(f"{name:32s} {root / name}.yaml")
        return 0
    copied = 0
    for name in args.names or names:
        dest = Path(args.copy) / f"{name}.yaml"
        if dest.exists():
            print(f"exists, kept: {dest}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f"{name}.yaml", dest)
        copied += 1
    print(f"copied {copied} config(s) to {args.copy}")
    return 0


def _add_configs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("configs", help="list the shipped configs, or copy them to edit")
    p.add_argument("names", nargs="*", help="config names, e.g. pretrain/smoke (default: all)")
    p.add_argument("--copy", metavar="DIR", help="copy them to DIR/<name>.yaml (kept if there)")
    p.set_defaults(func=cmd_configs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-vit", description="Masked patch prediction pretraining for ViTs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in JOBS:
        _add_job(sub, name)
    _add_configs(sub)
    _add_make_shards(sub)
    _add_make_synthetic(sub)
    _add_export(sub)
    _add_import(sub)
    _add_report(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ssl-vit` with `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in JOBS:  # the job parses its own arguments (and exits on errors)
        return run_pipeline(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (OSError, ValueError) as e:  # user errors: one line, no traceback
        print(f"ssl-vit {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ssl-vit {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `ssl-vit` console script: a job runs under `guard.run_and_exit`, which ends the process
    on every path in bounded time (an exception, a dead loader worker, a signal)."""
    argv = sys.argv[1:]
    if argv and argv[0] in JOBS:
        from ssl_vit.train.guard import run_and_exit

        run_and_exit(pipeline_module(argv[0]).main, argv[1:])
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
