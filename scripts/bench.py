"""Pretraining performance, measured side by side in one process (issue 5).

    python scripts/bench.py [--device cpu|cuda] [--model small,base] [--json OUT] [--quick]
    python scripts/bench.py --suite gpu --out FILE.json [--markdown]  # the GPU table, <= 8 min
    python scripts/bench.py --suite gpu --tiny --out FILE.json         # the same, tiny, on CPU
    python scripts/bench.py --suite gpu --sections peak,objectives --batch-size 32  # a section

Per model shape (the first is the default shape, whose figures are also the JSON's top level):
  1. training images/s of our step (corruption, targets, forward, loss on corrupted patches,
     backward, clipping, AdamW) vs a timm VisionTransformer of identical shape doing the same
     masked-prediction step: like-for-like (same precision, same optimizer construction) and
     our defaults vs timm's defaults (fp32 eager, timm's AdamW);
  2. utilization: counted model FLOPs of our step / its time / a measured square-matmul peak
     of the same dtype;
  3. loader images/s (decode + augment + collate) of our WebDataset pipeline vs torchvision
     ImageFolder + DataLoader with the same transforms on the same images, with 1 worker and
     with the default worker count; loader / training consumption;
  4. corruption + targets as a fraction of the step time;
  5. peak RSS while streaming 1x and 4x as many shards, peak accelerator memory on GPU.
Every timing is a median over repeated calls after warm-up; contenders run in alternating
rounds (A B C, C B A, ...) so that noise from other processes hits them alike.

--suite loader: data at ImageNet size (ssl_vit.bench.loader_suite): on ImageNet-like photos,
make-shards with 1 vs 2 workers, our loader vs torchvision ImageFolder + RandomResizedCrop
+ flip with 1 worker each, and pipelines/pretrain.py with a tiny model and 1 worker, on the
images as given and stored with --max-size:

    python scripts/bench.py --suite loader --json loader.json --markdown

--suite predict: `ssl-vit predict` vs a timm model + torchvision ImageFolder DataLoader with
timm's eval transform, same images, shape, batch and workers (ssl_vit.bench.predict_suite):

    python scripts/bench.py --suite predict --json predict.json --markdown

--suite gpu: the GPU table (ssl_vit.bench.gpu_suite): bf16 matmul peak, ours vs timm eager /
compiled / reduce-overhead as % of it, host syncs of the step, loader img/s with device
augmentation, the real pipeline's img/s; each section guarded, all under --budget-s.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ssl_vit.bench.gpu_suite import SECTIONS
from ssl_vit.bench.loaders import (
    imagefolder_loader,
    interleaved_rates,
    make_synthetic_data,
    ours_loader,
    streaming_peak_rss,
)
from ssl_vit.bench.timing import PeakRSS
from ssl_vit.bench.train_suite import SHAPES, bf16_supported, training_figures
from ssl_vit.bench.train_table import print_table
from ssl_vit.config.checks import auto_num_workers
from ssl_vit.data import resolve_shards
from ssl_vit.train.runtime import resolve_mixed_precision

# Where docs/results.md's data steps put CIFAR-10 (relative to the repo root): the shards made by
# `ssl-vit make-shards` and the PNG folder they were made from.
ROOT = Path(__file__).resolve().parent.parent
CIFAR_SHARDS = str(ROOT / "data/cifar10-train")
CIFAR_FOLDER = str(ROOT / "../shared/data/cifar10/train")
KEYS = (
    "ratio_vs_timm_same_precision",
    "ratio_vs_timm_defaults",
    "utilization",
    "loader_vs_imagefolder",
    "loader_vs_training",
    "overhead_fraction",
    "rss_mb_1x",
    "rss_mb_4x",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="small,base", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--quick", action="store_true", help="fewer repeats and images (~2 min)")
    p.add_argument("--shards", help=f"shard dir/pattern (default {CIFAR_SHARDS} if present)")
    p.add_argument("--image-folder", help=f"same images as a folder (default {CIFAR_FOLDER})")
    p.add_argument("--synthetic", action="store_true", help="synthetic images, not CIFAR-10")
    p.add_argument("--batch-size", type=int, help="training batch for every shape")
    p.add_argument("--rounds", type=int, help="alternating timing rounds (default 7, quick 3)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    p.add_argument("--workers", type=int, default=auto_num_workers(-1), help="default: auto")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--compile", action="store_true", help="torch.compile both models (LFL)")
    p.add_argument("--no-loader", action="store_true", help="skip the data-loading figures")
    g = p.add_argument_group("--suite gpu")
    g.add_argument("--suite", choices=["pretrain", "gpu", "loader", "predict"], default="pretrain")
    g.add_argument("--out", help="write the suite's JSON here (--json works too)")
    g.add_argument("--tiny", action="store_true", help="a tiny model: the suite in seconds on CPU")
    g.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    g.add_argument(
        "--budget-s", type=float, default=480.0, help="total time budget (default 8 min)"
    )
    g.add_argument("--data", help="shards for the loader and pipeline rows (default: synthetic)")
    g.add_argument(
        "--sections",
        help=f"comma list: run only these sections ({','.join(SECTIONS)})",
    )
    g.add_argument(
        "--objectives",
        default=str(ROOT / "configs/study/classifier.yaml"),
        help="a study config whose variants' objectives the objectives section compares",
    )
    g.add_argument(
        "--pipeline-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra pipelines/pretrain.py override, repeatable (e.g. compile.enabled=true)",
    )
    lg = p.add_argument_group("--suite loader")
    lg.add_argument("--photos", help="an image folder of photos (default: make ImageNet-like ones)")
    lg.add_argument("--num-images", type=int, help="photos to make (default 2000, quick 200)")
    lg.add_argument("--max-size", type=int, default=256, help="make-shards --max-size compared")
    lg.add_argument("--image-size", type=int, default=224, help="training crop of the loaders")
    lg.add_argument("--pipeline-steps", type=int, help="tiny-model pretrain steps (default 40)")
    pg = p.add_argument_group("--suite predict (also --photos, --num-images, --image-size)")
    pg.add_argument("--variant", default="Ti/16", help="the classifier's ViT variant")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.models = args.model.split(",")
    if args.sections and (unknown := set(args.sections.split(",")) - set(SECTIONS)):
        p.error(f"unknown section(s) {sorted(unknown)}; choose from {sorted(SECTIONS)}")
    if unknown := [m for m in args.models if m not in SHAPES]:
        p.error(f"unknown model shape(s) {unknown}; choose from {sorted(SHAPES)}")
    return args


def machine(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "bf16": bf16_supported(device),
    }
    try:
        import timm

        info["timm"] = timm.__version__
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def loader_figures(name: str, args, shards: str, folder: str, train_ips: float) -> dict:
    s = SHAPES[name]
    batch, size = args.batch_size or s["batch"], s["image_size"]
    urls, w = resolve_shards(shards), args.workers
    loaders = {
        "ours_1": ours_loader(urls, batch, size, 1),
        "imagefolder_1": imagefolder_loader(folder, batch, size, 1),
    }
    if w > 1:
        loaders[f"ours_{w}"] = ours_loader(urls, batch, size, w)
        loaders[f"imagefolder_{w}"] = imagefolder_loader(folder, batch, size, w)
    # ~1-2 s per timed stretch on one CPU worker: fewer images at 224 px, where each costs more.
    n_images = max((512 if args.quick else 2048) * (32 / size) ** 2, 256, 8 * batch)
    rates = interleaved_rates(loaders, int(n_images), args.rounds)
    del loaders
    gc.collect()
    med = {k: statistics.median(v) for k, v in rates.items()}
    k = max(w, 1)
    return {
        "loader_images_per_s": med,
        "loader_workers": w,
        "loader_vs_imagefolder": med["ours_1"] / med["imagefolder_1"],
        "loader_vs_imagefolder_all_workers": med[f"ours_{k}"] / med[f"imagefolder_{k}"],
        "loader_vs_training": med[f"ours_{k}"] / train_ips,
    }


def rss_figures(name: str, args, shards: str) -> dict:
    s = SHAPES[name]
    # 1x = 2 shards' worth (1 with --quick or above 64 px, where each image costs more).
    batch, n = args.batch_size or s["batch"], 1 if args.quick or s["image_size"] > 64 else 2
    # The benchmark process itself holds what the training figures left (model, optimizer,
    # allocator caches): measured first, so the streaming cost reads as the difference.
    before = PeakRSS().sample_mb()
    one = streaming_peak_rss(shards, n, batch, s["image_size"], args.workers)
    four = streaming_peak_rss(shards, 4 * n, batch, s["image_size"], args.workers)
    return {"rss_mb_before": before, "rss_mb_1x": one, "rss_mb_4x": four, "rss_shards_1x": n}


def find_data(args, tmp: Path) -> tuple[str, str, str]:
    """(shards, image folder, description): the given paths, else CIFAR-10 where this project
    keeps it, else (or with --synthetic) a small synthetic set written to `tmp`, the same
    images in both forms."""
    if not args.synthetic:
        shards = args.shards or (CIFAR_SHARDS if Path(CIFAR_SHARDS).is_dir() else None)
        folder = args.image_folder or (CIFAR_FOLDER if Path(CIFAR_FOLDER).is_dir() else None)
        if shards and folder:
            try:
                resolve_shards(shards)
            except FileNotFoundError as e:
                sys.exit(f"error: --shards: {e}")
            if not Path(folder).is_dir():
                sys.exit(f"error: --image-folder: {folder} is not a directory")
            return shards, folder, f"shards {shards} vs image folder {folder}"
        if args.shards or args.image_folder:
            sys.exit("error: give both --shards and --image-folder (the same images, two forms)")
    s, f = make_synthetic_data(tmp, n=400 if args.quick else 4000)
    return str(s), str(f), "synthetic shapes, 32 px PNG (same images as shards and folder)"


def gpu_suite(args, device: torch.device) -> dict:
    """--suite gpu: every row of the GPU table (skipped rows say why), JSON and a table."""
    from ssl_vit.bench.gpu_suite import Suite, markdown_table, run_suite
    from ssl_vit.config import load_config
    from ssl_vit.config.study import StudyConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    variants = load_config(StudyConfig, args.objectives).variants
    suite = Suite(
        device,
        size="tiny" if args.tiny else "full",
        budget_s=args.budget_s,
        data=args.data,
        pipeline=ROOT / "pipelines/pretrain.py",
        overrides=args.pipeline_override,
        objectives={v.name: v.objective for v in variants},
        sections=frozenset(args.sections.split(",")) if args.sections else None,
        batch=args.batch_size,
    )
    result = run_suite(suite)
    return _write_and_print(args, result, markdown_table, result["rows"])


def _write_and_print(args, result: dict, markdown, shown) -> dict:
    """A suite's `result` as JSON to --out (or --json); printed: `markdown(result)` with
    --markdown, else `shown` (the part of it to show) as JSON."""
    out = args.out or args.json
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    print(markdown(result) if args.markdown else json.dumps(shown, indent=1))
    return result


def loader_suite(args) -> dict:
    """--suite loader: ssl_vit.bench.loader_suite's figures, JSON and a Markdown table."""
    from ssl_vit.bench.loader_suite import loader_suite as run
    from ssl_vit.bench.loader_suite import markdown

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(
            Path(tmp),
            num_images=args.num_images or (200 if args.quick else 2000),
            image_size=args.image_size,
            max_size=args.max_size,
            batch_size=args.batch_size or 32,
            rounds=args.rounds,
            images_per_round=128 if args.quick else 640,
            photos=args.photos,
            pipeline_steps=args.pipeline_steps or (8 if args.quick else 40),
        )
    result["machine"] = machine(torch.device("cpu"))
    return _write_and_print(args, result, markdown, result)


def predict_suite(args) -> dict:
    """--suite predict: ssl_vit.bench.predict_suite's figures, JSON and a Markdown table."""
    from ssl_vit.bench.predict_suite import markdown
    from ssl_vit.bench.predict_suite import predict_suite as run

    with tempfile.TemporaryDirectory() as tmp:
        result = run(
            Path(tmp),
            photos=args.photos,
            num_images=args.num_images or (200 if args.quick else 1000),
            image_size=args.image_size,
            variant=args.variant,
            batch_size=args.batch_size or 64,
            workers=args.workers,
            rounds=args.rounds,
        )
    result["machine"] = machine(torch.device(result["device"]))
    return _write_and_print(args, result, markdown, result)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as pipelines do (ssl_vit.train.runtime)
    if args.suite == "gpu":
        return gpu_suite(args, device)
    if args.suite == "loader":
        return loader_suite(args)
    if args.suite == "predict":  # not a job: the suite timing `ssl-vit predict`
        return predict_suite(args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # Our default, train.mixed_precision=auto: bf16 on a GPU that has it, fp32 on CPU (there bf16
    # is opt-in: its loss curve ends ~0.5% above fp32's, see docs/performance.md).
    default_precision = resolve_mixed_precision("auto") if device.type == "cuda" else "no"
    shapes: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        shards, folder, data_note = find_data(args, Path(tmp))
        for name in args.models:
            print(f"[bench] {name}: training steps ...", file=sys.stderr, flush=True)
            fig = training_figures(name, args, device, default_precision)
            if not args.no_loader:
                print(f"[bench] {name}: loaders ...", file=sys.stderr, flush=True)
                train_ips = fig["images_per_s"][f"ours_{default_precision}"]
                fig |= loader_figures(name, args, shards, folder, train_ips)
                fig |= rss_figures(name, args, shards)
            shapes.append(fig)
            result = assemble(args, device, shapes, data_note)
            if args.json:  # after every shape: a long run that is cut short keeps its figures
                Path(args.json).write_text(json.dumps(result, indent=1))
    print_table(result)
    if args.json:
        print(f"wrote {args.json}")
    return result


def assemble(args, device: torch.device, shapes: list[dict], data_note: str) -> dict:
    """The JSON: the default (first) shape's figures at the top level, then every shape."""
    return {
        "device": str(device),
        "default_model": shapes[0]["model"],
        **{k: shapes[0].get(k) for k in KEYS},
        "shapes": shapes,
        "machine": machine(device),
        "data": data_note,
        "compile": args.compile,  # True: "ours" and "timm" (not timm's defaults) are compiled
        "timing": (
            f"medians of {args.rounds} alternating rounds x {args.steps} steps after "
            f"{args.warmup} warm-up steps; contenders interleaved (ABC, CBA, ...)"
        ),
    }


if __name__ == "__main__":
    main()
