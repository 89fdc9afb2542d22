"""Fine-tuning recipes: the paper's (B.1.1) and a modern one (MAE, He et al. 2022, Table 9).

`recipe:` names a preset of defaults, merged *under* the YAML file and the overrides before the
config is built: a key given explicitly always wins (whatever its value), a key left out takes
the recipe's value, and config.yaml records the resolved values. `recipe: paper` is the empty
preset, so the paper's path is exactly the dataclass defaults:

    recipe: modern                       # AdamW + layer decay, RandAugment, mixup/cutmix, ...
    recipe: modern  parts.mixup=0        # the same without mixup (cutmix stays)
    recipe: paper   parts.drop_path=0.1  # the paper's recipe plus stochastic depth
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from ssl_vit.config.checks import check_fraction, check_min
from ssl_vit.config.frozen import Frozen
from ssl_vit.config.loader import ConfigError

__all__ = ["RecipeParts", "check_adamw_lr", "recipe_defaults"]

log = logging.getLogger(__name__)

# MAE Table 9 (end-to-end fine-tuning): base lr 1e-3 per 256 images (lr = blr * batch / 256),
# AdamW wd 0.05, betas (0.9, 0.999), layer-wise lr decay 0.75, RandAugment (9, 0.5), mixup 0.8,
# cutmix 1.0, label smoothing 0.1, drop path 0.1. Not in the table (kept from `train`): the
# gradient clipping, warmup and schedule length (MAE: 5 of 100 epochs warmup, no clipping).
MAE_BASE_LR = 1e-3
_MODERN_PARTS = {
    "optimizer": "adamw",
    "layer_decay": 0.75,
    "randaugment": "rand-m9-mstd0.5-inc1",
    "mixup": 0.8,
    "cutmix": 1.0,
    "mixup_prob": 1.0,
    "switch_prob": 0.5,
    "label_smoothing": 0.1,
    "drop_path": 0.1,
}


@dataclass
class RecipeParts(Frozen):
    """The parts of a fine-tuning recipe; the defaults are the paper's (all off, SGD)."""

    optimizer: Literal["sgd", "adamw"] = "sgd"  # sgd: train.momentum; adamw: train.betas
    layer_decay: float = 1.0  # lr scale decay^(depth + 1 - layer): embeddings 0, head depth+1
    randaugment: str = ""  # timm spec, e.g. "rand-m9-mstd0.5-inc1" ("": off), after crop+flip
    mixup: float = 0.0  # Beta(alpha, alpha) of mixup (0: off)
    cutmix: float = 0.0  # Beta(alpha, alpha) of cutmix (0: off)
    mixup_prob: float = 1.0  # probability that a batch is mixed at all (mixup or cutmix > 0)
    switch_prob: float = 0.5  # with both on: probability of cutmix instead of mixup
    label_smoothing: float = 0.0  # share of each target spread over all classes (0: off)
    drop_path: float = 0.0  # stochastic depth of the last block (linear from 0 over blocks)

    def validate(self) -> None:
        check_fraction("parts.layer_decay", self.layer_decay)
        check_min("parts.", self, ("mixup", "cutmix"), 0)
        for name in ("mixup_prob", "switch_prob", "label_smoothing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"parts.{name}: must be in [0, 1], got {getattr(self, name)}")
        check_fraction("parts.drop_path", self.drop_path, low_open=False)
        if self.randaugment and not self.randaugment.startswith("rand"):
            raise ConfigError(
                f"parts.randaugment: a timm RandAugment spec starting with 'rand' (e.g. "
                f"'rand-m9-mstd0.5-inc1') or '' for off, got {self.randaugment!r}"
            )

    @property
    def mixes(self) -> bool:
        """Whether batches are mixed (targets become soft)."""
        return (self.mixup > 0 or self.cutmix > 0) and self.mixup_prob > 0


def recipe_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The preset (a nested config dict) of `data["recipe"]`, to merge under `data`. An unknown
    name gives {}: the `recipe` key's own type check then names it."""
    recipe = data.get("recipe", "paper")
    if recipe != "modern":
        return {}
    train = data.get("train") or {}
    batch = train.get("batch_size", 512) if isinstance(train, dict) else 512
    if not isinstance(batch, int) or isinstance(batch, bool):
        return {}  # the type check of train.batch_size reports it
    return {
        "parts": dict(_MODERN_PARTS),
        "train": {"lr": MAE_BASE_LR * batch / 256, "weight_decay": 0.05, "betas": [0.9, 0.999]},
    }


def check_adamw_lr(parts: RecipeParts, lr: float, batch_size: int) -> None:
    """Warn when AdamW gets an SGD-sized learning rate: a config file's `train.lr` (e.g. the
    paper recipe's 0.03) wins over the modern recipe's, as every explicit key does."""
    if parts.optimizer == "adamw" and lr >= 1e-2:
        log.warning(
            "train.lr=%g with AdamW: an SGD-sized learning rate (the modern recipe's is "
            "1e-3 x batch / 256 = %g); an explicit train.lr (also from a config file) wins",
            lr,
            MAE_BASE_LR * batch_size / 256,
        )
