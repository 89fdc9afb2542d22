"""The config of `ssl-vit select`: which unlabelled images to label, chosen from a pretrained
encoder's frozen features.

The encoder's shape and pixel normalisation come from the checkpoint, never from here: this
config says what to read, how many images to pick and how, where to write and how fast."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ssl_vit.config.checks import check_min, check_positive, check_seed, check_source_job
from ssl_vit.config.frozen import Frozen
from ssl_vit.config.optim import MixedPrecision
from ssl_vit.config.run import CollectiveTimeoutConfig
from ssl_vit.errors import ConfigError

__all__ = ["SelectConfig"]


@dataclass
class SelectConfig(Frozen):
    """Pick `budget` images of `source` to label, from the frozen features of `checkpoint`."""

    checkpoint: str = ""  # a pretraining run directory or checkpoint (--checkpoint)
    source: str = ""  # the unlabelled images: image folder, shards, HF dataset (--source)
    # selection.jsonl, to-label/, features.npy (+ .index.npz), results.json, metrics.jsonl
    # (--output); the same folder again with a larger budget is the next round (earlier picks
    # kept first, the features reused when read the same way)
    output_dir: str = ""
    budget: int = 0  # images picked in all, earlier rounds' included (--budget)
    # typiclust (Hacohen et al. 2022: the most typical image of each k-means cluster),
    # kcenter (greedy coreset) or random (--method)
    method: Literal["typiclust", "kcenter", "random"] = "typiclust"
    seed: int = 0  # k-means, a large cluster's typicality sample, k-center's first pick, random
    copy: bool = True  # copy the picks into to-label/ (--no-copy: false)
    image_size: int = 0  # the encoder's input side; 0: the checkpoint's pretraining resolution
    # The features: the frozen encoder's last output pooled so. gap, the mean of the patch
    # outputs: masked patch prediction trains those, never the [class] token's output (the
    # few-shot probe reads gap above cls); TypiClust's picks from gap label CIFAR-10 better by
    # their nearest-pick labels, level after a fine-tune (docs/results.md, "Which readout to
    # pick from").
    pool: Literal["cls", "gap", "cls+gap"] = "gap"
    batch_size: int = 256  # images per forward pass, on each process (--batch-size)
    num_workers: int = -1  # loader workers per process; -1: auto (--workers)
    mixed_precision: MixedPrecision = "auto"  # auto: bf16 on a GPU with it
    timeouts: CollectiveTimeoutConfig = field(default_factory=CollectiveTimeoutConfig)

    def validate(self) -> None:
        check_source_job(self, "the selection")
        if self.budget < 1:
            raise ConfigError(f"--budget: the number of images to pick, >= 1; got {self.budget}")
        check_seed(self.seed)
        check_positive("", self, ("batch_size",))
        check_min("", self, ("image_size",), 0)
