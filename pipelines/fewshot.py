r"""Few-shot linear evaluation of a frozen encoder (the paper's metric, as big_vision computes it).

    python pipelines/fewshot.py --checkpoint runs/x/checkpoints/step_00002000 \
        --config configs/fewshot/cifar10.yaml [key=value ...]
    python pipelines/fewshot.py --checkpoint random ...   # a random-init encoder of model.*

config -> checks -> encoder -> features (once) -> closed-form solves for every shot/seed/l2
-> results. Exit status: 0 done, 1 failed; SIGTERM ends it at once (it has nothing to resume).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from typing import Any, NamedTuple

from ssl_vit import jobs
from ssl_vit.cli import job_parser
from ssl_vit.config import FewshotConfig, load_config, to_dict
from ssl_vit.config.flags import flag_overrides
from ssl_vit.config.frozen import freeze
from ssl_vit.eval.fewshot_job import fewshot_evaluate, log_fewshot
from ssl_vit.eval.readouts import format_layer_table
from ssl_vit.model import build_vit
from ssl_vit.train import preflight
from ssl_vit.train.guard import one_line_errors, run_and_exit
from ssl_vit.train.metrics import MetricsWriter
from ssl_vit.train.runtime import resolve_mixed_precision, setup_logging, start_run

log = logging.getLogger("fewshot")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = job_parser(jobs.FEWSHOT, __doc__)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory or encoder.safetensors, timm weights, a transformers ViT "
        "directory, or 'random'",
    )
    p.add_argument("--config", help="YAML config (see configs/fewshot/)")
    p.add_argument("--overwrite", action="store_true", help="replace results in output_dir")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_intermixed_args(argv)


class Checked(NamedTuple):
    """What `check` resolved before any compute."""

    cfg: FewshotConfig  # frozen; init.checkpoint resolved, the checkpoint's shape and pixels
    encoder: Any  # the loaded encoder, None for random init (built after the seed is set)
    reads: dict[str, str]  # what --overwrite never removes: the run being evaluated
    note: str | None  # the line to log about the checkpoint


def check(cfg: FewshotConfig, checkpoint: str) -> Checked:
    """Everything the job will touch, before any compute: both labelled sources, the
    checkpoint (loaded: the config's copy takes its shape and pixel normalisation), the output
    directory."""
    train_names = preflight.check_labelled_source("fewshot.train", cfg.fewshot.train)
    eval_names = preflight.check_labelled_source("fewshot.eval", cfg.fewshot.eval)
    preflight.check_same_labels(("fewshot.train", train_names), ("fewshot.eval", eval_names))
    preflight.warn_shared(
        ("fewshot.train", cfg.fewshot.train), ("fewshot.eval", cfg.fewshot.eval),
        "the accuracies count images the probe is fitted to",
    )  # fmt: skip
    encoder = note = None
    if checkpoint != "random":
        cfg, (encoder, _, _), note = preflight.init_from_checkpoint("--checkpoint", cfg, checkpoint)
    else:  # recorded as such in config.yaml
        init = dataclasses.replace(cfg.init, checkpoint="random")
        cfg = freeze(dataclasses.replace(cfg, init=init))
    preflight.check_writable("output_dir", cfg.output_dir)
    # --overwrite never removes the run (or checkpoint) being evaluated.
    reads = {"--checkpoint": cfg.init.checkpoint} if checkpoint != "random" else {}
    return Checked(cfg, encoder, reads, note)


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    setup_logging(True)
    with one_line_errors():
        # As init.checkpoint (an init.checkpoint= override must agree): a checkpoint's shape
        # and pixel normalisation are its own, a config file's serve random init only.
        init = "none" if args.checkpoint == "random" else args.checkpoint
        flags = {f"--checkpoint {args.checkpoint}": ("init.checkpoint", init)}
        overrides = flag_overrides(flags, args.overrides)
        job = check(load_config(FewshotConfig, args.config, overrides), args.checkpoint)
        cfg = job.cfg  # frozen and resolved: read from here on
        # The device as Accelerate picks it for the training jobs (no plan: nothing trains).
        run = start_run(cfg, overwrite=args.overwrite, reads=job.reads)
    if job.note:
        log.info(job.note)
    encoder = job.encoder if job.encoder is not None else build_vit(cfg.model)
    norm = dict(image_size=cfg.model.image_size, mean=cfg.data.mean, std=cfg.data.std)
    # The features' autocast as mixed_precision `auto` (bf16 on a GPU that has it).
    how = dict(
        device=run.acc.device, compile=cfg.compile, precision=resolve_mixed_precision("auto")
    )
    res = fewshot_evaluate(encoder.to(run.acc.device), cfg.fewshot, **norm, **how)
    res.update(checkpoint=cfg.init.checkpoint, image_size=cfg.model.image_size)
    res.update(wall_time_s=time.time() - t_start)
    # The summary (and k-NN) as metrics.jsonl rows at step 0, as the training jobs log them;
    # results.json last, as theirs.
    metrics = MetricsWriter(run.run_dir, log_with=cfg.trackers, config=to_dict(cfg))
    log_fewshot(metrics, 0, res)
    metrics.write_results(res)
    print(format_results(cfg, res))
    return res


def _mean_std(r: dict) -> str:
    """'52.00 +- 1.20%', or 'not measured' (NaN: no test image was scored)."""
    if r["mean"] is None or math.isnan(r["mean"]):
        return "not measured"
    return f"{100 * r['mean']:.2f} +- {100 * r['std']:.2f}%"


def format_results(cfg: FewshotConfig, res: dict) -> str:
    """The printed table: each shot's accuracy per l2, the layer table, the k-NN line."""
    lines = []
    for k in cfg.fewshot.shots:
        row = res["shots"][k]["l2_reg"]
        lines.append(
            f"{k:>3}-shot: " + ", ".join(f"l2={l2}: {_mean_std(r)}" for l2, r in row.items())
        )
    if "layers" in res:
        lines.append(format_layer_table(res["layers"]))
    if "knn" in res:
        lines.append(f"k-NN (k={cfg.fewshot.knn_k}, {res['knn']['num_train']} train images): "
                     f"{100 * res['knn']['top1']:.2f}%")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    run_and_exit(main)
