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
from accelerate.utils import (
    DistributedType,
    InitProcessGroupKwargs,
    parse_flag_from_env,
    set_seed,
)

from ssl_vit import seeds
from ssl_vit.config import ConfigError
from ssl_vit.config.run import CollectiveTimeoutConfig
from ssl_vit.progress import LOG_LINE
from ssl_vit.runs.lock import RunLock, on_main
from ssl_vit.train.guard import StopRequest
from ssl_vit.train.plan import RunPlan, build_plan
from ssl_vit.train.rundir import claim_run_dir
from ssl_vit.watchdog import set_data_timeout

__all__ = [
    "RunContext",
    "StopRequest",
    "replica_checksum",
    "FSDP_REFUSED",
    "make_accelerator",
    "refuse_fsdp",
    "resolve_mixed_precision",
    "setup_logging",
    "start_run",
]


def resolve_mixed_precision(setting: str) -> str:
    """'auto' -> bf16 on a GPU with native bf16 (compute capability 8.0 and up: Ampere and
    newer), else full precision ('no'). Never emulated bf16 (V100, T4: `is_bf16_supported()`
    says yes there, and it is slower than fp32), and never fp16, whose loss scaling is a
    choice to make knowingly. Only this process's own GPU (LOCAL_RANK) is asked, and without
    allocating on it: no rank creates a context on another rank's device."""
    if setting == "fp16" and not torch.cuda.is_available():
        # Accelerate would run fp32 while config.yaml recorded fp16: refuse instead.
        raise ConfigError(
            "train.mixed_precision=fp16: needs a CUDA GPU (this machine has none); use 'auto', "
            "'no' or 'bf16'"
        )
    if setting != "auto":
        return setting
    if not torch.cuda.is_available():
        return "no"
    # The device this process will use (Accelerate's: LOCAL_RANK), before it is set; 0 where
    # each process sees one GPU (CUDA_VISIBLE_DEVICES per process).
    index = int(os.environ.get("LOCAL_RANK", "0"))
    index = index if index < torch.cuda.device_count() else 0
    return "bf16" if torch.cuda.get_device_capability(index) >= (8, 0) else "no"


FSDP_REFUSED = (
    "FSDP is not supported (accelerate launch with distributed_type: FSDP): launch with DDP, "
    "e.g. --config_file configs/accelerate/8gpu.yaml (DDP holds ViT-H on 80 GB GPUs)"
)


def refuse_fsdp(distributed_type: Any = None) -> None:
    """One error line for an FSDP launch (the env Accelerate's launcher sets, or the
    Accelerator's type): checkpoints, EMA and few-shot assume full replicas (DDP)."""
    if parse_flag_from_env("ACCELERATE_USE_FSDP") or distributed_type == DistributedType.FSDP:
        raise ConfigError(FSDP_REFUSED)


def make_accelerator(mixed_precision: str, timeouts: Any = None, tf32: bool = True) -> Accelerator:
    """The job's Accelerator; `timeouts` (the config's, None: the defaults): a batch waited for
    `data_s`, a collective `dist_s`, ends the job. `tf32` (`train.tf32`): TF32 matmuls and
    convolutions for the float32 work on a CUDA GPU (all of it with mixed_precision 'no');
    False: true fp32. Gradient accumulation is the run plan's (`start_run` sets it once the
    plan is made)."""
    timeouts = timeouts or CollectiveTimeoutConfig()
    set_data_timeout(timeouts.data_s)
    refuse_fsdp()
    # Launched as several processes on a machine without a GPU (`accelerate launch --multi_gpu`
    # on CPU): Accelerate only uses its gloo CPU backend when asked for the CPU explicitly;
    # otherwise every process would silently train alone.
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    acc = Accelerator(
        cpu=multi_process and not torch.cuda.is_available(),
        mixed_precision=resolve_mixed_precision(mixed_precision),
        # Every collective (gradient all-reduce, barrier, stop flag) fails after this long
        # instead of waiting forever for a rank that died.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeouts.dist_s))],
    )
    refuse_fsdp(acc.distributed_type)
    # Denormal floats (tiny gradients and Adam moments late in training) make CPU matmuls
    # up to 10x slower; flushing them to zero changes nothing measurable in training.
    torch.set_flush_denormal(True)
    if acc.device.type == "cuda":  # TF32 (Ampere and newer) for float32 matmuls and convolutions
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
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


def setup_logging(is_main: bool | None = None) -> None:
    """INFO on the main process, warnings only elsewhere, one line per record. `is_main` None:
    before the Accelerator (a job's checks, alike on every rank): the launcher's rank 0 says
    it all, the others only errors."""
    level = logging.INFO if is_main else logging.WARNING
    if is_main is None:
        level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.ERROR
    logging.basicConfig(
        level=level,
        **LOG_LINE,
        stream=sys.stderr,
        force=True,
    )


@dataclass
class RunContext:
    """What a training job's start-up decides: the Accelerator, the run plan (batch split,
    workers, precision) and where outputs go."""

    acc: Accelerator
    plan: RunPlan | None  # None: an evaluation-only job (no `train` section: few-shot)
    run_dir: Path
    ckpt_dir: Path
    lock: RunLock | None = None  # the run directory's lock (main process), held while alive


def start_run(
    cfg: Any,
    resume: bool = False,
    overwrite: bool = False,
    *,
    reads: dict[str, str] | None = None,
) -> RunContext:
    """Accelerator + logging + the run plan (`plan.build_plan`: the global batch's split,
    checked before anything is written) + run directory (locked, then config.yaml; see
    `rundir.claim_run_dir`; `reads`: paths it reads, never removed by --overwrite) + seeds.

    A config without a `train` section (the few-shot job: it evaluates, once) gets no plan,
    Accelerate's default Accelerator (a process that already ran a job with another precision,
    tests or notebooks, keeps its state) and `cfg.seed` as is (its random-init encoder)."""
    tc = getattr(cfg, "train", None)
    if tc is None:
        set_data_timeout(cfg.timeouts.data_s)
        acc = Accelerator()
    else:
        acc = make_accelerator(tc.mixed_precision, cfg.timeouts, tc.tf32)
    setup_logging(acc.is_main_process)
    warn_if_launcher_returns_early()
    plan = None
    if tc is not None:
        where = dict(rank=acc.process_index, device=str(acc.device))
        plan = build_plan(cfg, acc.num_processes, **where)
        # The plan's accumulation, never the config's nor Accelerate's own setting (its
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS would override a constructor argument): the
        # loop runs plan.grad_accum micro-steps, and the Accelerator syncs after that many.
        acc.gradient_accumulation_steps = plan.grad_accum
    run_dir = Path(cfg.output_dir)
    # Claimed by the main process; every process learns whether it could (none starts if not).
    lock = on_main(
        acc, lambda: claim_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite, reads=reads)
    )
    seed = cfg.seed if tc is None else seeds.process(cfg.seed, acc.process_index)
    set_seed(seed)  # Python, NumPy, torch (all devices)
    return RunContext(acc, plan, run_dir, run_dir / "checkpoints", lock)


def replica_checksum(model: torch.nn.Module, acc: Accelerator) -> list[float]:
    """Every rank's float64 sum of its parameters; raises if the replicas have diverged.

    Data-parallel replicas must stay bit-identical (same initial broadcast, same all-reduced
    gradients, same skipped steps); a difference means silent corruption of the run (FSDP,
    whose shards differ on purpose, is refused at start: `refuse_fsdp`)."""
    with torch.no_grad():
        total = sum(p.detach().double().sum() for p in model.parameters())
    sums = acc.gather(total.reshape(1).to(acc.device)).tolist()
    if len(set(sums)) > 1:
        raise RuntimeError(f"parameters differ across ranks (checksums {sums})")
    return sums
