"""The config of `ssl-vit predict`: a fine-tuned classifier labels a source.

The model, its preprocessing and its label names come from the classifier file, never from
here: this config only says what to read, where to write and how fast."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ssl_vit.config.checks import check_positive, check_source_job
from ssl_vit.config.frozen import Frozen
from ssl_vit.config.optim import MixedPrecision
from ssl_vit.config.run import CollectiveTimeoutConfig

__all__ = ["PredictConfig"]


@dataclass
class PredictConfig(Frozen):
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
    timeouts: CollectiveTimeoutConfig = field(default_factory=CollectiveTimeoutConfig)

    def validate(self) -> None:
        check_source_job(self, "the predictions")
        check_positive("", self, ("top_k", "batch_size"))
