"""Process-level set-up shared by the jobs: the Accelerator, seeds, the run directory."""

from __future__ import annotations

import logging
import os
import random
import sys

import numpy as np
import torch
from accelerate import Accelerator

__all__ = ["resolve_mixed_precision", "make_accelerator", "seed_everything", "setup_logging"]


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
