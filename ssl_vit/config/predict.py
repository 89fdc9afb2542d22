"""The config of `ssl-vit predict`: a fine-tuned classifier labels a source.

The model, its preprocessing and its label names come from the classifier file, never from
here: this config only says what to read, where to write and how fast."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ssl_vit.config.checks import check_positive
from ssl_vit.config.errors import ConfigError
from ssl_vit.config.optim import MixedPrecision
from ssl_vit.config.run import DataTimeoutConfig

if TYPE_CHECKING:
    from ssl_vit.config.select import SelectConfig

__all__ = ["PredictConfig", "check_source_job"]


@dataclass
class PredictConfig:
    """Label every image of `source` with the fine-tuned classifier `checkpoint`."""

    checkpoint: str = ""  # a fine-tuning run directory or its model.safetensors (--checkpoint)
    source: str = ""  # image folder, shards, brace pattern, HF dataset (--source)
    output_dir: str = ""  # predictions.jsonl (or .csv), results.json, metrics.jsonl (--output)
    top_k: int = 5  # classes listed per image (at most the classifier's)
    format: Literal["jsonl", "csv"] = "jsonl"  # predictions.jsonl or predictions.csv
    # Treat the source as unlabelled (its class folders are not the classifier's classes):
    # no accuracy, and no refusal of other class names.
    ignore_labels: bool = False
    batch_size: int = 256  # images per forward pass, on each process
    num_workers: int = -1  # loader workers per process; -1: auto, as the training jobs
    mixed_precision: MixedPrecision = "auto"  # auto: bf16 on a GPU with it
    timeouts: DataTimeoutConfig = field(default_factory=DataTimeoutConfig)

    def validate(self) -> None:
        check_source_job(self, "the predictions")
        check_positive("", self, ("top_k", "batch_size"))


def check_source_job(cfg: PredictConfig | SelectConfig, output: str) -> None:
    """What a job reading `--source` with `--checkpoint` into `--output` (predict, select)
    needs: the three given, and a loader worker count >= 0 or -1 (auto)."""
    for key, flag in (("checkpoint", "--checkpoint"), ("source", "--source")):
        if not str(getattr(cfg, key)).strip():
            raise ConfigError(f"{flag}: required")
    if not cfg.output_dir.strip():
        raise ConfigError(f"--output: required (a directory for {output})")
    if cfg.num_workers < -1:
        raise ConfigError(f"num_workers: must be >= 0 or -1 (auto), got {cfg.num_workers}")
