"""Typed configs: unknown keys and wrong types stop a job with a one-line error."""

from pathlib import Path

import pytest

from ssl_vit.config import ConfigError, PretrainConfig, load_config, parse_overrides


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_overrides_are_typed_and_nested(tmp_path):
    path = write(tmp_path, "data: {train_shards: x}\nmodel: {width: 64, depth: 2, heads: 2}\n")
    cfg = load_config(
        PretrainConfig,
        path,
        ["train.steps=7", "objective.probs=[1, 0, 0]", "model.image_size=32", "train.lr=1e-3"],
    )
    assert cfg.train.steps == 7 and cfg.model.width == 64 and cfg.model.image_size == 32
    assert cfg.objective.probs == (1.0, 0.0, 0.0) and isinstance(cfg.train.lr, float)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'"),
        ("nope=1", "unknown config key 'nope'"),
        ("train.steps=abc", "train.steps: expected int"),
        ("train.steps=1.5", "train.steps: expected int"),
        ("data.hflip=3", "data.hflip: expected true/false"),
        ("objective.probs=[0.5, 0.5]", "objective.probs: expected 3 values"),
        ("objective.probs=[0.5, 0.2, 0.2]", "objective.probs: must be >= 0 and sum to 1"),
        ("model.pool=x", "unknown config key 'model.pool'"),
        ("train.mixed_precision=fp8", "train.mixed_precision: expected one of"),
        ("model.variant=Q", "model.variant: unknown 'Q'"),
        ("model.image_size=30", "multiple of model.patch_size"),
    ],
)
def test_bad_values_name_the_key(tmp_path, override, message):
    path = write(tmp_path, "data: {train_shards: x}\nmodel: {variant: Ti/16}\n")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_config(PretrainConfig, path, [override])
    assert "\n" not in str(e.value)


def test_variant_fills_shape_and_explicit_values_win(tmp_path):
    cfg = load_config(
        PretrainConfig, None, ["data.train_shards=x", "model.variant=B/16", "model.depth=6"]
    )
    assert (cfg.model.width, cfg.model.depth, cfg.model.heads) == (768, 6, 12)
    assert cfg.model.patch_size == 16


def test_missing_file_and_required_key(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(PretrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="data.train_shards: required"):
        load_config(PretrainConfig, None, [])


def test_parse_overrides_rejects_garbage(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key.sub=value$"):
        parse_overrides(["train.steps"])
    with pytest.raises(ConfigError, match="value: a path goes after its flag"):
        parse_overrides([str(tmp_path)])  # `ssl-vit predict runs/ft photos`
    assert parse_overrides(["a.b=[1, 2]", "a.c=x"]) == {"a": {"b": [1, 2], "c": "x"}}


def test_all_shipped_configs_load():
    from pathlib import Path

    from ssl_vit.config import FewshotConfig, FinetuneConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    schemas = {"pretrain": PretrainConfig, "finetune": FinetuneConfig, "fewshot": FewshotConfig}
    found = 0
    for kind, schema in schemas.items():
        for path in sorted((root / kind).glob("*.yaml")):
            load_config(schema, path)
            found += 1
    assert found >= 3


def test_loaded_predict_and_study_configs_are_frozen():
    """predict's and the study's configs are read-only once checked, as the jobs' (every
    section, a list's items too: the study's variants)."""
    from ssl_vit.config import StudyConfig
    from ssl_vit.config.frozen import FrozenConfigError
    from ssl_vit.config.predict import PredictConfig

    given = ["checkpoint=c", "source=s", "output_dir=o"]
    predict = load_config(PredictConfig, None, given)
    with pytest.raises(FrozenConfigError, match="frozen after its checks"):
        predict.top_k = 1
    with pytest.raises(FrozenConfigError):
        predict.timeouts.data_s = 1.0
    study = load_config(StudyConfig, Path(__file__).parent.parent / "configs/study/quickstart.yaml")
    with pytest.raises(FrozenConfigError, match="frozen after its checks"):
        study.seed = 1
    with pytest.raises(FrozenConfigError):
        study.variants[0].name = "other"
    with pytest.raises(FrozenConfigError):
        study.quick.pretrain = []
