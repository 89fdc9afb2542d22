r"""Pick the images worth labelling from a pool of unlabelled ones, by the pretrained encoder's
own features (TypiClust by default: Hacohen et al., ICML 2022; or k-center, or random).

    ssl-vit select --checkpoint runs/pretrain --source path/to/unlabelled --budget 200 \
        --output runs/pick
    accelerate launch --multi_gpu -m ssl_vit.pipelines.selection --checkpoint ... --source ...

The features are the few-shot probe's (the frozen encoder's pooled last output), read from any
source through predict's stream and streamed to features.npy in source order, whatever the
process and worker count; an unreadable image is a named, counted skip. The method sees the
images in an order of their content, so the picks depend on the images and the seed only.
The same --output with a larger --budget is the next round: earlier picks stay ranks 1..n,
and the last round's features are reused when read the same way from the same images.
(Not pipelines/select.py: that would shadow the standard library's `select` module in every
`python pipelines/<job>.py`, whose folder leads sys.path.)
config -> checks -> Accelerator -> output dir -> loader -> rounds (features) -> selection (main
process) -> selection.jsonl, to-label/ -> results. Exit status: 0 done, 1 failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from accelerate import Accelerator

from ssl_vit import jobs
from ssl_vit.cli import job_parser
from ssl_vit.config import ConfigError, SelectConfig, to_dict
from ssl_vit.config.checks import auto_num_workers
from ssl_vit.config.flags import given_flags, load_flagged
from ssl_vit.config.frozen import freeze, validated
from ssl_vit.data.image_source import ImageSource
from ssl_vit.data.predict_stream import open_predict_source, predict_loader
from ssl_vit.eval.readouts import Extraction
from ssl_vit.eval.select_features import (
    FeatureTable,
    FeatureWriter,
    choose,
    embed_rounds,
    encoder_digest,
    reused_table,
)
from ssl_vit.eval.select_output import (
    FEATURES,
    TO_LABEL,
    check_output,
    claim_output_on_main,
    copy_picks,
    selection_rows,
    source_names,
    write_selection,
)
from ssl_vit.train.guard import one_line_errors, run_and_exit
from ssl_vit.train.metrics import MetricsWriter
from ssl_vit.train.preflight import FrozenEncoder, check_not_a_run, load_frozen_encoder
from ssl_vit.train.runtime import make_accelerator, resolve_mixed_precision, setup_logging

log = logging.getLogger("select")
FLAGS = {  # command-line flag -> config key
    "checkpoint": "checkpoint",
    "source": "source",
    "budget": "budget",
    "output": "output_dir",
    "method": "method",
    "seed": "seed",
    "batch_size": "batch_size",
    "workers": "num_workers",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = job_parser(jobs.SELECT, __doc__)
    p.add_argument("--checkpoint", help="pretraining run directory or checkpoint (its encoder)")
    p.add_argument("--source", help="the unlabelled images: folder, shards, HF dataset")
    p.add_argument("--budget", type=int, help="images to pick in all (earlier rounds' included)")
    p.add_argument("--output", help="directory for selection.jsonl, to-label/, results.json")
    p.add_argument("--method", choices=["typiclust", "kcenter", "random"], help="(typiclust)")
    p.add_argument("--seed", type=int, help="seed of the selection (0)")
    p.add_argument("--no-copy", action="store_true", help="no copies of the picks in to-label/")
    p.add_argument("--batch-size", type=int, help="images per forward pass per process (256)")
    p.add_argument("--workers", type=int, help="loader workers per process (-1: auto)")
    p.add_argument("--config", help="YAML config (the keys of SelectConfig)")
    p.add_argument("--overwrite", action="store_true", help="start over (never your labels)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_intermixed_args(argv)


def check(
    cfg: SelectConfig, overwrite: bool
) -> tuple[SelectConfig, FrozenEncoder, ImageSource, list[dict], list[str]]:
    """Everything before any image is read: the encoder (loaded), the source, the output and
    its earlier picks. -> (config resolved, the `FrozenEncoder`, source, earlier rows, the
    source's image names when there are earlier rows: a next round's, else [])"""
    frozen = load_frozen_encoder("--checkpoint", cfg.checkpoint, cfg.image_size)
    check_not_a_run("--source", cfg.source)
    try:
        source = open_predict_source(cfg.source, ignore_labels=True)  # every image: a pool
        n = len(source)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--source {cfg.source}: {e}") from None
    if cfg.budget > n:
        raise ConfigError(f"--budget {cfg.budget}: more than the {n} images of --source")
    reads = {"--checkpoint": frozen.checkpoint, "--source": cfg.source}
    earlier = check_output(Path(cfg.output_dir), overwrite, reads)
    if len(earlier) >= cfg.budget:
        raise ConfigError(
            f"--output {cfg.output_dir}: holds {len(earlier)} picks already; --budget counts "
            "all picks: a larger one adds picks, --overwrite starts over"
        )
    names = source_names(source) if earlier else []  # (a shard source reads its tar headers)
    missing = set(r["key"] for r in earlier) - set(names)
    if missing:
        raise ConfigError(f"--source {cfg.source}: has no image {sorted(missing)[0]!r} of the "
                          "earlier picks; select from their source, or --overwrite")  # fmt: skip
    resolved = dataclasses.replace(cfg, checkpoint=frozen.checkpoint, image_size=frozen.image_size)
    return freeze(validated(resolved)), frozen, source, earlier, names


def feature_meta(cfg: SelectConfig, frozen: FrozenEncoder, dim: int) -> dict:
    """What features are read with, which a later round must match to reuse them."""
    return {"encoder": encoder_digest(frozen.encoder), "source": cfg.source, "pool": cfg.pool,
            "image_size": cfg.image_size, "batch_size": cfg.batch_size, "dim": dim,
            "precision": str(resolve_mixed_precision(cfg.mixed_precision))}  # fmt: skip


def earlier_features(
    acc: Accelerator, path: Path, meta: dict | None, names: list[str]
) -> tuple[FeatureTable | None, bool]:
    """(the main process's table, whether every process skips the pass): an earlier round's
    features at `path` when they were read as `meta` says from images of these `names`."""
    table = reused_table(path, meta, names) if names and acc.is_main_process else None
    reused = table is not None
    if acc.num_processes > 1:  # the main process decides: the others may not see its files
        from accelerate.utils import broadcast_object_list

        reused = broadcast_object_list([reused])[0]
    if reused:
        log.info("features of the earlier round reused (the same encoder, source and readout)")
    return table, reused


def feature_pass(
    cfg: SelectConfig, frozen: FrozenEncoder, source: ImageSource, workers: int,
    acc: Accelerator, path: Path, meta: dict | None,
) -> FeatureTable | None:  # fmt: skip
    """Every image's features, streamed to `path` on the main process (None elsewhere) with
    `meta` (the main process's) in its index."""
    n = len(source)
    loader = predict_loader(
        cfg.source, n, cfg.batch_size, cfg.image_size,
        num_workers=workers, rank=acc.process_index, world_size=acc.num_processes,
    )  # fmt: skip
    log.info(
        "features of %d images of %s with %s (%d px, pool %s) on %d process(es) x %d workers",
        n, cfg.source, cfg.checkpoint, cfg.image_size, cfg.pool, acc.num_processes, workers,
    )  # fmt: skip
    how = Extraction(frozen.mean, frozen.std, acc.device,
                     precision=resolve_mixed_precision(cfg.mixed_precision))  # fmt: skip
    writer = FeatureWriter(path, n, meta["dim"], meta) if acc.is_main_process else None
    encoder = frozen.encoder.to(acc.device)
    return embed_rounds(encoder, loader, n, cfg.batch_size, cfg.pool, how, acc, writer)


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    flags = given_flags(args, FLAGS) | ({"--no-copy": ("copy", False)} if args.no_copy else {})
    setup_logging()  # the checks' warnings as every other line (the launcher's rank: INFO)
    with one_line_errors():
        cfg = load_flagged(SelectConfig, args.config, flags, args.overrides)
        cfg, frozen, source, earlier, names = check(cfg, args.overwrite)  # before any image
        acc = make_accelerator(cfg.mixed_precision, cfg.timeouts)
        setup_logging(acc.is_main_process)
        out = Path(cfg.output_dir)
        lock = claim_output_on_main(acc, out, cfg, args.overwrite)  # noqa: F841
    n, workers = len(source), auto_num_workers(cfg.num_workers)
    dim = frozen.encoder.width * (2 if cfg.pool == "cls+gap" else 1)
    meta = feature_meta(cfg, frozen, dim) if acc.is_main_process else None  # (it alone writes)
    t_loop = time.time()
    table, reused = earlier_features(acc, out / FEATURES, meta, names)
    if not reused:
        table = feature_pass(cfg, frozen, source, workers, acc, out / FEATURES, meta)
    if table is None:
        return {}  # not the main process: it chooses and writes alone
    t_choose = time.time()
    with one_line_errors():  # the budget against the readable images, the earlier picks
        keys = [r["key"] for r in earlier]
        *picked, picks = choose(table, cfg.method, cfg.budget, keys, cfg.seed)
    rows = selection_rows(table, source, earlier, picked, picks, method=cfg.method,
                          batch_size=cfg.batch_size, copy=cfg.copy)  # fmt: skip
    t_write = time.time()
    write_selection(out, rows)
    copied = copy_picks(source, out, rows) if cfg.copy else 0
    results = {
        "job": "select", "method": cfg.method, "budget": cfg.budget, "seed": cfg.seed,
        "earlier_picks": len(earlier), "new_picks": len(rows) - len(earlier),
        "round": rows[-1]["round"], "checkpoint": cfg.checkpoint, "source": cfg.source,
        "images": len(table.names), "skipped": len(table.skipped),
        "skipped_images": [{"key": key, "reason": why} for key, why in table.skipped],
        "feature_dim": dim, "pool": cfg.pool, "image_size": cfg.image_size, "copied": copied,
        "processes": acc.num_processes, "workers": workers, "features_reused": reused,
        "features_s": t_choose - t_loop,
        "images_per_s": None if reused else n / max(t_choose - t_loop, 1e-9),
        "selection_s": t_write - t_choose, "wall_time_s": time.time() - t_start,
    }  # fmt: skip
    write_results(out, cfg, results)
    return results


def write_results(out: Path, cfg: SelectConfig, results: dict) -> None:
    metrics = MetricsWriter(out, config=to_dict(cfg))
    metrics.log({k: v for k, v in results.items() if isinstance(v, (int, float))})
    metrics.write_results(results)  # results.json last: it says the job finished
    log.info(
        "picked %d images (%d new, %d skipped unreadable) into %s; label them: move each image "
        "of %s into a sub-folder named for its class, then fine-tune with data.train=%s and "
        "self-train with distill.unlabelled=%s",
        results["budget"], results["new_picks"], results["skipped"], out / "selection.jsonl",
        out / TO_LABEL, out / TO_LABEL, cfg.source,
    )  # fmt: skip


if __name__ == "__main__":
    run_and_exit(main)
