"""Config schemas of the three jobs (pretrain, fine-tune, few-shot). Defaults follow the paper.

A YAML file names only what differs from these defaults; `config.yaml` in each run directory
holds the fully resolved values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ssl_vit.config.loader import ConfigError, from_dict
from ssl_vit.config.recipe import RecipeParts, check_adamw_lr, recipe_defaults
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
# Where random-resized-crop + flip run: `device` (one batched op on the accelerator, the workers
# only decode and resize to a square `load_size`), `workers` (per sample in the DataLoader
# workers), `auto` (device on CUDA, workers elsewhere: the CPU quick start keeps its results).
Augment = Literal["auto", "device", "workers"]
MAX_AUTO_WORKERS = 8


def auto_num_workers(requested: int) -> int:
    """`data.num_workers`; -1 (auto) -> min(8, usable CPUs // processes on this node).

    Each process of a node starts its own workers; LOCAL_WORLD_SIZE (set by accelerate launch
    and torchrun) says how many share the node's CPUs."""
    if requested >= 0:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return max(min(MAX_AUTO_WORKERS, (cpus or 1) // local), 1)


def check_data_loading(num_workers: int, load_size: int) -> int:
    """The resolved worker count, after checking the loading keys shared by the data configs."""
    if num_workers < -1:
        raise ConfigError(f"data.num_workers: must be >= 0 or -1 (auto), got {num_workers}")
    if load_size < 0:
        raise ConfigError(f"data.load_size: must be >= 0 (0: auto), got {load_size}")
    return auto_num_workers(num_workers)


def check_min(prefix: str, obj: Any, names: tuple[str, ...], minimum: int) -> None:
    """Every `obj.<name>` (an int) is >= `minimum`; the error names `prefix + name`."""
    for name in names:
        if getattr(obj, name) < minimum:
            raise ConfigError(f"{prefix}{name}: must be >= {minimum}, got {getattr(obj, name)}")


def check_positive(prefix: str, obj: Any, names: tuple[str, ...]) -> None:
    """Every `obj.<name>` (a number, None skipped) is > 0; the error names `prefix + name`."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{prefix}{name}: must be > 0, got {value}")


def check_fraction(key: str, value: float, low_open: bool = True) -> None:
    """`value` in (0, 1] (low_open) or [0, 1)."""
    ok = 0.0 < value <= 1.0 if low_open else 0.0 <= value < 1.0
    if not ok:
        raise ConfigError(f"{key}: must be in {'(0, 1]' if low_open else '[0, 1)'}, got {value}")


def check_pixels_norm(
    prefix: str, std: tuple[float, ...], crop_scale: tuple[float, float] | None = None
) -> None:
    """Normalization (std > 0: it divides; the mean only needs to be finite, as every float
    key) and the random-resized-crop area range 0 < low <= high <= 1 (a crop cannot be larger
    than the image)."""
    if min(std) <= 0:
        raise ConfigError(f"{prefix}std: every value must be > 0, got {list(std)}")
    if crop_scale is not None:
        low, high = crop_scale
        if not 0.0 < low <= high <= 1.0:
            raise ConfigError(
                f"{prefix}crop_scale: need 0 < low <= high <= 1, got {list(crop_scale)}"
            )


def check_fewshot_grid(
    prefix: str, shots: list[int | str], seeds: list[int], l2_reg: list[float]
) -> None:
    """Shots as `check_shots`, seeds >= 0 (NumPy draws), l2_reg > 0 (a ridge needs it); none
    empty."""
    check_shots(shots, prefix)
    for key, values, ok, need in (
        ("seeds", seeds, lambda k: k >= 0, ">= 0"),
        ("l2_reg", l2_reg, lambda k: k > 0, "> 0"),
    ):
        if not values:
            raise ConfigError(f"{prefix}{key}: an empty list")
        if not all(ok(v) for v in values):
            raise ConfigError(f"{prefix}{key}: every value must be {need}, got {values}")


def check_knn(k: int, num_train: int, temperature: float, prefix: str = "") -> None:
    if k < 0 or num_train < 0 or temperature <= 0:
        raise ConfigError(
            f"{prefix}knn_k, {prefix}knn_train: must be >= 0, {prefix}knn_temperature > 0; "
            f"got {k}, {num_train}, {temperature}"
        )


def check_shots(shots: list[int | str], prefix: str = "") -> None:
    """Shots per class: counts >= 1 and/or "all" (every train image: a full linear probe)."""
    if not shots or len(set(shots)) != len(shots) or any(k != "all" and k < 1 for k in shots):
        raise ConfigError(
            f"{prefix}shots: expected distinct counts >= 1 and/or 'all', got {shots!r}"
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
    # Every stream's seed is derived from it (ssl_vit.seeds); kept below 2**31 for old tools.
    if not 0 <= seed < 2**31:
        raise ConfigError(f"seed: must be in [0, 2**31), got {seed}")


@dataclass
class ModelConfig:
    """ViT shape. `variant` (Ti/S/B/L/H, optionally with '/patch', e.g. 'B/16') fills width,
    depth and heads; any of them given explicitly overrides the variant."""

    variant: str = ""  # Ti, S, B, L, H or e.g. B/16 (the patch too); "": give the shape below
    image_size: int = 224  # input side in pixels; a multiple of patch_size
    patch_size: int | None = None  # patch side in pixels
    width: int | None = None  # token dimension D
    depth: int | None = None  # transformer blocks
    heads: int | None = None  # attention heads (width must divide by them)
    mlp_ratio: float = 4.0  # MLP hidden size / width
    norm_eps: float = 1e-6  # LayerNorm epsilon; a loaded checkpoint's own value wins

    def validate(self) -> None:
        if self.variant:
            shape = resolve_variant(self.variant)
            self.patch_size = shape.pop("patch_size", self.patch_size)
            for key, value in shape.items():  # explicit values override the variant
                if getattr(self, key) is None:
                    setattr(self, key, value)
        names = ("image_size", "patch_size", "width", "depth", "heads", "mlp_ratio", "norm_eps")
        check_positive("model.", self, names)
        if self.width and self.heads and self.width % self.heads:
            raise ConfigError(
                f"model.width ({self.width}) must be divisible by model.heads ({self.heads})"
            )
        if self.width and int(self.width * self.mlp_ratio) < 1:  # the MLP's hidden size
            raise ConfigError(
                f"model.mlp_ratio: {self.mlp_ratio} x model.width {self.width} leaves the MLP "
                "no hidden unit (need int(width * mlp_ratio) >= 1)"
            )
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
    mask_ratio: float = 0.5  # share of each image's patches corrupted (paper: 0.5)
    # P(replace by [mask]), P(replace by another patch's embedding), P(keep), of corrupted patches.
    probs: tuple[float, float, float] = (0.8, 0.1, 0.1)
    # A prediction decoder between the encoder and the head (MAE, He et al. 2021): its blocks
    # take over predicting colours so the encoder's top blocks stay semantic. 0: none (the
    # paper's design). Width 0: the encoder's; heads 0: the encoder's head dimension kept.
    decoder_depth: int = 0
    decoder_width: int = 0  # the decoder's width (0: the encoder's)
    decoder_heads: int = 0  # the decoder's heads (0: the encoder's head dimension kept)
    # `all`: every patch goes through the encoder, corrupted as above (the paper). `visible`
    # (MAE's arm, needs decoder_depth >= 1): the round(mask_ratio * N) chosen patches are left
    # out of the encoder and only the decoder sees [mask] tokens there; `probs` do not apply.
    encoder: Literal["all", "visible"] = "all"

    def validate(self) -> None:
        if not 0.0 < self.mask_ratio <= 1.0:
            raise ConfigError(f"objective.mask_ratio: must be in (0, 1], got {self.mask_ratio}")
        if min(self.probs) < 0 or not math.isclose(sum(self.probs), 1.0, abs_tol=1e-6):
            raise ConfigError(f"objective.probs: must be >= 0 and sum to 1, got {self.probs}")
        for key in ("decoder_depth", "decoder_width", "decoder_heads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"objective.{key}: must be >= 0, got {getattr(self, key)}")
        if self.encoder == "visible" and self.decoder_depth < 1:
            raise ConfigError("objective.encoder=visible: needs objective.decoder_depth >= 1")
        if self.encoder == "visible" and self.mask_ratio >= 1.0:
            raise ConfigError("objective.encoder=visible: mask_ratio must leave a patch, got 1.0")

    def decoder_shape(self, encoder_width: int, encoder_heads: int) -> tuple[int, int]:
        """(width, heads) of the decoder: 0 width is the encoder's, 0 heads keeps the encoder's
        head dimension (width // (encoder_width // encoder_heads), at least 1)."""
        width = self.decoder_width or encoder_width
        heads = self.decoder_heads or max(1, width // (encoder_width // encoder_heads))
        if width % heads:
            raise ConfigError(
                f"objective.decoder_width {width}: not divisible by objective.decoder_heads {heads}"
            )
        return width, heads


@dataclass
class PretrainDataConfig:
    """The pretraining stream: WebDataset shards, random-resized crop and flip."""

    train_shards: str = ""  # shard directory, index JSON or brace pattern
    num_workers: int = -1  # -1: auto, min(8, CPUs // processes per node), resolved at load
    # Sequential lanes every global micro-batch draws from equally (fixed for a run; the sample
    # order depends on it, not on processes or workers): 0 auto, the largest divisor of the
    # micro-batch up to 64 and up to the shard count (resuming: the checkpoint's). docs/scaling.md
    lanes: int = 0
    shuffle_buffer: int = 2000  # samples shuffled together in memory (a block of one shard)
    resampled: bool = False  # draw shards with replacement instead of epochs
    record_keys: bool = False  # append each rank's consumed sample keys to keys_rank{R}.txt
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    augment: Augment = "auto"  # crop + flip: auto (device on CUDA), device or workers
    # augment=device: the workers' square size (shorter side resized, centre crop); 0: auto
    # (model.image_size up to 64 px, 8/7 of it above; ssl_vit.data.device_augment.load_size).
    load_size: int = 0
    # Normalization applied on the device after the colour targets are taken from [0, 1] pixels.
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def validate(self) -> None:
        check_min("data.", self, ("shuffle_buffer", "lanes"), 0)
        check_pixels_norm("data.", self.std, self.crop_scale)
        self.num_workers = check_data_loading(self.num_workers, self.load_size)


def check_log_with(log_with: list[str], tensorboard: bool, prefix: str) -> list[str]:
    """The tracker names of `log_with` (+ tensorboard for the old `tensorboard: true`), each
    one Accelerate knows and whose package is installed: checked here, before the run directory
    is claimed, so a missing package leaves nothing behind (imported only when asked for)."""
    names = list(dict.fromkeys([*log_with, *(["tensorboard"] if tensorboard else [])]))
    if names:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

        available = {str(t) for t in get_available_trackers()}
        for name in names:
            if name not in LOGGER_TYPE_TO_CLASS:
                raise ConfigError(
                    f"{prefix}log_with: unknown tracker {name!r}, one of "
                    f"{sorted(LOGGER_TYPE_TO_CLASS)}"
                )
            if name not in available:
                raise ConfigError(
                    f"{prefix}log_with: tracker {name!r} needs its package {name!r}, "
                    f"which is not installed: pip install {name}"
                )
    return names


@dataclass
class OptimConfig:
    """Step-based schedule. `batch_size` is GLOBAL (all processes x accumulation steps)."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 256  # global: split over processes and grad_accum micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step (gradients summed)
    lr: float = 2e-4  # peak learning rate (paper: 2e-4 at batch 4096; scale it linearly)
    warmup_steps: int = 100  # linear warm-up, then cosine decay to min_lr
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # Adam (pretraining)
    momentum: float = 0.9  # SGD (fine-tuning)
    grad_clip: float = 1.0  # global norm; 0 disables
    mixed_precision: MixedPrecision = "auto"
    # torch.compile of the step's forward+loss (and few-shot feature extraction): "auto" on
    # CUDA only, or true/false; compile_mode: default | reduce-overhead (CUDA graphs, for small
    # models) | max-autotune. A compile failure falls back to eager with one warning.
    compile: bool | Literal["auto"] = "auto"
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"  # torch's
    log_every: int = 50
    # Experiment trackers (Accelerate's): tensorboard, wandb, mlflow, comet_ml, aim, ... Each
    # metrics.jsonl row also goes to them, from the main process; offline unless configured.
    log_with: list[str] = field(default_factory=list)
    tensorboard: bool = False  # the same as log_with: [tensorboard] (kept for old configs)
    checkpoint_every: int = 500  # steps between checkpoints (0: only the final one)
    keep_checkpoints: int = 3  # the newest N checkpoints are kept
    # Steps with a non-finite gradient norm are skipped; this many in a row stop the job.
    max_bad_steps: int = 10
    # A collective (all-reduce, barrier) waiting this long for another rank fails the job.
    dist_timeout_s: float = 1800.0
    # After SIGTERM / SIGINT the job checkpoints and exits; if that takes longer (a rank gone),
    # it exits 1 without a new checkpoint.
    stop_timeout_s: float = 300.0
    # A wait for one batch longer than this (a stalled pipe: command, FIFO or mount) ends the
    # job with exit 1; covers loader start-up and the evaluation loaders too.
    data_timeout_s: float = 600.0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        check_min("train.", self, ("warmup_steps", "checkpoint_every"), 0)
        check_min("train.", self, ("keep_checkpoints",), 1)
        check_positive("train.", self, ("lr", "dist_timeout_s", "stop_timeout_s", "data_timeout_s"))
        for name in ("min_lr", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr})")
        check_fraction("train.momentum", self.momentum, low_open=False)
        for i, beta in enumerate(self.betas):
            check_fraction(f"train.betas[{i}]", beta, low_open=False)
        self.log_with = check_log_with(self.log_with, self.tensorboard, "train.")


@dataclass
class FewshotEvalConfig:
    """Few-shot linear evaluation of frozen features (big_vision's fewshot_lsr)."""

    train: str = ""  # labelled source: shard dir / index / brace pattern, image folder, HF dataset
    eval: str = ""
    # Shots per class; "all": every train image (a full linear probe, same closed-form ridge).
    shots: list[int | Literal["all"]] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    l2_reg: list[float] = field(default_factory=lambda: [1024.0])
    # Per-dimension mean/std of the train features applied to train and test before the
    # ridge (big_vision's fewshot_lsr, today's behaviour); false: the raw features.
    standardize: bool = True
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
        check_fewshot_grid("fewshot.", self.shots, self.seeds, self.l2_reg)
        check_min("fewshot.", self, ("batch_size",), 1)
        check_min("fewshot.", self, ("num_workers", "max_eval", "every"), 0)


@dataclass
class PretrainConfig:
    """Masked patch prediction pretraining."""

    output_dir: str = "runs/pretrain"  # the run directory
    seed: int = 0  # every random stream's seed derives from it (ssl_vit.seeds)
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
        if self.model.patch_size:
            num_patches = (self.model.image_size // self.model.patch_size) ** 2
            if round(self.objective.mask_ratio * num_patches) == 0:  # as objectives.corruption
                raise ConfigError(
                    f"objective.mask_ratio: {self.objective.mask_ratio} x {num_patches} patches "
                    "corrupts none (nothing to predict); raise it"
                )
        if self.objective.decoder_depth and self.model.width and self.model.heads:
            self.objective.decoder_shape(self.model.width, self.model.heads)


@dataclass
class FinetuneDataConfig:
    """Labelled sources: shards, an image folder, an HF dataset directory or hf://NAME[:SPLIT]."""

    train: str = ""
    eval: str = ""
    num_workers: int = -1  # -1: auto, as PretrainDataConfig
    lanes: int = 0  # as PretrainDataConfig
    shuffle_buffer: int = 1000  # shards: samples shuffled together in memory
    resampled: bool = False  # shards: draw with replacement instead of epochs
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    augment: Augment = "auto"  # as PretrainDataConfig
    load_size: int = 0  # augment=device: the workers' square size (0: auto), as pretraining
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_eval: int = 0  # evaluate on the first N images only (0: the whole split)
    # A label budget: train on K images per class of data.train (0: every label), the same
    # class-balanced subset for every init, seed and process count (ssl_vit.data.labelled).
    labels_per_class: int = 0
    labels_seed: int = 0  # which K per class (smaller budgets are inside larger ones)
    record_keys: bool = False  # append each rank's consumed sample keys to keys_rank{R}.txt

    def validate(self) -> None:
        check_min("data.", self, ("shuffle_buffer", "lanes", "max_eval", "labels_per_class"), 0)
        check_pixels_norm("data.", self.std, self.crop_scale)
        self.num_workers = check_data_loading(self.num_workers, self.load_size)


@dataclass
class InitConfig:
    """The encoder fine-tuning starts from."""

    # A pretraining run directory or checkpoint (its newest valid one is used), an
    # encoder.safetensors, timm / transformers weights; `none`: random init (from scratch).
    checkpoint: str = "none"
    # How position embeddings are resized when model.image_size differs from the checkpoint's.
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
    """Fine-tuning of an encoder as a classifier (zero-initialized linear head)."""

    output_dir: str = "runs/finetune"  # the run directory
    seed: int = 0
    pool: Literal["cls", "gap"] = "cls"  # the head reads the [class] token or the patch mean
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    # Paper appendix B.1.1: SGD momentum 0.9, cosine, no weight decay, clipping at norm 1.
    train: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=0.01, batch_size=512, warmup_steps=50)
    )
    ema: float = 0.0  # Polyak averaging factor (0: off), e.g. 0.9999
    eval_every: int = 500
    # paper (B.1.1) or modern (MAE Table 9): the defaults of `parts` and of train.lr,
    # weight_decay, betas that are not given explicitly (see ssl_vit.config.recipe).
    recipe: Literal["paper", "modern"] = "paper"
    parts: RecipeParts = field(default_factory=RecipeParts)

    # The loader merges the recipe's preset under the YAML file and the overrides.
    preset_defaults = staticmethod(recipe_defaults)

    def validate(self) -> None:
        check_seed(self.seed)
        if not self.data.train:
            raise ConfigError("data.train: required (shards, image folder or HF dataset)")
        check_fraction("ema", self.ema, low_open=False)
        check_min("", self, ("eval_every",), 0)
        check_adamw_lr(self.parts, self.train.lr, self.train.batch_size)
        if self.parts.randaugment and self.data.augment == "device":
            raise ConfigError(
                "data.augment=device: parts.randaugment runs per sample in the loader workers "
                "after the crop; use data.augment=workers (or auto)"
            )
        micro = self.train.batch_size // self.train.grad_accum
        if self.parts.mixes and micro % 2:
            # Mixing pairs each image with the batch's reversed order (timm Mixup).
            raise ConfigError(
                f"parts.mixup/cutmix: need an even batch per step and process, got "
                f"train.batch_size / train.grad_accum = {micro}"
            )


@dataclass
class FewshotDataConfig:
    """The labelled support (train) and test (eval) sources."""

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
        check_min("data.", self, ("batch_size",), 1)
        check_min("data.", self, ("num_workers", "max_eval"), 0)
        check_pixels_norm("data.", self.std)


@dataclass
class FewshotConfig:
    """Few-shot linear evaluation of a frozen encoder (`--checkpoint`)."""

    output_dir: str = "runs/fewshot"  # the run directory
    seed: int = 0
    # The summarized readout: the last block's output pooled so (cls+gap: both, concatenated).
    pool: Literal["cls", "gap", "cls+gap"] = "cls"
    # Also every block asked for (`all`, or indices, negative from the end) x cls/gap/cls+gap,
    # and the last `concat_last` blocks concatenated: results.json `layers` (eval.readouts).
    layers: str | list[int] = "last"
    concat_last: int = 0  # also the last N blocks' pooled outputs concatenated (0: off)
    knn_k: int = 0  # also weighted k-NN top-1 (eval.knn) of the readout; 0: off
    knn_train: int = 10000  # train images the k-NN compares against (0: all)
    knn_temperature: float = 0.07
    # torch.compile of the feature extraction, as train.compile / train.compile_mode.
    compile: bool | Literal["auto"] = "auto"
    # as train.compile_mode: default | reduce-overhead (CUDA graphs) | max-autotune
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: FewshotDataConfig = field(default_factory=FewshotDataConfig)
    # Shots per class; "all": every train image (a full linear probe, same closed-form ridge).
    shots: list[int | Literal["all"]] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    l2_reg: list[float] = field(default_factory=lambda: [1024.0])
    # Per-dimension mean/std of the train features applied to train and test before the
    # ridge (big_vision's fewshot_lsr, today's behaviour); false: the raw features.
    standardize: bool = True
    pos_interp: Literal["bilinear", "bicubic"] = "bicubic"
    # --checkpoint's format: auto-detected ssl-vit checkpoint, timm weights or transformers dir
    checkpoint_format: Literal["auto", "ssl_vit", "timm", "hf"] = "auto"
    log_with: list[str] = field(default_factory=list)  # experiment trackers, as train.log_with
    tensorboard: bool = False  # the same as log_with: [tensorboard] (kept for old configs)
    data_timeout_s: float = 600.0  # as train.data_timeout_s: the longest wait for one batch

    def validate(self) -> None:
        check_seed(self.seed)
        if self.data_timeout_s <= 0:
            raise ConfigError(f"data_timeout_s: must be > 0, got {self.data_timeout_s}")
        self.log_with = check_log_with(self.log_with, self.tensorboard, "")
        check_layers(self.layers, self.concat_last)
        check_knn(self.knn_k, self.knn_train, self.knn_temperature)
        check_fewshot_grid("", self.shots, self.seeds, self.l2_reg)
