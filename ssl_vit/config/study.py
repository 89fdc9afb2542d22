"""Config schema of the pretraining study (scripts/study.py): which variants, which data, which
budget. The jobs themselves are configured by their own YAML files plus overrides; the study
injects the data paths, the model shape and each variant's objective into them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from ssl_vit.config.frozen import Frozen
from ssl_vit.config.loader import ConfigError, parse_overrides
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
from ssl_vit.jobs import STAGES

__all__ = [
    "StudyBudget",
    "StudyConfig",
    "StudyDataConfig",
    "StudyLabels",
    "StudyRecipe",
    "StudyVariant",
    "check_selected",
    "schedule",
]


@dataclass
class StudyDataConfig(Frozen):
    """The study's two labelled sources, given to every job."""

    train: str = ""  # labelled: pretraining, few-shot support images and fine-tuning
    eval: str = ""  # labelled: few-shot and fine-tuning evaluation


@dataclass
class StudyVariant(Frozen):
    """One pretraining variant: its name, its `objective` section, and how its encoder is
    fine-tuned and self-trained."""

    name: str = ""  # run directory name, e.g. mean_color_50
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Overrides of this encoder's fine-tunes (and self-trainings), after the label budget's:
    # e.g. a gentler fine-tune (`parts.layer_decay=0.7`) for an encoder that loses its features.
    finetune: list[str] = field(default_factory=list)
    # Whether the label budgets' `self_train` applies to this encoder (False: fine-tunes only,
    # e.g. to self-train only the better encoder of the study).
    self_train: bool = True


@dataclass
class StudyRecipe(Frozen):
    """A fine-tuning recipe of the study: every variant and the scratch baseline are fine-tuned
    once with it, in finetune/<variant>-<name>, with `finetune` (`key.sub=value`, e.g.
    `recipe=modern`) applied on top of the budget's fine-tuning overrides."""

    name: str = ""  # a simple identifier: it ends run directory names and column headers
    finetune: list[str] = field(default_factory=list)  # overrides after the budget's


@dataclass
class StudyLabels(Frozen):
    """A label budget: every encoder is fine-tuned on `per_class` images per class of data.train
    (`data.labels_per_class`; 0: every label), with `finetune` overrides after the budget's and
    the recipe's (e.g. fewer steps for a small labelled set)."""

    per_class: int = 0  # labelled images per class (0: every label)
    # Beyond the paper (issue 49: which N images should a user label?): `budget` images of
    # data.train picked without their labels (`data.labels_select` random or typiclust,
    # `data.labels_budget`), each pretrained encoder fine-tuned on them (not the scratch one:
    # typiclust picks by the encoder's features). A typiclust entry needs its equal-compute
    # control: the random entry of the same budget and `finetune`.
    budget: int = 0
    select: Literal["balanced", "random", "typiclust"] = "balanced"  # balanced: per_class
    finetune: list[str] = field(default_factory=list)  # overrides after the budget's and recipe's
    # Self-training at this budget (beyond the paper): after each pretrained encoder's
    # fine-tune (the teacher, per seed), a fine-tune of the same encoder with distill.teacher
    # = that fine-tune and distill.unlabelled = data.train, these overrides after `finetune`'s
    # (e.g. train.steps, distill.weight). null: none.
    self_train: list[str] | None = None
    # The online semi-supervised stage at this budget (beyond the paper, issue 50): each
    # pretrained encoder fine-tuned with distill.mode=online and distill.unlabelled =
    # data.train, these overrides after `finetune`'s (e.g. train.steps, distill.threshold).
    # Beside its equal-compute control: the same fine-tune without distill.* (shared with
    # `self_train` where their other overrides agree). With none but distill.* the control is
    # the budget's own fine-tune of that seed (the same command): no run of its own. null: none.
    semi: list[str] | None = None


def schedule(overrides: list[str]) -> list[str]:
    """The overrides a method's control keeps: all but the distill.* ones."""
    return [o for o in overrides if not o.startswith("distill.")]


@dataclass
class StudyBudget(Frozen):
    """One preset: the model and how much each job trains (`key.sub=value` overrides)."""

    output_dir: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)  # pretraining and few-shot shape
    finetune_image_size: int = 0  # fine-tuning resolution (0: as pretraining)
    pretrain_fewshot_every: int = 0  # also evaluate few-shot every N pretraining steps
    pretrain: list[str] = field(default_factory=list)
    fewshot: list[str] = field(default_factory=list)
    finetune: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.finetune_image_size < 0 or self.pretrain_fewshot_every < 0:
            raise ConfigError(
                "finetune_image_size, pretrain_fewshot_every: must be >= 0, got "
                f"{self.finetune_image_size}, {self.pretrain_fewshot_every}"
            )
        for job in STAGES:
            try:  # each is `key.sub=value`; the study checks the keys before its first job
                parse_overrides(getattr(self, job.name))
            except ConfigError as e:
                raise ConfigError(f"{job.name}: {e}") from None


@dataclass
class StudyConfig(Frozen):
    """The study: variants x (pretrain -> few-shot -> fine-tune), plus the random-init rows."""

    data: StudyDataConfig = field(default_factory=StudyDataConfig)
    variants: list[StudyVariant] = field(default_factory=list)
    # Base YAML of each job; the budget's overrides and the study's values go on top.
    pretrain_config: str = ""
    fewshot_config: str = ""
    finetune_config: str = ""
    full: StudyBudget = field(default_factory=StudyBudget)
    quick: StudyBudget = field(default_factory=StudyBudget)
    gpu: StudyBudget = field(default_factory=StudyBudget)  # one GPU, one chain in minutes
    # Fine-tuning recipes compared (empty: one fine-tune per variant, the base config's recipe).
    recipes: list[StudyRecipe] = field(default_factory=list)
    # Every job's `seed` (pretraining, the random-init encoder, fine-tuning), after the budget's
    # overrides: another seed of the whole study, in another output_dir. None: the configs'.
    # The few-shot draws keep their own `seeds`.
    seed: int | None = None
    # Label budgets: every encoder is fine-tuned on each (per recipe), in
    # finetune/<name>[-<recipe>]-l<K>[-s<seed>]. Empty: every label, one fine-tune.
    labels: list[StudyLabels] = field(default_factory=list)
    # Fine-tuning seeds: each fine-tune once per seed (the label subset stays the same).
    finetune_seeds: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if not self.data.train or not self.data.eval:
            raise ConfigError("data.train and data.eval: both required (labelled sources)")
        names = [v.name for v in self.variants]
        if not names or "" in names or len(set(names)) != len(names):
            raise ConfigError(f"variants: need unique non-empty names, got {names}")
        for name in names:  # each names a run directory inside the study's output_dir
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
                raise ConfigError(
                    f"variants: name {name!r} must be a simple name (letters, digits, _ . -; "
                    "no '/' or '..'): it names a run directory in the study folder"
                )
        for v in self.variants:
            try:  # `key.sub=value` each; the study checks the keys before its first job
                parse_overrides(v.finetune)
            except ConfigError as e:
                raise ConfigError(f"variants: {v.name}: finetune: {e}") from None
        if {"random", "scratch", "baseline"} & set(names):  # `--only baseline` runs those
            raise ConfigError(
                "variants: 'random', 'scratch' and 'baseline' name the random-init baselines"
            )
        check_selected(self.labels)
        budgets = [b.per_class for b in self.labels if b.select == "balanced"]
        for key, values in (
            ("labels: per_class", budgets),
            ("finetune_seeds", self.finetune_seeds),
        ):
            if len(set(values)) != len(values) or any(v < 0 for v in values):
                raise ConfigError(f"{key}: need distinct values >= 0, got {values}")
        recipes = [r.name for r in self.recipes]
        if not all(r.isidentifier() for r in recipes) or len(set(recipes)) != len(recipes):
            raise ConfigError(
                f"recipes: need unique names that are simple identifiers (letters, digits, _), "
                f"got {recipes}"
            )


def check_selected(labels: list[StudyLabels]) -> None:
    """The label entries picked without labels (`select` random or typiclust): a budget, no
    per_class or self_train, one entry per budget and method, and each typiclust entry beside
    its equal-compute control (the random one of its budget and fine-tuning overrides): its
    gain is only read against that row."""
    picked = [b for b in labels if b.select != "balanced"]
    for b in labels:
        what = f"labels: {{budget: {b.budget}, select: {b.select}}}"
        if b.select == "balanced" and b.budget:
            raise ConfigError(f"{what}: budget needs select: random or typiclust")
        methods = b.self_train is not None or b.semi is not None
        if b.select != "balanced" and (b.budget < 1 or b.per_class or methods):
            raise ConfigError(f"{what}: needs a budget >= 1, and no per_class, self_train or semi")
    pairs = [(b.budget, b.select) for b in picked]
    if len(set(pairs)) != len(pairs):
        raise ConfigError(f"labels: one entry per budget and select, got {pairs}")
    for b in (b for b in picked if b.select == "typiclust"):
        if not any(c.select == "random" and (c.budget, c.finetune) == (b.budget, b.finetune)
                   for c in picked):  # fmt: skip
            raise ConfigError(
                f"labels: {{budget: {b.budget}, select: typiclust}} needs its equal-compute "
                f"control {{budget: {b.budget}, select: random}} with the same finetune "
                f"{b.finetune}: a method's gain is only read against its control"
            )
