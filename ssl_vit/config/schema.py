"""Config schemas of the three jobs (pretrain, fine-tune, few-shot). Defaults follow the paper.

A YAML file names only what differs from these defaults; `config.yaml` in each run directory
holds the fully resolved values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ssl_vit.config.loader import ConfigError, from_dict
from ssl_vit.config.variants import resolve_variant

__all__ = [
    "ModelConfig",
    "ObjectiveConfig",
    "PretrainDataConfig",
    "OptimConfig",
    "FewshotEvalConfig",
    "PretrainConfig",
    "FinetuneDataConfig",
    "FinetuneConfig",
    "FewshotDataConfig",
    "FewshotConfig",
    "InitConfig",
]

MixedPrecision = Literal["auto", "no", "bf16", "fp16"]


def check_knn(k: int, num_train: int, temperature: float, prefix: str = "") -> None:
    if k < 0 or num_train < 0 or temperature <= 0:
        raise ConfigError(
            f"{prefix}knn_k, {prefix}knn_train: must be >= 0, {prefix}knn_temperature > 0; "
            f"got {k}, {num_train}, {temperature}"
        )


def check_layers(layers: str | list[int], concat_last: int) -> None:
    if isinstance(layers, str) and layers not in ("last", "all"):
        raise ConfigError(
            f"layers: expected 'last', 'all' or a list of block indices, got {layers!r}"
        )
    if isinstance(layers, list) and not layers:
        raise ConfigError("layers: an empty list")
    if concat_last < 0:
        raise ConfigError(f"concat_last: must be >= 0, got {concat_last}")


def check_seed(seed: int) -> None:
    # Each process seeds with seed + its rank, and NumPy takes seeds below 2**32.
    if not 0 <= seed < 2**31:
        raise ConfigError(f"seed: must be in [0, 2**31), got {seed}")


@dataclass
class ModelConfig:
    """ViT shape. `variant` (Ti/S/B/L/H, optionally with '/patch', e.g. 'B/16') fills width,
    depth and heads; any of them given explicitly overrides the variant."""

    variant: str = ""
    image_size: int = 224
    patch_size: int | None = None
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6  # LayerNorm epsilon; a loaded checkpoint's own value wins

    def validate(self) -> None:
        if self.variant:
            shape = resolve_variant(self.variant)
            self.patch_size = shape.pop("patch_size", self.patch_size)
            for key, value in shape.items():  # explicit values override the variant
                if getattr(self, key) is None:
                    setattr(self, key, value)
        if self.patch_size and self.image_size % self.patch_size:
            raise ConfigError(
                f"model.image_size ({self.image_size}) must be a multiple of "
                f"model.patch_size ({self.patch_size})"
            )

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> ModelConfig:
        """The config of a saved model-config dict (checkpoint and export metadata, imported
        weights), checked like a YAML one. Checkpoints written before `norm_eps` existed
        used 1e-6, its default."""
        return from_dict(cls, dict(saved), prefix="model_config.")


@dataclass
class ObjectiveConfig:
    """Masked patch prediction (paper appendix B.1.2). `target`: `mean_color` (3-bit mean
    colour, 512 classes), `color_4x4` (3-bit mean colours of 4x4 cells: 16 x 512 classes; needs
    patch_size >= 4), `pixels_l2` (MSE on the patch's pixels in [0, 1]); see objectives.targets."""

    target: Literal["mean_color", "color_4x4", "pixels_l2"] = "mean_color"
    normalize_pixels: bool = False  # pixels_l2: per-patch zero mean, unit variance (as MAE)
    mask_ratio: float = 0.5
    # P(replace by [mask]), P(replace by another patch's embedding), P(keep), of corrupted patches.
    probs: tuple[float, float, float] = (0.8, 0.1, 0.1)

    def validate(self) -> None:
        if not 0.0 < self.mask_ratio <= 1.0:
            raise ConfigError(f"objective.mask_ratio: must be in (0, 1], got {self.mask_ratio}")
        if min(self.probs) < 0 or not math.isclose(sum(self.probs), 1.0, abs_tol=1e-6):
            raise ConfigError(f"objective.probs: must be >= 0 and sum to 1, got {self.probs}")


@dataclass
class PretrainDataConfig:
    train_shards: str = ""  # shard directory, index JSON or brace pattern
    num_workers: int = 2
    shuffle_buffer: int = 2000  # samples shuffled together in memory (a block of one shard)
    resampled: bool = False  # draw shards with replacement instead of epochs
    record_keys: bool = False  # append each rank's consumed sample keys to keys_rank{R}.txt
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    # Normalization applied on the device after the colour targets are taken from [0, 1] pixels.
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def validate(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("data.num_workers: must be >= 0")


def check_log_with(log_with: list[str], tensorboard: bool, prefix: str) -> list[str]:
    """The tracker names of `log_with` (+ tensorboard for the old `tensorboard: true`), each
    one Accelerate knows (imported here only when trackers are asked for)."""
    names = list(dict.fromkeys([*log_with, *(["tensorboard"] if tensorboard else [])]))
    if names:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        for name in names:
            if name not in LOGGER_TYPE_TO_CLASS:
                raise ConfigError(
                    f"{prefix}log_with: unknown tracker {name!r}, one of "
                    f"{sorted(LOGGER_TYPE_TO_CLASS)}"
                )
    return names


@dataclass
class OptimConfig:
    """Step-based schedule. `batch_size` is GLOBAL (all processes x accumulation steps)."""

    steps: int = 1000
    batch_size: int = 256
    grad_accum: int = 1
    lr: float = 2e-4
    warmup_steps: int = 100
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9  # SGD (fine-tuning)
    grad_clip: float = 1.0  # global norm; 0 disables
    mixed_precision: MixedPrecision = "auto"
    # torch.compile of the step's forward+loss (and few-shot feature extraction): "auto" on
    # CUDA only, or true/false; compile_mode: default | reduce-overhead (CUDA graphs, for small
    # models) | max-autotune. A compile failure falls back to eager with one warning.
    compile: bool | Literal["auto"] = "auto"
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    log_every: int = 50
    # Experiment trackers (Accelerate's): tensorboard, wandb, mlflow, comet_ml, aim, ... Each
    # metrics.jsonl row also goes to them, from the main process; offline unless configured.
    log_with: list[str] = field(default_factory=list)
    tensorboard: bool = False  # the same as log_with: [tensorboard] (kept for old configs)
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    # Steps with a non-finite gradient norm are skipped; this many in a row stop the job.
    max_bad_steps: int = 10
    # A collective (all-reduce, barrier) waiting this long for another rank fails the job.
    dist_timeout_s: float = 1800.0
    # After SIGTERM / SIGINT the job checkpoints and exits; if that takes longer (a rank gone),
    # it exits 1 without a new checkpoint.
    stop_timeout_s: float = 300.0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ConfigError("train.warmup_steps/checkpoint_every must be >= 0, keep >= 1")
        for name in ("dist_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: must be > 0, got {getattr(self, name)}")
        self.log_with = check_log_with(self.log_with, self.tensorboard, "train.")


@dataclass
class FewshotEvalConfig:
    """Few-shot linear evaluation of frozen features (big_vision's fewshot_lsr)."""

    train: str = ""  # labelled source: shard dir / index / brace pattern, image folder, HF dataset
    eval: str = ""
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    l2_reg: list[float] = field(default_factory=lambda: [1024.0])
    batch_size: int = 256
    num_workers: int = 2
    max_eval: int = 0  # evaluate on the first N test images only (0: the whole split)
    every: int = 0  # pretraining only: run every N steps (0: only at the end, if train is set)
    # k-NN monitor next to it (eval.knn: cosine, k neighbours, votes weighted by exp(sim / T)):
    # `knn/top1` of the test split against knn_train train images (0: all); knn_k=0: off.
    knn_k: int = 0
    knn_train: int = 10000
    knn_temperature: float = 0.07

    def validate(self) -> None:
        check_knn(self.knn_k, self.knn_train, self.knn_temperature, "fewshot.")


@dataclass
class PretrainConfig:
    output_dir: str = "runs/pretrain"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig)
    train: OptimConfig = field(default_factory=lambda: OptimConfig(weight_decay=0.0))
    fewshot: FewshotEvalConfig = field(default_factory=FewshotEvalConfig)

    def validate(self) -> None:
        check_seed(self.seed)
        if not self.data.train_shards:
            raise ConfigError("data.train_shards: required (a shard directory, index or pattern)")
        if self.objective.target == "color_4x4" and (self.model.patch_size or 0) < 4:
            raise ConfigError("objective.target color_4x4: needs model.patch_size >= 4")


@dataclass
class FinetuneDataConfig:
    train: str = ""
    eval: str = ""
    num_workers: int = 2
    shuffle_buffer: int = 1000  # shards: samples shuffled together in memory
    resampled: bool = False  # shards: draw with replacement instead of epochs
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_eval: int = 0  # evaluate on the first N images only (0: the whole split)


@dataclass
class InitConfig:
    # A pretraining run directory or checkpoint (its newest valid one is used), an
    # encoder.safetensors, timm / transformers weights; `none`: random init (from scratch).
    checkpoint: str = "none"
    pos_interp: Literal["bilinear", "bicubic"] = "bicubic"
    # auto: an ssl-vit checkpoint, timm ViT weights or a transformers ViT directory, detected
    format: Literal["auto", "ssl_vit", "timm", "hf"] = "auto"

    def validate(self) -> None:
        if not self.checkpoint.strip():
            # An empty value is what a failed shell substitution gives: never "from scratch".
            raise ConfigError(
                "init.checkpoint: empty; give a checkpoint or run directory, or `none` to "
                "fine-tune from random init"
            )

    @property
    def scratch(self) -> bool:
        return self.checkpoint.strip().lower() == "none"


@dataclass
class FinetuneConfig:
    output_dir: str = "runs/finetune"
    seed: int = 0
    pool: Literal["cls", "gap"] = "cls"
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    # Paper appendix B.1.1: SGD momentum 0.9, cosine, no weight decay, clipping at norm 1.
    train: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=0.01, batch_size=512, warmup_steps=50)
    )
    ema: float = 0.0  # Polyak averaging factor (0: off), e.g. 0.9999
    eval_every: int = 500

    def validate(self) -> None:
        check_seed(self.seed)
        if not self.data.train:
            raise ConfigError("data.train: required (shards, image folder or HF dataset)")
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"ema: must be in [0, 1), got {self.ema}")


@dataclass
class FewshotDataConfig:
    train: str = ""  # labelled source: shard dir / index / brace pattern, image folder, HF dataset
    eval: str = ""
    batch_size: int = 256
    num_workers: int = 2
    max_eval: int = 0  # evaluate on the first N test images only (0: the whole split)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def validate(self) -> None:
        if not self.train or not self.eval:
            raise ConfigError("data.train and data.eval: both required for few-shot evaluation")


@dataclass
class FewshotConfig:
    output_dir: str = "runs/fewshot"
    seed: int = 0
    # The summarized readout: the last block's output pooled so (cls+gap: both, concatenated).
    pool: Literal["cls", "gap", "cls+gap"] = "cls"
    # Also every block asked for (`all`, or indices, negative from the end) x cls/gap/cls+gap,
    # and the last `concat_last` blocks concatenated: results.json `layers` (eval.readouts).
    layers: str | list[int] = "last"
    concat_last: int = 0
    knn_k: int = 0  # also weighted k-NN top-1 (eval.knn) of the readout; 0: off
    knn_train: int = 10000  # train images the k-NN compares against (0: all)
    knn_temperature: float = 0.07
    # torch.compile of the feature extraction, as train.compile / train.compile_mode.
    compile: bool | Literal["auto"] = "auto"
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: FewshotDataConfig = field(default_factory=FewshotDataConfig)
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    l2_reg: list[float] = field(default_factory=lambda: [1024.0])
    pos_interp: Literal["bilinear", "bicubic"] = "bicubic"
    # --checkpoint's format: auto-detected ssl-vit checkpoint, timm weights or transformers dir
    checkpoint_format: Literal["auto", "ssl_vit", "timm", "hf"] = "auto"
    log_with: list[str] = field(default_factory=list)  # experiment trackers, as train.log_with
    tensorboard: bool = False  # the same as log_with: [tensorboard] (kept for old configs)

    def validate(self) -> None:
        check_seed(self.seed)
        self.log_with = check_log_with(self.log_with, self.tensorboard, "")
        check_layers(self.layers, self.concat_last)
        check_knn(self.knn_k, self.knn_train, self.knn_temperature)
