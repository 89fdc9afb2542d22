"""Export to / import from timm and transformers: same features both ways, clear errors.

Tiny random models (width 32, depth 2, 16 px, patch 4) whose every weight, LayerNorm
included, is perturbed away from its initialization, so a misplaced tensor cannot hide.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import pipeline
from safetensors.torch import load_file, save_file

from ssl_vit.cli import main as cli
from ssl_vit.config.schema import ModelConfig
from ssl_vit.interop import InteropError, from_hf, from_timm, to_timm
from ssl_vit.model.vit import ViT
from ssl_vit.publish import export_checkpoint, import_weights
from ssl_vit.train.checkpoint import PixelStats, load_encoder, read_pixel_norm, save_encoder
from ssl_vit.train.encoder_init import encoder_from_checkpoint

# The `interop` extra, imported by the tests that use it, not at collection: importing timm,
# transformers and its ViTModel took ~3 s of every xdist worker's start, also of a worker that
# ran none of these tests.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("timm", "transformers")),
    reason="the interop extra (timm, transformers) is not installed",
)

CFG = {
    "variant": "",
    "image_size": 16,
    "patch_size": 4,
    "width": 32,
    "depth": 2,
    "heads": 2,
    "mlp_ratio": 4.0,
    "norm_eps": 1e-6,
}
TOL = 1e-5


def perturb(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return module.eval()


def images(size: int, n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """[class] token output and patch outputs agree to float tolerance."""
    assert ours.shape == theirs.shape
    assert (ours[:, 0] - theirs[:, 0]).abs().max() < TOL
    assert (ours[:, 1:] - theirs[:, 1:]).abs().max() < TOL


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, ViT]:
    """An ssl-vit encoder directory with random weights."""
    out = tmp_path_factory.mktemp("ckpt")
    enc = perturb(ViT(16, 4, 32, 2, 2))
    save_encoder(enc, out / "encoder.safetensors", CFG)
    return out, enc


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("export")
    return {to: Path(export_checkpoint(ckpt[0], to, out / to)["outdir"]) for to in ("timm", "hf")}


@torch.no_grad()
def test_timm_export_gives_the_same_features(ckpt, exported):
    import timm

    enc, x = ckpt[1], images(16)
    ours = enc.forward_features(x)
    model = timm.create_model(f"local-dir:{exported['timm']}", pretrained=True).eval()
    assert_same(ours, model.forward_features(x))
    # The other two ways: the architecture + kwargs with a file overlay, and load_state_dict.
    config = json.loads((exported["timm"] / "config.json").read_text())
    file = str(exported["timm"] / "model.safetensors")
    model = timm.create_model(
        config["architecture"],
        pretrained=True,
        pretrained_cfg_overlay={"file": file},
        **config["model_args"],
    ).eval()
    assert_same(ours, model.forward_features(x))
    plain = timm.models.vision_transformer.VisionTransformer(**config["model_args"]).eval()
    plain.load_state_dict(load_file(file), strict=True)
    assert_same(ours, plain.forward_features(x))


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
@torch.no_grad()
def test_hf_export_gives_the_same_features_without_warnings(ckpt, exported):
    from transformers import ViTModel

    enc, x = ckpt[1], images(16)
    model, info = ViTModel.from_pretrained(
        exported["hf"], add_pooling_layer=False, output_loading_info=True
    )
    assert not any(info.values()), info
    assert_same(enc.forward_features(x), model.eval()(pixel_values=x).last_hidden_state)
    # Default ViTModel: only the pooler (no counterpart in our encoder) is missing.
    _, info = ViTModel.from_pretrained(exported["hf"], output_loading_info=True)
    assert set(info["missing_keys"]) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert not info["unexpected_keys"]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
@torch.no_grad()
def test_interpolated_encoder_exports_and_matches_hf_interpolation(ckpt, exported, tmp_path):
    """At 24 px (grid 4x4 -> 6x6): our interpolated encoder exported as is gives the same
    features in timm and transformers; transformers' own interpolate_pos_encoding=True uses
    the same bicubic resize as ours, so it matches too. (timm's img_size= resampling is
    antialiased bicubic: a different algorithm, measured in scripts/check_export.py.)"""
    import timm
    from transformers import ViTModel

    enc24, _, _ = encoder_from_checkpoint(ckpt[0], ModelConfig(image_size=24))
    x = images(24)
    ours = enc24.eval().forward_features(x)
    save_encoder(enc24, tmp_path / "encoder.safetensors", {**CFG, "image_size": 24})
    timm_dir = export_checkpoint(tmp_path, "timm", tmp_path / "timm")["outdir"]
    hf_dir = export_checkpoint(tmp_path, "hf", tmp_path / "hf")["outdir"]
    assert_same(
        ours, timm.create_model(f"local-dir:{timm_dir}", pretrained=True).forward_features(x)
    )
    hf24 = ViTModel.from_pretrained(hf_dir, add_pooling_layer=False).eval()
    assert_same(ours, hf24(pixel_values=x).last_hidden_state)
    hf16 = ViTModel.from_pretrained(exported["hf"], add_pooling_layer=False).eval()
    assert_same(ours, hf16(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state)


@torch.no_grad()
def test_import_timm_gives_the_same_features(tmp_path):
    """A timm ViT with a classifier and mlp_ratio 3 -> ours, from a bare .pth state dict (heads
    given) and from a timm directory (heads from config.json); the classifier is dropped."""
    import timm

    args = dict(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=3.0, num_classes=5
    )
    model = perturb(timm.models.vision_transformer.VisionTransformer(**args))
    torch.save(model.state_dict(), tmp_path / "vit.pth")
    with pytest.raises(InteropError, match="heads"):
        encoder_from_checkpoint(tmp_path / "vit.pth", ModelConfig(image_size=16))
    enc, _, _ = encoder_from_checkpoint(
        tmp_path / "vit.pth", ModelConfig(image_size=16, heads=2, mlp_ratio=3.0)
    )
    assert_same(enc.eval().forward_features(images(16)), model.forward_features(images(16)))

    d = tmp_path / "timm_dir"
    d.mkdir()
    save_file(model.state_dict(), str(d / "model.safetensors"))
    (d / "config.json").write_text(
        json.dumps({"architecture": "vit_base_patch16_224", "model_args": args})
    )
    import_weights(d, "auto", tmp_path / "imported")
    back, _, cfg = encoder_from_checkpoint(
        tmp_path / "imported", ModelConfig(image_size=16, mlp_ratio=3.0)
    )
    assert cfg["heads"] == 2 and cfg["mlp_ratio"] == 3.0
    assert_same(back.eval().forward_features(images(16)), model.forward_features(images(16)))


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
@torch.no_grad()
def test_import_hf_gives_the_same_features_also_interpolated(tmp_path):
    """Google-style ViTModel (LayerNorm eps 1e-12, intermediate 80 = ratio 2.5, pooler) saved
    with save_pretrained -> ours, at 16 px and at 24 px against interpolate_pos_encoding."""
    import transformers
    from transformers import ViTModel

    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=80,
        image_size=16,
        patch_size=4,
        layer_norm_eps=1e-12,
    )
    model = perturb(ViTModel(config))
    model.save_pretrained(tmp_path / "hf")
    enc, _, cfg = encoder_from_checkpoint(
        tmp_path / "hf", ModelConfig(image_size=16, mlp_ratio=2.5, norm_eps=None)
    )
    assert cfg["norm_eps"] == 1e-12 and enc.norm.eps == 1e-12 and cfg["mlp_ratio"] == 2.5
    x = images(16)
    assert_same(enc.eval().forward_features(x), model(pixel_values=x).last_hidden_state)
    enc24, _, _ = encoder_from_checkpoint(
        tmp_path / "hf", ModelConfig(image_size=24, mlp_ratio=2.5, norm_eps=None)
    )
    x = images(24)
    theirs = model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
    assert_same(enc24.eval().forward_features(x), theirs)
    # A classification model: `vit.` prefix stripped, the classifier dropped.
    clf = transformers.ViTForImageClassification(config)
    ours, _, dropped = from_hf(clf.state_dict(), config.to_dict())
    assert dropped == ["classifier.bias", "classifier.weight"] and "cls_token" in ours


def test_unmappable_shapes_name_what_does_not_map(ckpt):
    state, cfg = load_encoder(ckpt[0])
    with pytest.raises(InteropError, match=r"norm_eps=1e-12 does not map to timm"):
        to_timm(state, {**cfg, "norm_eps": 1e-12})
    with pytest.raises(InteropError, match=r"\['reg_token'\]"):
        to_timm({**state, "reg_token": torch.zeros(1, 1, 32)}, cfg)
    with pytest.raises(InteropError, match=r"\['qkv_bias'\] have no transformers equivalent"):
        export_checkpoint_cfg = {**cfg, "qkv_bias": False}
        from ssl_vit.interop import to_hf

        to_hf(state, export_checkpoint_cfg)
    hf = {"model_type": "vit", "hidden_act": "gelu_new", "hidden_size": 32}
    with pytest.raises(InteropError, match="hidden_act='gelu_new'"):
        from_hf({}, hf)


def test_missing_and_unexpected_keys_are_listed(ckpt, exported):
    theirs = load_file(str(exported["timm"] / "model.safetensors"))
    del theirs["blocks.1.norm1.weight"]
    theirs["blocks.0.ls1.gamma"] = torch.ones(32)  # layer scale: not in our ViT
    with pytest.raises(InteropError) as e:
        from_timm(theirs, heads=2)
    msg = str(e.value)
    assert "missing ['blocks.1.norm1.weight']" in msg and "unexpected ['blocks.0.ls1.gamma']" in msg
    hf = load_file(str(exported["hf"] / "model.safetensors"))
    del hf["encoder.layer.0.attention.attention.key.weight"]
    config = json.loads((exported["hf"] / "config.json").read_text())
    with pytest.raises(InteropError, match=r"missing \['blocks.0.attn.qkv.weight'\]"):
        from_hf(hf, config)


def test_cli_export_import_round_trip_is_bitwise(ckpt, tmp_path, capsys):
    for to in ("timm", "hf"):
        assert cli(["export", str(ckpt[0]), "--to", to, str(tmp_path / to)]) == 0
        assert "How to load" in (tmp_path / to / "README.md").read_text()
        assert cli(["import", str(tmp_path / to), "--from", to, str(tmp_path / f"in_{to}")]) == 0
        back, cfg = load_encoder(tmp_path / f"in_{to}")
        orig, _ = load_encoder(ckpt[0])
        assert cfg == CFG and back.keys() == orig.keys()
        assert all(torch.equal(back[k], orig[k]) for k in orig)
    assert cli(["import", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 1
    assert "no such checkpoint" in capsys.readouterr().err


def test_an_import_keeps_the_pixel_normalisation_its_source_records(tmp_path, capsys):
    """timm's pretrained_cfg and transformers' preprocessor_config.json record the mean and
    std their weights were trained on: an import (and a job reading the folder directly) keeps
    them, where it gave every job 0.5 unless the user knew to pass data.mean / data.std."""
    imagenet = PixelStats((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    (tmp_path / "ck").mkdir()
    save_encoder(perturb(ViT(16, 4, 32, 2, 2)), tmp_path / "ck/encoder.safetensors", CFG, imagenet)
    for to in ("timm", "hf"):
        assert cli(["export", str(tmp_path / "ck"), "--to", to, str(tmp_path / to)]) == 0
        assert read_pixel_norm(tmp_path / to) == imagenet  # init.checkpoint=<the folder>
        assert cli(["import", str(tmp_path / to), str(tmp_path / f"in_{to}")]) == 0
        assert read_pixel_norm(tmp_path / f"in_{to}") == imagenet
        record = json.loads((tmp_path / f"in_{to}/source.json").read_text())
        assert record["pixel_norm"] == {"mean": list(imagenet.mean), "std": list(imagenet.std)}
    bare = tmp_path / "bare/vit.safetensors"  # a state dict alone records nothing
    bare.parent.mkdir()
    save_file(load_file(str(tmp_path / "timm/model.safetensors")), str(bare))
    assert read_pixel_norm(bare) is None
    config = json.loads((tmp_path / "timm/config.json").read_text())
    config["pretrained_cfg"]["std"] = [0.2, 0.0, 0.2]
    (tmp_path / "timm/config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli(["import", str(tmp_path / "timm"), str(tmp_path / "in_bad")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'timm/config.json'}: no usable pixel normalisation (std must be > 0" in err
    assert not (tmp_path / "in_bad").exists()


def test_cli_export_of_a_run_directory_uses_its_newest_valid_checkpoint(ckpt, tmp_path, caplog):
    from ssl_vit.train.checkpoint import save_checkpoint
    from ssl_vit.train.rng import rng_state

    enc, run = ckpt[1], tmp_path / "run"
    for step in (1, 2):
        state = {"model": {f"encoder.{k}": v for k, v in enc.state_dict().items()}}
        save_checkpoint(
            run / "checkpoints", step, encoder=enc, model_config=CFG, state=state, rng=rng_state()
        )
    with caplog.at_level("INFO"):
        assert cli(["export", str(run), "--to", "timm", str(tmp_path / "timm")]) == 0
    assert f"using checkpoint {run / 'checkpoints' / 'step_00000002'}" in caplog.text
    assert (tmp_path / "timm" / "model.safetensors").is_file()


def test_model_card_and_kept_head(tmp_path):
    """A checkpoint inside a run directory: the card has the pretraining settings and the
    results of the run and of a fine-tuning run started from it; --keep-head writes the head."""
    from ssl_vit.config import PretrainConfig, load_config, save_config
    from ssl_vit.train.checkpoint import write_manifest

    run = tmp_path / "runs" / "pre"
    ck = run / "checkpoints" / "step_00000010"
    ck.mkdir(parents=True)
    enc = ViT(16, 4, 32, 2, 2)
    save_encoder(enc, ck / "encoder.safetensors", CFG)
    head = {
        "mask_embedding": torch.randn(32),
        "head.weight": torch.randn(512, 32),
        "head.bias": torch.randn(512),
    }
    model = {**{f"encoder.{k}": v for k, v in enc.state_dict().items()}, **head}
    torch.save({"model": model, "step": 10}, ck / "state.pt")
    write_manifest(ck, step=10)  # as save_checkpoint does: every checkpoint read is verified
    cfg = load_config(
        PretrainConfig,
        None,
        ["data.train_shards=data/x", "train.batch_size=64", "objective.mask_ratio=0.4"],
    )
    save_config(cfg, run / "config.yaml")
    (run / "results.json").write_text(json.dumps({"loss": 1.25, "color_acc": 0.5, "step": 10}))
    (tmp_path / "runs" / "ft").mkdir()
    (tmp_path / "runs" / "ft" / "results.json").write_text(
        json.dumps(
            {
                "top1": 0.4321,
                "init": "runs/pre/checkpoints/step_00000010",
                "image_size": 24,
                "step": 5,
            }
        )
    )
    export_checkpoint(ck, "hf", tmp_path / "out", keep_head=True)
    card = (tmp_path / "out" / "README.md").read_text()
    for fact in (
        "`data/x`",
        "10 at batch 64 (640 images)",
        "40.0% of the patch embeddings",
        "loss 1.250",
        "top-1 43.2%",
        "24 px",
        "ViTModel.from_pretrained",
    ):
        assert fact in card, fact
    saved = load_file(str(tmp_path / "out" / "masked_patch_head.safetensors"))
    assert saved.keys() == head.keys()
    assert all(torch.equal(saved[k], head[k]) for k in head)


def test_fewshot_pipeline_evaluates_a_transformers_model(exported, synthetic_shards, tmp_path):
    """The few-shot job takes a transformers directory as --checkpoint (format detected) and
    writes its summary to TensorBoard as well."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    res = pipeline("fewshot")(
        [
            "--checkpoint",
            str(exported["hf"]),
            "--config",
            str(root / "configs/fewshot/smoke.yaml"),
            f"fewshot.train={synthetic_shards}",
            f"fewshot.eval={synthetic_shards}",
            f"output_dir={tmp_path}",
            "trackers=[tensorboard]",
        ]
    )
    assert res["num_test"] == 96 and 0.0 <= res["5shot"] <= 1.0
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (scalar,) = events.Scalars("fewshot/5shot")
    assert scalar.step == 0 and scalar.value == pytest.approx(res["5shot"])
