"""Renamed config keys: an old file or override loads as the new key would, with one
deprecation line naming both; old and new together is one error."""

from __future__ import annotations

import logging

import pytest
import yaml

from ssl_vit.config import (
    ConfigError,
    FewshotConfig,
    FinetuneConfig,
    PretrainConfig,
    from_dict,
    load_config,
    to_dict,
)
from ssl_vit.config.loader import migrate

REQUIRED = {
    PretrainConfig: {"data": {"train_shards": "x"}},
    FinetuneConfig: {"data": {"train": "x"}},
    FewshotConfig: {"fewshot": {"train": "x", "eval": "y"}},
}
# A value for each new place that is not its default (so a move that drops it would show).
NEW_VALUES = {
    "compile.enabled": True,
    "compile.mode": "max-autotune",
    "timeouts.dist_s": 12.0,
    "timeouts.stop_s": 7.0,
    "timeouts.data_s": 9.0,
    "trackers": [],
    "fewshot.train": "t",
    "fewshot.eval": "e",
    "fewshot.batch_size": 3,
    "fewshot.num_workers": 0,
    "fewshot.max_eval": 11,
    "fewshot.shots": [2, "all"],
    "fewshot.seeds": [4],
    "fewshot.l2_reg": [2.0],
    "fewshot.standardize": False,
    "fewshot.pool": "gap",
    "fewshot.layers": [0, -1],
    "fewshot.concat_last": 2,
    "fewshot.knn_k": 5,
    "fewshot.knn_train": 7,
    "fewshot.knn_temperature": 0.5,
    "init.pos_interp": "bilinear",
    "init.format": "timm",
}
MOVES = [(cls, m) for cls in REQUIRED for m in cls.moved_keys if m.new is not None]


def _nested(path: str, value) -> dict:
    *parents, leaf = path.split(".")
    out = node = {}
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _deprecations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


@pytest.mark.parametrize(("cls", "move"), MOVES, ids=[f"{c.__name__}:{m.old}" for c, m in MOVES])
def test_an_old_key_loads_as_the_new_one_with_one_line(cls, move, tmp_path, caplog):
    value = NEW_VALUES[move.new]
    old_value = value if move.convert is None else value == ["tensorboard"]
    base = to_dict_required(cls)
    if move.new.startswith("fewshot."):  # the required sources: given once, at either place
        base["fewshot"].pop(move.new.split(".")[1], None)
    new = load_config(cls, _write(tmp_path, merge(base, _nested(move.new, value))))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        old = load_config(cls, _write(tmp_path, merge(base, _nested(move.old, old_value))))
    assert to_dict(old) == to_dict(new)
    assert _deprecations(caplog) == [f"config key {move.old} is deprecated: use {move.new}"]
    caplog.clear()  # the same key as an override: the same, one line
    with caplog.at_level(logging.WARNING):
        over = load_config(cls, _write(tmp_path, base), [f"{move.old}={yaml.safe_dump(old_value)}"])
    assert to_dict(over) == to_dict(new) and len(_deprecations(caplog)) == 1


def to_dict_required(cls) -> dict:
    return {k: dict(v) for k, v in REQUIRED[cls].items()}


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_old_fewshot_job_file_loads_as_the_shipped_one(tmp_path, caplog):
    """The few-shot smoke config as it was before `fewshot:` became one section."""
    old = {
        "output_dir": "runs/fewshot-smoke",
        "model": {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "heads": 2},
        "data": {"train": "data/shapes", "eval": "data/shapes-test", "num_workers": 0},
        "shots": [1, 5],
        "seeds": [0, 1],
        "l2_reg": [1024.0, 1.0],
    }
    with caplog.at_level(logging.WARNING):
        cfg = load_config(FewshotConfig, _write(tmp_path, old))
    assert to_dict(cfg) == to_dict(load_config(FewshotConfig, "fewshot/smoke"))
    assert len(_deprecations(caplog)) == 6  # one per moved key


def test_pretraining_momentum_is_dropped_with_one_line(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(PretrainConfig, None, ["data.train_shards=x", "train.momentum=0.5"])
    assert not hasattr(cfg.train, "momentum")
    assert _deprecations(caplog) == [
        "config key train.momentum is deprecated and ignored (pretraining uses Adam)"
    ]
    assert (
        load_config(FinetuneConfig, None, ["data.train=x", "train.momentum=0.5"]).train.momentum
        == 0.5
    )


def test_old_and_new_together_is_one_error_naming_both():
    with pytest.raises(ConfigError) as err:
        load_config(FewshotConfig, None, ["fewshot.train=x", "data.train=y", "fewshot.eval=z"])
    assert str(err.value) == "data.train and fewshot.train: the same setting twice " \
        "(data.train is its old name)"  # fmt: skip


def test_an_old_list_and_a_new_one_are_an_error_but_old_tracker_keys_join(caplog):
    with pytest.raises(ConfigError, match="shots and fewshot.shots: the same setting twice"):
        load_config(FewshotConfig, None, ["fewshot.train=x", "fewshot.eval=y", "shots=[1]",
                                          "fewshot.shots=[2]"])  # fmt: skip
    data = {"data": {"train_shards": "x"}, "train": {"log_with": [], "tensorboard": False}}
    assert from_dict(PretrainConfig, data).trackers == []


def test_an_old_override_wins_over_the_files_new_key(tmp_path):
    path = _write(tmp_path, {"fewshot": {"train": "x", "eval": "y", "shots": [1]}})
    assert load_config(FewshotConfig, path, ["shots=[3]"]).fewshot.shots == [3]


def test_migrate_leaves_the_callers_dict_alone():
    data = {"train": {"compile": True}}
    assert migrate(PretrainConfig, data) == {"train": {}, "compile": {"enabled": True}}
    assert data == {"train": {"compile": True}}
