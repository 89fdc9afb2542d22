"""Process-level set-up shared by the jobs: the Accelerator, seeds, the run directory."""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from signal import SIGINT, SIGTERM
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ssl_vit.config import ConfigError, save_config

__all__ = [
    "Run",
    "StopRequest",
    "replica_checksum",
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


class StopRequest:
    """SIGTERM / SIGINT (preemption, Ctrl-C) -> a flag; `agreed()` tells every rank at once.

    The handler only sets the flag: the loop finishes its step, then all ranks agree on the
    OR of their flags (one tiny all-reduce per step, on a CPU gloo group so the GPU stream is
    never synchronized), write a checkpoint and exit 0. A second signal exits at once.
    """

    def __init__(self, world_size: int) -> None:
        self.flag = 0
        self.group = None
        if world_size > 1:
            import torch.distributed as dist

            # Every rank creates the group at the same point (a collective).
            is_gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if is_gloo else dist.new_group(backend="gloo")
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (SIGTERM, SIGINT)}

    def close(self) -> None:
        """Restore the handlers that were there before (the job may run inside a bigger one)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.flag:
            raise SystemExit(f"second {signal.Signals(signum).name}: exiting without checkpoint")
        self.flag = 1
        logging.getLogger(__name__).warning(
            "%s received: stopping after this step (checkpoint, exit 0)",
            signal.Signals(signum).name,
        )

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (all ranks call this at the same step)."""
        if self.group is None:
            return bool(self.flag)
        import torch.distributed as dist

        flag = torch.tensor([self.flag], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def replica_checksum(model: torch.nn.Module, acc: Accelerator) -> list[float]:
    """Every rank's float64 sum of its parameters; raises if the replicas have diverged.

    Data-parallel replicas must stay bit-identical (same initial broadcast, same all-reduced
    gradients, same skipped steps); a difference means silent corruption of the run. Sharded
    models (FSDP) hold different shards on purpose and are not compared."""
    with torch.no_grad():
        total = sum(p.detach().double().sum() for p in model.parameters())
    sums = acc.gather(total.reshape(1).to(acc.device)).tolist()
    if acc.distributed_type.name != "FSDP" and len(set(sums)) > 1:
        raise RuntimeError(f"parameters differ across ranks (checksums {sums})")
    return sums
