"""Few-shot linear evaluation of a frozen encoder (the paper's metric, as big_vision computes it).

    python pipelines/fewshot.py --checkpoint runs/x/checkpoints/step_00002000 \
        --config configs/fewshot/cifar10.yaml [key=value ...]
    python pipelines/fewshot.py --checkpoint random ...   # a random-init encoder of model.*

config -> checks -> encoder -> features (once) -> closed-form solves for every shot/seed/l2
-> results. Exit status: 0 done, 1 failed; SIGTERM ends it at once (it has nothing to resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import set_seed

from ssl_vit.atomic import write_text
from ssl_vit.config import FewshotConfig, load_config, to_dict
from ssl_vit.eval.fewshot_job import fewshot_evaluate
from ssl_vit.eval.readouts import format_layer_table
from ssl_vit.model import build_vit
from ssl_vit.train import preflight
from ssl_vit.train.guard import one_line_errors, run_and_exit
from ssl_vit.train.metrics import MetricsWriter
from ssl_vit.train.rundir import claim_run_dir
from ssl_vit.train.runtime import resolve_mixed_precision, setup_logging
from ssl_vit.watchdog import set_data_timeout

log = logging.getLogger("fewshot")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    args = parse_args(argv)
    setup_logging(True)
    with one_line_errors():
        # As init.checkpoint (after the overrides: the flag wins): a checkpoint's shape and
        # pixel normalisation are its own, a config file's serve random init only.
        init = "none" if args.checkpoint == "random" else args.checkpoint
        overrides = [*args.overrides, f"init.checkpoint={json.dumps(init)}"]  # quoted YAML
        cfg = load_config(FewshotConfig, args.config, overrides)
        train_names = preflight.check_labelled_source("fewshot.train", cfg.fewshot.train)
        eval_names = preflight.check_labelled_source("fewshot.eval", cfg.fewshot.eval)
        preflight.check_same_labels(("fewshot.train", train_names), ("fewshot.eval", eval_names))
        set_seed(cfg.seed)
        if args.checkpoint == "random":
            encoder = build_vit(cfg.model)
        else:
            args.checkpoint, (encoder, cfg.model, _) = preflight.load_init_encoder(
                "--checkpoint", args.checkpoint, cfg.model, cfg.init.pos_interp, cfg.init.format
            )
        cfg.init.checkpoint = args.checkpoint  # recorded in config.yaml (resolved)
        if args.checkpoint != "random":
            pixels_from = preflight.resolve_pixel_norm(cfg.data, args.checkpoint)
            log.info(preflight.checkpoint_note("--checkpoint", cfg, pixels_from))
        preflight.check_writable("output_dir", cfg.output_dir)
        run_dir = Path(cfg.output_dir)
        # --overwrite never removes the run (or checkpoint) being evaluated.
        reads = {"--checkpoint": args.checkpoint} if args.checkpoint != "random" else {}
        lock = claim_run_dir(  # noqa: F841 (held)
            run_dir, cfg, overwrite=args.overwrite, reads=reads
        )
    set_data_timeout(cfg.timeouts.data_s)
    # The device as Accelerate picks it for the training jobs; the features' autocast as their
    # mixed_precision `auto` (bf16 on a GPU that has it). Not passed to Accelerator: a process
    # that already ran a job with another precision (tests, notebooks) keeps its state.
    acc = Accelerator()
    metrics = MetricsWriter(run_dir, log_with=cfg.trackers, config=to_dict(cfg))
    norm = dict(image_size=cfg.model.image_size, mean=cfg.data.mean, std=cfg.data.std)
    res = fewshot_evaluate(
        encoder.to(acc.device), cfg.fewshot, **norm, device=acc.device, compile=cfg.compile,
        precision=resolve_mixed_precision("auto"),
    )  # fmt: skip
    res.update(
        checkpoint=args.checkpoint,
        image_size=cfg.model.image_size,
        wall_time_s=time.time() - t_start,
    )
    write_text(run_dir / "results.json", json.dumps(res, indent=2, default=str) + "\n")
    metrics.log({"step": 0, **{f"fewshot/{k}": v for k, v in res["summary"].items()}})
    if "knn" in res:
        metrics.log({"step": 0, "knn/top1": res["knn"]["top1"]})
    metrics.close()
    for k in cfg.fewshot.shots:
        row = res["shots"][k]["l2_reg"]
        print(
            f"{k:>3}-shot: "
            + ", ".join(
                f"l2={l2}: {100 * r['mean']:.2f} +- {100 * r['std']:.2f}%" for l2, r in row.items()
            )
        )
    if "layers" in res:
        print(format_layer_table(res["layers"]))
    if "knn" in res:
        print(f"k-NN (k={cfg.fewshot.knn_k}, {res['knn']['num_train']} train images): "
              f"{100 * res['knn']['top1']:.2f}%")  # fmt: skip
    return res


if __name__ == "__main__":
    run_and_exit(main)
