"""Config schemas of the three jobs (pretrain, fine-tune, few-shot). Defaults follow the paper.

A YAML file names only what differs from these defaults; `config.yaml` in each run directory
holds the fully resolved values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

from ssl_vit.config.checks import (
    check_data_loading,
    check_fraction,
    check_min,
    check_pixels_norm,
    check_positive,
    check_seed,
)
from ssl_vit.config.distill import DistillConfig
from ssl_vit.config.fewshot import FewshotEvalConfig
from ssl_vit.config.frozen import Frozen
from ssl_vit.config.loader import from_dict
from ssl_vit.config.optim import FinetuneOptimConfig, OptimConfig
from ssl_vit.config.pixels import PIXEL_NORM, completed_pixel_norm
from ssl_vit.config.recipe import RecipeParts, check_adamw_lr, recipe_defaults
from ssl_vit.config.run import CompileConfig, DataTimeoutConfig, TimeoutConfig, check_trackers
from ssl_vit.config.variants import resolve_variant
from ssl_vit.errors import ConfigError

__all__ = [
    "CHECKPOINT_KEYS",
    "SHAPE_KEYS",
    "ModelConfig",
    "ObjectiveConfig",
    "PretrainDataConfig",
    "OptimConfig",
    "FinetuneOptimConfig",
    "FewshotEvalConfig",
    "PretrainConfig",
    "FinetuneDataConfig",
    "FinetuneConfig",
    "FewshotDataConfig",
    "FewshotConfig",
    "InitConfig",
    "CompileConfig",
    "TimeoutConfig",
    "DataTimeoutConfig",
]

# Where random-resized-crop + flip run: `device` (one batched op on the accelerator, the workers
# only decode and resize to a square `load_size`), `workers` (per sample in the DataLoader
# workers), `auto` (device on CUDA, workers elsewhere: the CPU quick start keeps its results).
Augment = Literal["auto", "device", "workers"]


# The encoder's architecture: what a checkpoint fixes and records in its metadata. Fine-tuning
# and few-shot evaluation of a checkpoint take these from it (a set value must agree), and
# --resume refuses to change them; `image_size` is free (position embeddings are resized).
SHAPE_KEYS = ("patch_size", "width", "depth", "heads", "mlp_ratio", "norm_eps")


@dataclass
class ModelConfig(Frozen):
    """ViT shape. `variant` (Ti/S/B/L/H, optionally with '/patch', e.g. 'B/16') fills width,
    depth and heads; any of them given explicitly overrides the variant. Fine-tuning or
    evaluating a checkpoint takes all but `image_size` from it (see init.checkpoint)."""

    variant: str = ""  # Ti, S, B, L, H or e.g. B/16 (the patch too); "": give the shape below
    image_size: int = 224  # input side in pixels; a multiple of patch_size
    patch_size: int | None = None  # patch side in pixels
    width: int | None = None  # token dimension D
    depth: int | None = None  # transformer blocks
    heads: int | None = None  # attention heads (width must divide by them)
    mlp_ratio: float | None = 4.0  # MLP hidden size / width (null: a loaded checkpoint's)
    norm_eps: float | None = 1e-6  # LayerNorm epsilon (null: a loaded checkpoint's)

    def completed(self) -> ModelConfig:
        """A copy for a new (randomly initialized) encoder: `mlp_ratio` and `norm_eps` left
        null (the checkpoint's, when one is loaded) take their defaults."""
        defaults = {f.name: f.default for f in fields(self) if f.name in ("mlp_ratio", "norm_eps")}
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def resolved(self) -> ModelConfig:
        """A copy with the variant's shape filled in (`from_dict` takes it before the checks):
        explicit width / depth / heads win over it, its '/patch' over `patch_size`."""
        if not self.variant:
            return self
        shape = resolve_variant(self.variant)
        patch = shape.pop("patch_size", self.patch_size)
        given = {k: v for k, v in shape.items() if getattr(self, k) is None}
        return replace(self, patch_size=patch, **given)

    def validate(self) -> None:
        check_positive("model.", self, ("image_size", *SHAPE_KEYS))
        if self.width and self.heads and self.width % self.heads:
            raise ConfigError(
                f"model.width ({self.width}) must be divisible by model.heads ({self.heads})"
            )
        # The MLP's hidden size (a null mlp_ratio is a checkpoint's, checked when it is read).
        if self.width and self.mlp_ratio and int(self.width * self.mlp_ratio) < 1:
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


# What fine-tuning or evaluating a checkpoint takes from it (the loader ignores a config
# file's, the job checks the command line's against it): the encoder's shape and the pixel
# normalisation it was pretrained with.
CHECKPOINT_KEYS = (*(f"model.{k}" for k in ("variant", *SHAPE_KEYS)), "data.mean", "data.std")


@dataclass
class ObjectiveConfig(Frozen):
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
        check_fraction("objective.mask_ratio", self.mask_ratio)
        if min(self.probs) < 0 or not math.isclose(sum(self.probs), 1.0, abs_tol=1e-6):
            raise ConfigError(f"objective.probs: must be >= 0 and sum to 1, got {self.probs}")
        check_min("objective.", self, ("decoder_depth", "decoder_width", "decoder_heads"), 0)
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
class PretrainDataConfig(Frozen):
    """The pretraining stream: WebDataset shards, random-resized crop and flip."""

    train_shards: str = ""  # shard directory, index JSON or brace pattern
    num_workers: int = -1  # -1: auto, min(8, CPUs // processes per node), in the run plan
    # Sequential lanes every global micro-batch draws from equally (fixed for a run; the sample
    # order depends on it, not on processes or workers): 0 auto, the largest divisor of the
    # micro-batch up to 64 and up to the shard count, or where that does not split over the
    # processes the fewest lanes that do (resuming: the checkpoint's). docs/scaling.md
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
    mean: tuple[float, float, float] = PIXEL_NORM
    std: tuple[float, float, float] = PIXEL_NORM

    def validate(self) -> None:
        check_min("data.", self, ("shuffle_buffer", "lanes"), 0)
        check_pixels_norm("data.", self.std, self.crop_scale)
        check_data_loading(self.num_workers, self.load_size)


@dataclass
class PretrainConfig(Frozen):
    """Masked patch prediction pretraining."""

    output_dir: str = "runs/pretrain"  # the run directory
    seed: int = 0  # every random stream's seed derives from it (ssl_vit.seeds)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    # The few-shot monitor (on when fewshot.train is set); normalized as data.mean / data.std.
    fewshot: FewshotEvalConfig = field(default_factory=FewshotEvalConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    # Experiment trackers (Accelerate's): tensorboard, wandb, mlflow, comet_ml, aim, ... Each
    # metrics.jsonl row also goes to them, from the main process; offline unless configured.
    trackers: list[str] = field(default_factory=list)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)

    def resolved(self) -> PretrainConfig:
        """The copy `from_dict` checks: trackers without repeats, a new encoder's defaults."""
        return replace(self, trackers=unique(self.trackers), model=self.model.completed())

    def validate(self) -> None:
        check_seed(self.seed)
        check_trackers(self.trackers)
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
class FinetuneDataConfig(Frozen):
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
    # Normalization of [0, 1] pixels. From a checkpoint: the one stored with it (its
    # pretraining's); a checkpoint that stores none: the value given here (null: 0.5).
    mean: tuple[float, float, float] | None = PIXEL_NORM
    std: tuple[float, float, float] | None = PIXEL_NORM
    max_eval: int = 0  # evaluate on the first N images only (0: the whole split)
    # A label budget: train on K images per class of data.train (0: every label), the same
    # class-balanced subset for every init, seed and process count (ssl_vit.data.labelled).
    labels_per_class: int = 0
    labels_seed: int = 0  # which K per class (smaller budgets are inside larger ones)
    # How the labelled images are chosen (beyond the paper, issue 49): balanced is the
    # labels_per_class subset above; random and typiclust pick `labels_budget` images of
    # data.train without reading their labels (a user's question: which N images to label),
    # uniformly or by TypiClust on the init encoder's features (`ssl-vit select`'s), seeded by
    # labels_seed.
    labels_select: Literal["balanced", "random", "typiclust"] = "balanced"
    labels_budget: int = 0  # images labelled in all, with labels_select random or typiclust
    record_keys: bool = False  # append each rank's consumed sample keys to keys_rank{R}.txt

    def validate(self) -> None:
        keys = ("shuffle_buffer", "lanes", "max_eval", "labels_per_class", "labels_budget")
        check_min("data.", self, keys, 0)
        if self.labels_select == "balanced" and self.labels_budget:
            raise ConfigError(
                f"data.labels_budget={self.labels_budget}: with data.labels_select=random or "
                "typiclust only (balanced draws data.labels_per_class images of each class)"
            )
        if self.labels_select != "balanced" and self.labels_per_class:
            raise ConfigError(
                f"data.labels_per_class={self.labels_per_class}: with data.labels_select="
                f"{self.labels_select}, which picks data.labels_budget images in all; set one"
            )
        if self.labels_select != "balanced" and not self.labels_budget:
            raise ConfigError(
                f"data.labels_budget: the number of images data.labels_select="
                f"{self.labels_select} picks, >= 1; got {self.labels_budget}"
            )
        check_pixels_norm("data.", self.std, self.crop_scale)
        check_data_loading(self.num_workers, self.load_size)


@dataclass
class InitConfig(Frozen):
    """The encoder fine-tuning starts from."""

    # A pretraining run directory or checkpoint (its newest valid one is used), an
    # encoder.safetensors, timm / transformers weights; `none`: random init (from scratch).
    # The encoder's shape (model.*, all but image_size) and pixel normalisation (data.mean,
    # data.std) are then the checkpoint's: a config file's are ignored, given ones must agree.
    checkpoint: str = "none"
    # How position embeddings are resized when model.image_size differs from the checkpoint's.
    pos_interp: Literal["bilinear", "bicubic"] = "bicubic"
    # auto: an ssl-vit checkpoint, timm ViT weights or a transformers ViT directory, detected
    format: Literal["auto", "ssl_vit", "timm", "hf"] = "auto"
    # zero: the paper's zero-initialized head (3.2). probe (beyond the paper, LP-FT): the head
    # starts as the frozen encoder's ridge probe on the labelled images (ssl_vit.train.probe_head).
    head: Literal["zero", "probe"] = "zero"

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
class FinetuneConfig(Frozen):
    """Fine-tuning of an encoder as a classifier (zero-initialized linear head)."""

    output_dir: str = "runs/finetune"  # the run directory
    # A label the report shows beside the encoder's name, keeping these runs apart from the
    # encoder's other fine-tunes (the study tags its equal-compute controls `control`).
    tag: str = ""
    seed: int = 0
    pool: Literal["cls", "gap"] = "cls"  # the head reads the [class] token or the patch mean
    model: ModelConfig = field(default_factory=ModelConfig)
    init: InitConfig = field(default_factory=InitConfig)
    data: FinetuneDataConfig = field(default_factory=FinetuneDataConfig)
    train: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    ema: float = 0.0  # Polyak averaging factor (0: off), e.g. 0.9999
    eval_every: int = 500  # data.eval every N steps, whatever train.log_every (0: at the end)
    # paper (B.1.1) or modern (MAE Table 9): the defaults of `parts` and of train.lr,
    # weight_decay, betas that are not given explicitly (see ssl_vit.config.recipe).
    recipe: Literal["paper", "modern"] = "paper"
    parts: RecipeParts = field(default_factory=RecipeParts)
    # Self-training on unlabelled images with a fine-tuned teacher (beyond the paper).
    distill: DistillConfig = field(default_factory=DistillConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    trackers: list[str] = field(default_factory=list)  # experiment trackers, as pretraining's
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)

    # The loader merges the recipe's preset under the YAML file and the overrides.
    preset_defaults = staticmethod(recipe_defaults)
    checkpoint_keys: ClassVar = CHECKPOINT_KEYS  # from init.checkpoint when there is one

    def resolved(self) -> FinetuneConfig:
        """The copy `from_dict` checks: trackers without repeats; from scratch, a new encoder's
        defaults (else null keys are the checkpoint's: the job reads them)."""
        return replace(self, trackers=unique(self.trackers), **new_encoder(self))

    def validate(self) -> None:
        check_seed(self.seed)
        check_trackers(self.trackers)
        if not self.data.train:
            raise ConfigError("data.train: required (shards, image folder or HF dataset)")
        check_fraction("ema", self.ema, low_open=False)
        check_min("", self, ("eval_every",), 0)
        check_adamw_lr(self.parts, self.train.lr, self.train.batch_size)
        if self.data.labels_select == "typiclust" and self.init.scratch:
            raise ConfigError(
                "data.labels_select=typiclust: picks by the init encoder's features; "
                "init.checkpoint=none has none (use random, or a pretrained init.checkpoint)"
            )
        if self.parts.randaugment and self.data.augment == "device":
            raise ConfigError(
                "data.augment=device: parts.randaugment runs per sample in the loader workers "
                "after the crop; use data.augment=workers (or auto)"
            )


@dataclass
class FewshotDataConfig(Frozen):
    """The encoder's input normalization (from a checkpoint: the data.mean / data.std stored
    with it, its pretraining's; a checkpoint that stores none: the value given here, null: 0.5);
    the labelled sources are fewshot.train and fewshot.eval."""

    mean: tuple[float, float, float] | None = PIXEL_NORM
    std: tuple[float, float, float] | None = PIXEL_NORM

    def validate(self) -> None:
        check_pixels_norm("data.", self.std)


@dataclass
class FewshotConfig(Frozen):
    """Few-shot linear evaluation of a frozen encoder (`--checkpoint`, recorded as
    init.checkpoint)."""

    output_dir: str = "runs/fewshot"  # the run directory
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    # How --checkpoint is read (init.format) and resized (init.pos_interp), as fine-tuning's.
    init: InitConfig = field(default_factory=InitConfig)
    data: FewshotDataConfig = field(default_factory=FewshotDataConfig)
    fewshot: FewshotEvalConfig = field(default_factory=FewshotEvalConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)  # of the feature extraction
    trackers: list[str] = field(default_factory=list)  # experiment trackers, as pretraining's
    timeouts: DataTimeoutConfig = field(default_factory=DataTimeoutConfig)

    checkpoint_keys: ClassVar = CHECKPOINT_KEYS  # from init.checkpoint (--checkpoint)

    def resolved(self) -> FewshotConfig:
        """As `FinetuneConfig.resolved` (--checkpoint random: a new encoder)."""
        return replace(self, trackers=unique(self.trackers), **new_encoder(self))

    def validate(self) -> None:
        check_seed(self.seed)
        check_trackers(self.trackers)
        if not self.fewshot.train or not self.fewshot.eval:
            raise ConfigError(
                "fewshot.train and fewshot.eval: both required for few-shot evaluation"
            )
        if self.fewshot.every:
            raise ConfigError("fewshot.every: pretraining only (this job evaluates once)")


def unique(names: list[str]) -> list[str]:
    """`names` in order, without repeats (trackers)."""
    return list(dict.fromkeys(names))


def new_encoder(cfg: Any) -> dict[str, Any]:
    """The `replace` arguments completing a job config's encoder shape and pixel normalisation
    with their defaults when it starts from random init (`init.checkpoint` none); nothing
    otherwise (null keys are the checkpoint's)."""
    if not cfg.init.scratch:
        return {}
    return {"model": cfg.model.completed(), "data": completed_pixel_norm(cfg.data)}
