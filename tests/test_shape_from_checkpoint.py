"""Fine-tuning and few-shot evaluation of a checkpoint take its encoder's shape and pixel
normalisation from it (issue 35): a shipped config's shape serves from-scratch runs only."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from conftest import pipeline

from ssl_vit.config import ConfigError, FewshotConfig, FinetuneConfig, load_config, to_dict
from ssl_vit.config.frozen import validated
from ssl_vit.config.schema import SHAPE_KEYS, FinetuneDataConfig
from ssl_vit.model import ViT
from ssl_vit.train import preflight
from ssl_vit.train.checkpoint import PixelStats, read_pixel_norm, save_encoder
from ssl_vit.train.classifier_file import read_classifier_spec

ROOT = Path(__file__).resolve().parents[1]
FINETUNE, FEWSHOT = ROOT / "configs/finetune/smoke.yaml", ROOT / "configs/fewshot/smoke.yaml"
# Another shape than both smoke configs' (patch 4, width 32, depth 2, heads 2, mlp_ratio 4).
SHAPE = {"patch_size": 8, "width": 24, "depth": 1, "heads": 3, "mlp_ratio": 2.0}
MEAN, STD = (0.4, 0.45, 0.5), (0.2, 0.25, 0.3)


@pytest.fixture(scope="module")
def pretrained(synthetic_shards, tmp_path_factory) -> Path:
    """A 2-step pretraining run of SHAPE with a non-default pixel normalisation."""
    out = tmp_path_factory.mktemp("pretrain")
    pipeline("pretrain")(
        [
            "--config",
            str(ROOT / "configs/pretrain/smoke.yaml"),
            f"data.train_shards={synthetic_shards}",
            f"output_dir={out}",
            *(f"model.{k}={v}" for k, v in SHAPE.items()),
            f"data.mean={list(MEAN)}",
            f"data.std={list(STD)}",
            "train.steps=2",
            "train.checkpoint_every=2",
            "train.log_every=1",
        ]
    )
    return out


def finetune_args(run: Path, shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(FINETUNE),
        f"init.checkpoint={run}",
        "model.image_size=32",
        f"data.train={shards}",
        "data.eval=",
        f"output_dir={out}",
        "train.steps=2",
        "train.log_every=1",
        *extra,
    ]


def test_checkpoint_stores_the_pretraining_pixel_normalisation(pretrained):
    assert read_pixel_norm(pretrained / "checkpoints" / "step_00000002") == (MEAN, STD)


def test_finetune_takes_shape_and_normalisation_from_the_checkpoint(
    pretrained, synthetic_shards, tmp_path
):
    pipeline("finetune")(finetune_args(pretrained, synthetic_shards, tmp_path))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert {k: saved["model"][k] for k in SHAPE} == SHAPE and saved["model"]["image_size"] == 32
    assert saved["model"]["norm_eps"] == 1e-6
    assert (tuple(saved["data"]["mean"]), tuple(saved["data"]["std"])) == (MEAN, STD)
    spec = read_classifier_spec(tmp_path)
    assert (spec.mean, spec.std) == (MEAN, STD)
    assert {k: spec.model_config[k] for k in SHAPE} == SHAPE
    # Its own checkpoints store the same normalisation (a fine-tune of a fine-tune keeps it).
    assert read_pixel_norm(tmp_path / "checkpoints" / "step_00000002") == (MEAN, STD)


def test_finetune_resume_keeps_the_checkpoint_shape(pretrained, synthetic_shards, tmp_path):
    main = pipeline("finetune")
    main(finetune_args(pretrained, synthetic_shards, tmp_path, "train.checkpoint_every=1"))
    results = main(
        finetune_args(pretrained, synthetic_shards, tmp_path, "train.steps=3", "--resume")
    )
    assert results["step"] == 3


def test_given_shape_or_normalisation_that_disagrees_is_one_line(
    pretrained, synthetic_shards, tmp_path
):
    main = pipeline("finetune")
    ckpt = pretrained / "checkpoints" / "step_00000002"
    cases = {
        "model.width=64": f"model.width=64 disagrees with the checkpoint {ckpt} (width 24)",
        "model.variant=Ti": (
            "model.width=192 (model.variant=Ti), model.depth=12 (model.variant=Ti) disagree "
            f"with the checkpoint {ckpt} (width 24, depth 1)"
        ),
        "model.mlp_ratio=4": f"model.mlp_ratio=4.0 disagrees with the checkpoint {ckpt} "
        "(mlp_ratio 2.0)",
        "data.mean=[0.5,0.5,0.5]": f"data.mean=[0.5, 0.5, 0.5] disagrees with the checkpoint "
        f"{ckpt} (mean {list(MEAN)})",
    }
    for override, line in cases.items():
        with pytest.raises(SystemExit) as e:
            main(finetune_args(pretrained, synthetic_shards, tmp_path, override))
        assert str(e.value) == f"error: {line}"
    assert not (tmp_path / "config.yaml").exists()
    # Agreeing values (the old README's SHAPE=... nulls included) are fine.
    agree = [*(f"model.{k}={v}" for k, v in SHAPE.items()), f"data.std={list(STD)}"]
    main(finetune_args(pretrained, synthetic_shards, tmp_path, *agree, "model.depth=null"))


@pytest.mark.system
def test_finetune_from_scratch_keeps_the_config_file_shape(synthetic_shards, tmp_path):
    pipeline("finetune")(finetune_args("none", synthetic_shards, tmp_path))
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    smoke = yaml.safe_load(FINETUNE.read_text())["model"]
    assert {k: saved["model"][k] for k in ("patch_size", "width", "depth", "heads")} == {
        k: smoke[k] for k in ("patch_size", "width", "depth", "heads")
    }
    assert (saved["model"]["mlp_ratio"], saved["model"]["norm_eps"]) == (4.0, 1e-6)
    assert saved["data"]["mean"] == saved["data"]["std"] == [0.5, 0.5, 0.5]


def test_fewshot_takes_shape_and_normalisation_from_the_checkpoint(
    pretrained, synthetic_shards, tmp_path
):
    args = [
        "--checkpoint",
        str(pretrained),
        "--config",
        str(FEWSHOT),
        f"fewshot.train={synthetic_shards}",
        f"fewshot.eval={synthetic_shards}",
        f"output_dir={tmp_path}",
        "fewshot.shots=[1]",
        "fewshot.seeds=[0]",
    ]
    res = pipeline("fewshot")(args)
    assert 0.0 <= res["1shot"] <= 1.0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert {k: saved["model"][k] for k in SHAPE} == SHAPE and saved["model"]["image_size"] == 16
    assert (tuple(saved["data"]["mean"]), tuple(saved["data"]["std"])) == (MEAN, STD)
    assert saved["init"]["checkpoint"] == str(pretrained / "checkpoints" / "step_00000002")
    assert json.loads((tmp_path / "results.json").read_text())["image_size"] == 16
    with pytest.raises(SystemExit, match="model.heads=2 disagrees with the checkpoint"):
        pipeline("fewshot")([*args, "--overwrite", "model.heads=2"])


def test_loader_drops_the_file_shape_only_with_a_checkpoint(tmp_path):
    base = ["data.train=x", "init.checkpoint=runs/x"]
    cfg = load_config(FinetuneConfig, FINETUNE, [*base, "model.width=48"])
    assert cfg.model.width == 48  # given on the command line: checked against the checkpoint
    assert (cfg.model.patch_size, cfg.model.depth, cfg.model.heads) == (None, None, None)
    assert all(getattr(cfg.model, k) is None for k in SHAPE_KEYS if k != "width")
    assert cfg.data.mean is None and cfg.data.std is None and cfg.model.image_size == 24
    scratch = load_config(FinetuneConfig, FINETUNE, ["data.train=x"])
    assert (scratch.model.width, scratch.model.mlp_ratio, scratch.data.mean) == (
        32,
        4.0,
        (0.5, 0.5, 0.5),
    )
    # A checkpoint named in the config file counts as well; `none` on the command line wins.
    own = tmp_path / "ft.yaml"
    own.write_text("init: {checkpoint: runs/x}\nmodel: {variant: Ti, image_size: 32}\n")
    cfg = load_config(FinetuneConfig, own, ["data.train=x"])
    assert cfg.model.variant == "" and cfg.model.width is None
    cfg = load_config(FinetuneConfig, own, ["data.train=x", "init.checkpoint=none"])
    assert (cfg.model.variant, cfg.model.width) == ("Ti", 192)
    few = load_config(FewshotConfig, FEWSHOT, ['init.checkpoint="runs/a b"', "fewshot.train=x"])
    assert few.model.width is None and few.data.mean is None
    assert few.init.checkpoint == "runs/a b"


def test_a_checkpoint_without_normalisation_uses_the_given_one_or_the_default(tmp_path):
    """Older runs and imported weights store no pixel normalisation: the command line's, else
    0.5; a stored one fills what is not given."""
    vit = ViT(16, 4, 32, 2, 2)
    shape = {"variant": "", "image_size": 16, "patch_size": 4, "width": 32, "depth": 2}
    shape.update(heads=2, mlp_ratio=4.0)
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    save_encoder(vit, tmp_path / "old" / "encoder.safetensors", shape)
    given = FinetuneDataConfig(train="x", mean=None, std=(0.3, 0.3, 0.3))
    data, where = preflight.resolve_pixel_norm(given, str(tmp_path / "old"))
    assert "stores none" in where and given.mean is None  # a resolved copy
    assert (data.mean, data.std) == ((0.5, 0.5, 0.5), (0.3, 0.3, 0.3))
    save_encoder(vit, tmp_path / "new" / "encoder.safetensors", shape, PixelStats(MEAN, STD))
    given = FinetuneDataConfig(train="x", mean=None, std=None)
    data, where = preflight.resolve_pixel_norm(given, str(tmp_path / "new"))
    assert where == "the checkpoint's"
    assert (data.mean, data.std) == (MEAN, STD)


def test_a_checkpoint_whose_shape_breaks_a_config_check_is_refused_by_that_check(tmp_path):
    """The config resolved from a checkpoint is checked as a loaded one: its patch (4) at the
    fine-tuning model.image_size (18) breaks the model's check, named by its keys, in one line
    (before: the copy was re-frozen unchecked and only building the encoder refused it)."""
    shape = {"variant": "", "image_size": 16, "patch_size": 4, "width": 32, "depth": 2}
    save_encoder(ViT(16, 4, 32, 2, 2), tmp_path / "encoder.safetensors", {**shape, "heads": 2})
    ckpt = str(tmp_path / "encoder.safetensors")
    given = ["data.train=x", f"init.checkpoint={ckpt}", "model.image_size=18"]
    cfg = load_config(FinetuneConfig, None, given)
    with pytest.raises(ConfigError) as e:
        preflight.init_from_checkpoint("init.checkpoint", cfg, ckpt)
    assert "model.image_size (18) must be a multiple of model.patch_size (4)" in str(e.value)
    assert "\n" not in str(e.value)


def test_validate_only_checks(tmp_path):
    """Loading resolves in copies (`resolved()`); `validate()` of a loaded config changes
    nothing, so the checks run again on any changed copy (`frozen.validated`)."""
    cfg = load_config(FinetuneConfig, None, ["data.train=x", "trackers=[]"])
    before = to_dict(cfg)
    validated(cfg)  # frozen: an assignment in any validate() would raise
    assert to_dict(cfg) == before and cfg.model.mlp_ratio == 4.0
    with pytest.raises(ConfigError, match=r"^seed: must be in"):
        validated(dataclasses.replace(cfg, seed=-1))
