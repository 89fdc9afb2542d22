"""The few-shot evaluation spec: one `fewshot:` section, the same in the pretraining job (its
monitor) and the few-shot job, passed whole to `ssl_vit.eval.fewshot_job.fewshot_evaluate`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ssl_vit.config.checks import check_min
from ssl_vit.config.frozen import Frozen
from ssl_vit.errors import ConfigError

__all__ = ["FewshotEvalConfig"]


@dataclass
class FewshotEvalConfig(Frozen):
    """Few-shot linear evaluation of frozen features (big_vision's fewshot_lsr): closed-form
    ridge solves for every shot x seed x l2_reg on features extracted once."""

    train: str = ""  # labelled source: shard dir / index / brace pattern, image folder, HF dataset
    eval: str = ""  # the test split, a labelled source as `train`
    # Shots per class; "all": every train image (a full linear probe, same closed-form ridge).
    shots: list[int | Literal["all"]] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    l2_reg: list[float] = field(default_factory=lambda: [1024.0])
    # Per-dimension mean/std of the train features applied to train and test before the
    # ridge (big_vision's fewshot_lsr, today's behaviour); false: the raw features.
    standardize: bool = True
    # The summarized readout: the last block's output pooled so (cls+gap: both, concatenated).
    pool: Literal["cls", "gap", "cls+gap"] = "cls"
    # Also every block asked for (`all`, or indices, negative from the end) x cls/gap/cls+gap,
    # and the last `concat_last` blocks concatenated: results `layers` (eval.readouts).
    layers: str | list[int] = "last"
    concat_last: int = 0  # also the last N blocks' pooled outputs concatenated (0: off)
    batch_size: int = 256  # images per feature-extraction batch
    num_workers: int = 2  # loader workers decoding the train subset and the test split
    max_eval: int = 0  # evaluate on the first N test images only (0: the whole split)
    # k-NN next to it (eval.knn: cosine, k neighbours, votes weighted by exp(sim / T)):
    # `knn/top1` of the test split against knn_train train images (0: all); knn_k=0: off.
    knn_k: int = 0
    knn_train: int = 10000
    knn_temperature: float = 0.07
    every: int = 0  # pretraining only: run every N steps (0: only at the end, if train is set)

    def validate(self) -> None:
        if self.knn_k < 0 or self.knn_train < 0 or self.knn_temperature <= 0:
            raise ConfigError(
                "fewshot.knn_k, fewshot.knn_train: must be >= 0, fewshot.knn_temperature > 0; "
                f"got {self.knn_k}, {self.knn_train}, {self.knn_temperature}"
            )
        shots = self.shots
        if not shots or len(set(shots)) != len(shots) or any(k != "all" and k < 1 for k in shots):
            raise ConfigError(
                f"fewshot.shots: expected distinct counts >= 1 and/or 'all', got {shots!r}"
            )
        # Seeds seed NumPy's draws (>= 0); a ridge needs l2_reg > 0.
        for key, ok, need in (
            ("seeds", lambda k: k >= 0, ">= 0"),
            ("l2_reg", lambda k: k > 0, "> 0"),
        ):
            values = getattr(self, key)
            if not values:
                raise ConfigError(f"fewshot.{key}: an empty list")
            if not all(ok(v) for v in values):
                raise ConfigError(f"fewshot.{key}: every value must be {need}, got {values}")
        if isinstance(self.layers, str) and self.layers not in ("last", "all"):
            raise ConfigError(
                "fewshot.layers: expected 'last', 'all' or a list of block indices, "
                f"got {self.layers!r}"
            )
        if isinstance(self.layers, list) and not self.layers:
            raise ConfigError("fewshot.layers: an empty list")
        check_min("fewshot.", self, ("concat_last",), 0)
        check_min("fewshot.", self, ("batch_size",), 1)
        check_min("fewshot.", self, ("num_workers", "max_eval", "every"), 0)
