"""The GPU suite's pipeline rows (`gpu_suite`): pipelines/pretrain.py run as a user runs it, on
one GPU or as a DDP job on every GPU, its images/s read back from its metrics.jsonl; `suite`:
a `gpu_suite.Suite` (typed Any: that module imports this one)."""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ssl_vit.atomic import read_jsonl
from ssl_vit.bench.timing import MODEL_KEYS
from ssl_vit.children import die_with_parent

__all__ = ["DDP_PIPELINE", "ddp_pipeline_row", "pipeline_row", "run_pretrain"]


def pipeline_row(suite: Any, compile: bool, processes: int = 1) -> dict:
    """pipelines/pretrain.py with data.augment=device and compile.enabled=`compile`, then the
    suite's overrides (e.g. compile.mode=reduce-overhead). `processes` > 1: launched as a
    multi-GPU job is (`accelerate launch --multi_gpu`: DDP, whose wrapped module is what is
    compiled), the shape's batch per process; img_per_s is then the global rate."""
    if suite.pipeline is None:
        raise ValueError("no pipelines/pretrain.py given")
    _, shape = suite.small_shape()
    steps, every = (4, 2) if suite.tiny else (300, 100)
    out = suite.tmp / f"pipeline_run_{'compiled' if compile else 'eager'}_{processes}"
    model = [f"model.{k}={shape[k]}" for k in MODEL_KEYS]
    global_batch = shape["batch"] * processes  # weak scaling: the shape's batch per process
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "accelerate.commands.launch", "--multi_gpu", "--dynamo_backend", "no"]
        launch += ["--num_processes", str(processes)]
    cmd = [
        *(*launch, str(suite.pipeline), f"data.train_shards={suite.shards}"),
        *(f"output_dir={out}", *model, f"train.batch_size={global_batch}"),
        *(f"train.steps={steps}", f"train.log_every={every}", "train.warmup_steps=2"),
        *("train.checkpoint_every=0", "data.augment=device"),
        "compile.enabled=" + ("true" if compile else "false"),
        *(["data.num_workers=0"] if suite.tiny else []),
        *suite.overrides,
    ]
    root = suite.pipeline.resolve().parent.parent  # the pipeline imports ssl_vit from there
    img_per_s, laps = run_pretrain(cmd, root, out, timeout=max(suite.left_s() - 5, 1))
    return {
        "img_per_s": img_per_s,
        "img_per_s_laps": [r["img_per_s"] for r in laps],
        "data_wait": [r.get("data_wait") for r in laps],
        "batch": global_batch,
        "processes": processes,
        "steps": steps,
        "overrides": suite.overrides,
    }


def run_pretrain(
    cmd: list[str], root: str | Path, out: Path, timeout: float
) -> tuple[float, list[dict]]:
    """Run the pretraining command `cmd` (it imports ssl_vit from `root`, logs into `out`); it
    dies with this process. -> (the median images/s of its laps after the first, or of its one
    lap; its laps: the metrics.jsonl rows with img_per_s). RuntimeError if it fails."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    run = dict(capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    proc = subprocess.run(cmd, **run, preexec_fn=die_with_parent())  # it dies with this process
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain.py exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    laps = [r for r in read_jsonl(out / "metrics.jsonl") if "img_per_s" in r]
    steady = [r["img_per_s"] for r in laps[1:]] or [r["img_per_s"] for r in laps]
    return statistics.median(steady), laps


DDP_PIPELINE = "pipelines/pretrain.py compiled, every GPU (DDP)"


def ddp_pipeline_row(suite: Any) -> None:
    """The compiled pipeline as a multi-GPU job runs it: one process per GPU (2 or more)."""
    gpus = torch.cuda.device_count() if suite.cuda else 0
    if suite.cuda and gpus < 2 and (suite.sections is None or "pipeline" in suite.sections):
        suite.rows.append({"section": "pipeline", "name": DDP_PIPELINE, "status": "skipped: 1 GPU"})
        return
    run = functools.partial(pipeline_row, suite, True, processes=gpus)
    suite.row("pipeline", DDP_PIPELINE, 150, run, cuda_only=True)
