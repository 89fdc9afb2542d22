"""Typed configs: schemas of the jobs and the strict YAML loader."""

from ssl_vit.config.loader import (
    ConfigError,
    from_dict,
    load_config,
    parse_overrides,
    save_config,
    to_dict,
)
from ssl_vit.config.schema import (
    FewshotConfig,
    FewshotDataConfig,
    FewshotEvalConfig,
    FinetuneConfig,
    FinetuneDataConfig,
    InitConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    PretrainConfig,
    PretrainDataConfig,
)
from ssl_vit.config.study import (
    StudyBudget,
    StudyConfig,
    StudyDataConfig,
    StudyRecipe,
    StudyVariant,
)

__all__ = [
    "ConfigError",
    "from_dict",
    "load_config",
    "parse_overrides",
    "save_config",
    "to_dict",
    "FewshotConfig",
    "FewshotDataConfig",
    "FewshotEvalConfig",
    "FinetuneConfig",
    "FinetuneDataConfig",
    "InitConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "PretrainConfig",
    "PretrainDataConfig",
    "StudyBudget",
    "StudyConfig",
    "StudyDataConfig",
    "StudyRecipe",
    "StudyVariant",
]
