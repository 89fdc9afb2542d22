"""Process-level set-up shared by the jobs: the Accelerator, seeds, the run directory."""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ssl_vit.config import ConfigError, save_config

__all__ = [
    "Run",
    "make_accelerator",
    "resolve_mixed_precision",
    "seed_everything",
    "setup_logging",
    "start_run",
]


def resolve_mixed_precision(setting: str) -> str:
    """'auto' -> bf16 on a GPU that supports it, else full precision ('no')."""
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(mixed_precision: str, grad_accum: int = 1) -> Accelerator:
    # Launched as several processes on a machine without a GPU (`accelerate launch --multi_gpu`
    # on CPU): Accelerate only uses its gloo CPU backend when asked for the CPU explicitly;
    # otherwise every process would silently train alone.
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    acc = Accelerator(
        cpu=multi_process and not torch.cuda.is_available(),
        mixed_precision=resolve_mixed_precision(mixed_precision),
        gradient_accumulation_steps=grad_accum,
    )
    # Denormal floats (tiny gradients and Adam moments late in training) make CPU matmuls
    # up to 10x slower; flushing them to zero changes nothing measurable in training.
    torch.set_flush_denormal(True)
    if acc.device.type == "cuda":
        # TF32 matmuls for any fp32 work left outside autocast (Ampere and newer).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return acc


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_logging(is_main: bool) -> None:
    """INFO on the main process, warnings only elsewhere, one line per record."""
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


@dataclass
class Run:
    """What a training job's start-up decides: the Accelerator, the per-process micro-batch,
    and where outputs go."""

    acc: Accelerator
    local_batch: int
    run_dir: Path
    ckpt_dir: Path


def start_run(cfg: Any) -> Run:
    """Accelerator + logging + global-batch split + run directory (config.yaml) + seeds.

    `cfg.train.batch_size` is global: it must divide into processes x accumulation steps."""
    tc = cfg.train
    acc = make_accelerator(tc.mixed_precision, tc.grad_accum)
    setup_logging(acc.is_main_process)
    per_step = acc.num_processes * tc.grad_accum
    if tc.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size: {tc.batch_size} is not divisible by processes x grad_accum "
            f"= {acc.num_processes} x {tc.grad_accum}"
        )
    run_dir = Path(cfg.output_dir)
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    seed_everything(cfg.seed + acc.process_index)
    return Run(acc, tc.batch_size // per_step, run_dir, run_dir / "checkpoints")
