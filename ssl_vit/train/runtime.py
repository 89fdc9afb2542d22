"""Process-level set-up shared by the jobs: the Accelerator, seeds, the run directory."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, set_seed

from ssl_vit import seeds
from ssl_vit.config import ConfigError
from ssl_vit.train.guard import StopRequest
from ssl_vit.train.rundir import RunLock, claim_run_dir
from ssl_vit.watchdog import set_data_timeout

__all__ = [
    "RunContext",
    "StopRequest",
    "replica_checksum",
    "make_accelerator",
    "resolve_mixed_precision",
    "setup_logging",
    "start_run",
]


def resolve_mixed_precision(setting: str) -> str:
    """'auto' -> bf16 on a GPU that supports it, else full precision ('no')."""
    if setting == "fp16" and not torch.cuda.is_available():
        # Accelerate would run fp32 while config.yaml recorded fp16: refuse instead.
        raise ConfigError(
            "train.mixed_precision=fp16: needs a CUDA GPU (this machine has none); use 'auto', "
            "'no' or 'bf16'"
        )
    if setting != "auto":
        return setting
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(
    mixed_precision: str, grad_accum: int = 1, dist_timeout_s: float = 1800.0
) -> Accelerator:
    # Launched as several processes on a machine without a GPU (`accelerate launch --multi_gpu`
    # on CPU): Accelerate only uses its gloo CPU backend when asked for the CPU explicitly;
    # otherwise every process would silently train alone.
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    acc = Accelerator(
        cpu=multi_process and not torch.cuda.is_available(),
        mixed_precision=resolve_mixed_precision(mixed_precision),
        gradient_accumulation_steps=grad_accum,
        # Every collective (gradient all-reduce, barrier, stop flag) fails after this long
        # instead of waiting forever for a rank that died.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=dist_timeout_s))],
    )
    # Denormal floats (tiny gradients and Adam moments late in training) make CPU matmuls
    # up to 10x slower; flushing them to zero changes nothing measurable in training.
    torch.set_flush_denormal(True)
    if acc.device.type == "cuda":
        # TF32 matmuls for any fp32 work left outside autocast (Ampere and newer).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return acc


def warn_if_launcher_returns_early() -> None:
    """`accelerate launch` with one process runs the job under a plain subprocess launcher
    that exits at once on SIGTERM / Ctrl-C, while the job is still writing its checkpoint;
    a script that goes on when the launcher returns would miss it. torchrun (several
    processes) and running the script directly both wait."""
    simple_launcher = "ACCELERATE_USE_CPU" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
    if simple_launcher and "LOCAL_RANK" not in os.environ:
        logging.getLogger(__name__).warning(
            "launched by `accelerate launch` with one process: on SIGTERM / Ctrl-C that launcher "
            "returns before the checkpoint is written. For one process run the script directly "
            "(`python pipelines/...` or `ssl-vit ...`): it returns only when the job has ended."
        )


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
class RunContext:
    """What a training job's start-up decides: the Accelerator, the per-process micro-batch,
    and where outputs go."""

    acc: Accelerator
    local_batch: int
    run_dir: Path
    ckpt_dir: Path
    lock: RunLock | None = None  # the run directory's lock (main process), held while alive


def start_run(cfg: Any, resume: bool = False, overwrite: bool = False) -> RunContext:
    """Accelerator + logging + global-batch split + run directory (locked, then config.yaml;
    see `rundir.claim_run_dir`) + seeds.

    `cfg.train.batch_size` is global: it must divide into processes x accumulation steps."""
    tc = cfg.train
    set_data_timeout(cfg.timeouts.data_s)
    acc = make_accelerator(tc.mixed_precision, tc.grad_accum, cfg.timeouts.dist_s)
    setup_logging(acc.is_main_process)
    warn_if_launcher_returns_early()
    per_step = acc.num_processes * tc.grad_accum
    if tc.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size: {tc.batch_size} is not divisible by processes x grad_accum "
            f"= {acc.num_processes} x {tc.grad_accum}"
        )
    run_dir = Path(cfg.output_dir)
    lock = _claim_on_main(acc, run_dir, cfg, resume, overwrite)
    set_seed(seeds.process(cfg.seed, acc.process_index))  # Python, NumPy, torch (all devices)
    return RunContext(acc, tc.batch_size // per_step, run_dir, run_dir / "checkpoints", lock)


def _claim_on_main(
    acc: Accelerator, run_dir: Path, cfg: Any, resume: bool, overwrite: bool
) -> RunLock | None:
    """The main process claims the run directory; every process learns whether it could
    (one broadcast: the others wait for it, so none trains when the main process refused)."""
    lock, error = None, None
    if acc.is_main_process:
        try:
            lock = claim_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
        except (ConfigError, OSError) as e:
            error = str(e)
    if acc.num_processes > 1:
        error = broadcast_object_list([error])[0]
    if error is not None:
        raise ConfigError(error if acc.is_main_process else f"main process: {error}")
    return lock


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
