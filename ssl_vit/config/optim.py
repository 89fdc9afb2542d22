"""The `train` section: the optimization and the loop's schedule (pretraining: Adam; fine-tuning
adds SGD's momentum and its own defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ssl_vit.config.checks import check_fraction, check_min, check_positive
from ssl_vit.config.frozen import Frozen
from ssl_vit.errors import ConfigError

__all__ = ["FinetuneOptimConfig", "MixedPrecision", "OptimConfig"]

MixedPrecision = Literal["auto", "no", "bf16", "fp16"]


@dataclass
class OptimConfig(Frozen):
    """The optimization and the loop's schedule. `batch_size` is GLOBAL (all processes x
    accumulation steps). Pretraining uses Adam (`betas`)."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 256  # global: split over processes and grad_accum micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step (gradients summed)
    lr: float = 2e-4  # peak learning rate (paper: 2e-4 at batch 4096; scale it linearly)
    warmup_steps: int = 100  # linear warm-up, then cosine decay to min_lr
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # Adam / AdamW
    grad_clip: float = 1.0  # global norm; 0 disables
    mixed_precision: MixedPrecision = "auto"
    # TF32 for the float32 matmuls / convolutions on a CUDA GPU (Ampere+; all of them with
    # mixed_precision 'no'). false: true fp32. No effect on the CPU.
    tf32: bool = True
    # Steps with a non-finite gradient norm are skipped; this many in a row stop the job.
    max_bad_steps: int = 10
    log_every: int = 50  # steps between metrics rows
    checkpoint_every: int = 500  # steps between checkpoints (0: only the final one)
    keep_checkpoints: int = 3  # the newest N checkpoints are kept

    def validate(self) -> None:
        check_min("train.", self, ("steps", "batch_size", "grad_accum", "log_every"), 1)
        check_min("train.", self, ("max_bad_steps",), 1)
        check_min("train.", self, ("warmup_steps", "checkpoint_every"), 0)
        check_min("train.", self, ("keep_checkpoints",), 1)
        check_positive("train.", self, ("lr",))
        check_min("train.", self, ("min_lr", "weight_decay", "grad_clip"), 0)
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr})")
        for i, beta in enumerate(self.betas):
            check_fraction(f"train.betas[{i}]", beta, low_open=False)


@dataclass
class FinetuneOptimConfig(OptimConfig):
    """As pretraining's, plus SGD's momentum: `parts.optimizer` picks SGD (`momentum`, the
    paper's) or AdamW (`betas`). Paper appendix B.1.1: SGD momentum 0.9, cosine, no weight
    decay, clipping at norm 1."""

    # Fine-tuning's own defaults, also when a config gives other `train` keys (a default
    # factory of the job would apply them only when `train` is left out entirely).
    batch_size: int = 512  # global: split over processes and grad_accum micro-steps
    lr: float = 0.01  # peak learning rate
    warmup_steps: int = 50  # linear warm-up, then cosine decay to min_lr
    momentum: float = 0.9  # SGD (parts.optimizer=sgd)

    def validate(self) -> None:
        super().validate()
        check_fraction("train.momentum", self.momentum, low_open=False)
