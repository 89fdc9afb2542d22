"""`ssl-vit export` of a fine-tuned classifier: transformers' pipeline and timm's own transform
give our labels on image files, the classes and the label budget travel, `pool: gap` maps to
timm only, and an encoder export is what it was.

One tiny fine-tuning run (from scratch, 24 px, EMA, a label budget) on synthetic shards, and
PNG files of several sizes, square and not, that go through the resize-and-crop path.
"""

import dataclasses
import importlib.util
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import pipeline
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from ssl_vit.cli import main as cli
from ssl_vit.config.schema import ModelConfig
from ssl_vit.data.decode import decode_image
from ssl_vit.data.images import eval_transform
from ssl_vit.datasets.synthetic import make_synthetic_shards, synthetic_shapes
from ssl_vit.interop import InteropError
from ssl_vit.model.vit import build_vit
from ssl_vit.publish import export_checkpoint, export_classifier, export_source, import_weights
from ssl_vit.train.checkpoint import load_encoder, save_encoder
from ssl_vit.train.classifier_file import (
    ClassifierSpec,
    build_classifier,
    load_classifier,
    save_classifier,
)

# The `interop` extra, imported by the tests that use it, not at collection (~1.5 s of every
# xdist worker's start, also of a worker that ran none of these tests).
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("timm", "transformers")),
    reason="the interop extra (timm, transformers) is not installed",
)

ROOT = Path(__file__).resolve().parents[1]
# (width, height): square, shorter side already S = 24, landscape and portrait, extreme ratios.
SIZES = [(48, 48), (61, 40), (37, 53), (24, 24), (100, 31), (27, 90), (45, 40), (62, 48)]
HF_TOL = 1e-4  # same pixels: float rounding only (rescale and normalize fused differently)
TIMM_TOL = 1e-2  # PIL's bilinear resize vs torchvision's on uint8 tensors: +-1 grey level
# A hand-made 16 px encoder, width 8, one block: files in milliseconds, no training.
TINY = {"image_size": 16, "patch_size": 4, "width": 8, "depth": 1, "heads": 2}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and far faster on a CPU that other jobs share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished fine-tuning run directory (model.safetensors, results.json, config.yaml)."""
    tmp = tmp_path_factory.mktemp("finetune")
    make_synthetic_shards(tmp / "shards", n=160, image_size=16, seed=0, shard_size=80)
    argv = ["--config", str(ROOT / "configs/finetune/smoke.yaml"), f"output_dir={tmp / 'run'}"]
    argv += [f"data.train={tmp / 'shards'}", f"data.eval={tmp / 'shards'}", "train.steps=40"]
    pipeline("finetune")([*argv, "eval_every=0", "ema=0.9", "data.labels_per_class=12"])
    return tmp / "run"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """PNG files of the synthetic shapes at the sizes of SIZES."""
    out = tmp_path_factory.mktemp("images")
    files = []
    for i, (key, data, _) in enumerate(synthetic_shapes(2 * len(SIZES), 48, seed=3)):
        image = Image.open(io.BytesIO(data)).convert("RGB")
        files.append(out / f"{key}.png")
        image.resize(SIZES[i % len(SIZES)], Image.Resampling.BICUBIC).save(files[-1])
    return files


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("export")
    return {to: Path(export_classifier(run, to, out / to)["outdir"]) for to in ("hf", "timm")}


@torch.no_grad()
def ours(source: Path, files: list[Path]) -> torch.Tensor:
    """Our logits [N, K]: load_classifier + eval_transform on the decoded files."""
    model, spec = load_classifier(source)
    t = eval_transform(spec.image_size)
    return torch.cat([model(t(decode_image(f.read_bytes()))[None]) for f in files])


def same_crop(file: Path, size: int) -> bool:
    """Whether transformers crops `file` where torchvision does: it floors the offset of the
    central square, torchvision rounds half to even (they differ when the resized longer side
    exceeds `size` by 3, 7, 11, ... px)."""
    w, h = Image.open(file).size
    long = int(size * max(w, h) / min(w, h))
    return (long - size) // 2 == round((long - size) / 2)


def assert_same_top1(a: torch.Tensor, b: torch.Tensor, tol: float) -> int:
    """Logits [N, K] within `tol`, with the same top-1 (or `a`'s best two within 2 tol: a tie
    the tolerance cannot split). Returns how many top-1 labels agree."""
    assert (a - b).abs().max() < tol, (a - b).abs().max()
    best2 = a.topk(2, dim=-1).values
    tied = best2[:, 0] - best2[:, 1] < 2 * tol
    agree = a.argmax(-1) == b.argmax(-1)
    assert (agree | tied).all()
    assert tied.sum() <= len(a) // 4  # the comparison is not vacuous
    return int(agree.sum())


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
@torch.no_grad()
def test_transformers_pipeline_gives_our_labels(run, exported, images):
    import transformers
    from transformers.models.bit.image_processing_bit import BitImageProcessor

    logits = ours(run, images)
    names = json.loads((exported["hf"] / "config.json").read_text())["id2label"]
    classify = transformers.pipeline("image-classification", model=str(exported["hf"]))
    # What the pipeline builds: the torchvision backend of the shorter-side-and-crop processor.
    assert type(classify.image_processor) is BitImageProcessor
    labels = [r[0]["label"] for r in classify([str(f) for f in images], top_k=1)]
    theirs = torch.cat(
        [
            classify.model(**classify.image_processor(Image.open(f), return_tensors="pt")).logits
            for f in images
        ]
    )
    exact = [same_crop(f, 24) for f in images]
    assert 0 < sum(exact) < len(images)  # both kinds are tested
    assert_same_top1(logits[exact], theirs[exact], HF_TOL)
    assert [names[str(i)] for i in theirs.argmax(-1).tolist()] == labels
    for i in range(len(images)):  # the pipeline's label is ours wherever the crop is the same
        assert not exact[i] or labels[i] == names[str(logits[i].argmax().item())]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
@torch.no_grad()
def test_transformers_differs_only_by_the_documented_crop_offset(exported, images):
    """Where the crop offsets differ, transformers' pixels are ours cropped at the floored
    offset: the one difference between the two preprocessings."""
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(exported["hf"])
    for file in (f for f in images if not same_crop(f, 24)):
        x = TF.resize_image(decode_image(file.read_bytes()), [24], antialias=True)
        top, left = (x.shape[1] - 24) // 2, (x.shape[2] - 24) // 2
        floored = (x[:, top : top + 24, left : left + 24].float() / 255 - 0.5) / 0.5
        theirs = processor(Image.open(file), return_tensors="pt")["pixel_values"][0]
        assert (floored - theirs).abs().max() < 1e-5


@torch.no_grad()
def test_timm_create_model_and_its_transform_give_our_labels(run, exported, images):
    import timm

    model = timm.create_model(f"local-dir:{exported['timm']}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    theirs = torch.cat([model(transform(Image.open(f).convert("RGB"))[None]) for f in images])
    assert_same_top1(ours(run, images), theirs, TIMM_TOL)
    assert model.pretrained_cfg["label_names"] == list(load_classifier(run)[1].label_names)


@torch.no_grad()
def test_gap_pooling_exports_to_timm_only(run, images, tmp_path):
    """A classifier pooling the mean of patch tokens: timm's global_pool='avg' with the final
    norm before pooling (fc_norm=False) computes ours; transformers is refused in one line."""
    import timm

    model, spec = load_classifier(run)
    (tmp_path / "gap").mkdir()
    save_classifier(
        model, tmp_path / "gap/model.safetensors", dataclasses.replace(spec, pool="gap")
    )
    with pytest.raises(InteropError, match="pool 'gap'.*--to timm") as e:
        export_classifier(tmp_path / "gap", "hf", tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    out = export_classifier(tmp_path / "gap", "timm", tmp_path / "timm")["outdir"]
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["model_args"]["global_pool"] == "avg" and config["model_args"]["fc_norm"] is False
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 3, 24, 24), generator=g, dtype=torch.uint8)
    ours_gap = load_classifier(tmp_path / "gap")[0]
    assert (ours_gap(x) - theirs((x / 255 - 0.5) / 0.5)).abs().max() < 1e-5


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_configs_and_card_carry_the_classes_and_the_label_budget(run, exported):
    import transformers

    spec, results = load_classifier(run)[1], json.loads((run / "results.json").read_text())
    hf = json.loads((exported["hf"] / "config.json").read_text())
    assert hf["architectures"] == ["ViTForImageClassification"] and hf["image_size"] == 24
    assert hf["id2label"] == {str(i): n for i, n in enumerate(spec.label_names)}
    assert hf["label2id"] == {n: i for i, n in enumerate(spec.label_names)}
    assert hf["layer_norm_eps"] == spec.model_config["norm_eps"]
    pre = json.loads((exported["hf"] / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "BitImageProcessor"
    assert pre["size"] == {"shortest_edge": 24} and pre["crop_size"] == {"height": 24, "width": 24}
    timm_cfg = json.loads((exported["timm"] / "config.json").read_text())
    assert timm_cfg["num_classes"] == timm_cfg["pretrained_cfg"]["num_classes"] == 10
    assert timm_cfg["pretrained_cfg"]["label_names"] == list(spec.label_names)
    assert timm_cfg["pretrained_cfg"]["input_size"] == [3, 24, 24]
    _, info = transformers.ViTForImageClassification.from_pretrained(
        exported["hf"], output_loading_info=True
    )
    assert not any(info.values()), info  # every weight maps, nothing left random
    card = (exported["hf"] / "README.md").read_text()
    assert f"{results['top1_ema'] * 100:.1f}%" in card  # EMA: model.safetensors is the average
    assert "12 per class" in card and f"{results['num_labelled']} labelled images" in card
    assert all(f"`{n}`" in card for n in spec.label_names)
    assert "24 px" in card and 'pipeline("image-classification"' in card
    assert "timm.create_model" in (exported["timm"] / "README.md").read_text()


def test_import_of_a_classifier_export_takes_the_encoder(run, exported, tmp_path):
    encoder = {
        k.removeprefix("encoder."): v
        for k, v in load_classifier(run)[0].state_dict().items()
        if k.startswith("encoder.")
    }
    for to in ("hf", "timm"):
        import_weights(exported[to], to, tmp_path / to)
        back, _ = load_encoder(tmp_path / to)
        assert back.keys() == encoder.keys()
        assert all(torch.equal(back[k], encoder[k]) for k in encoder)


def test_encoder_export_is_unchanged(run, exported, tmp_path):
    """An encoder (no class names) still exports as ViTModel / a headless timm model, and
    neither it nor an export directory is taken for a classifier."""
    cfg = load_classifier(run)[1].model_config
    (tmp_path / "enc").mkdir()
    save_encoder(build_vit(ModelConfig.from_saved(cfg)), tmp_path / "enc/encoder.safetensors", cfg)
    assert export_source(tmp_path / "enc") == ("checkpoint", tmp_path / "enc")
    assert export_source(exported["hf"])[0] == "checkpoint"  # transformers weights: not ours
    assert export_source(run) == export_source(run / "model.safetensors")
    assert export_source(run) == ("classifier", run / "model.safetensors")
    hf = json.loads(
        (
            Path(export_checkpoint(tmp_path / "enc", "hf", tmp_path / "hf")["outdir"])
            / "config.json"
        ).read_text()
    )
    assert hf["architectures"] == ["ViTModel"] and "id2label" not in hf
    pre = json.loads((tmp_path / "hf/preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "ViTImageProcessor"
    export_checkpoint(tmp_path / "enc", "timm", tmp_path / "timm")
    tc = json.loads((tmp_path / "timm/config.json").read_text())
    assert tc["num_classes"] == 0 and "label_names" not in tc["pretrained_cfg"]
    assert tc["model_args"]["global_pool"] == "token" and "fc_norm" not in tc["model_args"]


def test_cli_exports_a_finetuning_run(run, tmp_path, capsys):
    assert cli(["export", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "10-class classifier" in capsys.readouterr().out
    assert cli(["export", str(run), "--to", "timm", str(tmp_path / "t"), "--keep-head"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no masked-prediction head" in err


# --- issue 47 #7: what is exported is decided from the file's contents, never its name ----------


def test_an_encoder_where_a_classifier_belongs_is_refused_in_a_fine_tune_said_elsewhere(
    tmp_path, capsys, caplog
):
    cfg = dataclasses.asdict(ModelConfig.from_saved(TINY))
    runs = {"ft": "init:\n  checkpoint: x\n", "pre": "objective:\n  mask_ratio: 0.5\n"}
    for name, config in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(config)
        save_encoder(
            build_vit(ModelConfig.from_saved(cfg)), tmp_path / name / "model.safetensors", cfg
        )
    ft, pre = tmp_path / "ft", tmp_path / "pre"
    # A fine-tuning run's model.safetensors is its classifier: an encoder there is refused.
    for source in (ft / "model.safetensors", ft):  # before issue 47: the file exported, exit 0
        assert cli(["export", str(source), "--to", "hf", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{ft / 'model.safetensors'}: an encoder (no classifier head, no labels)" in err
    assert not (tmp_path / "out").exists()
    # Elsewhere (a pretraining run) the encoder is what there is: exported, and said so.
    for to, model in (("hf", "transformers ViTModel"), ("timm", "timm VisionTransformer")):
        with caplog.at_level(logging.INFO):
            assert cli(["export", str(pre), "--to", to, str(tmp_path / to)]) == 0
        said = f"{pre / 'model.safetensors'} is an encoder (no classifier head, no labels): "
        assert f"{said}exporting a {model}" in caplog.text
    hf = json.loads((tmp_path / "hf/config.json").read_text())
    assert hf["architectures"] == ["ViTModel"] and "id2label" not in hf


def test_a_classifier_under_another_name_exports_as_a_classifier(tmp_path, capsys):
    cfg = dataclasses.asdict(ModelConfig.from_saved(TINY))
    spec = ClassifierSpec(cfg, "cls", ("cat", "dog", "eel"), (0.5,) * 3, (0.25,) * 3)
    save_classifier(build_classifier(spec), tmp_path / "best.safetensors", spec)
    assert (
        cli(["export", str(tmp_path / "best.safetensors"), "--to", "hf", str(tmp_path / "hf")]) == 0
    )
    assert "3-class classifier" in capsys.readouterr().out
    hf = json.loads((tmp_path / "hf/config.json").read_text())
    assert hf["architectures"] == ["ViTForImageClassification"]
    assert list(hf["id2label"].values()) == ["cat", "dog", "eel"]


def test_a_fine_tunes_file_copied_as_best_exports_as_its_classifier(run, tmp_path, capsys, caplog):
    """Issue 48, defect 5: `ssl-vit export best.safetensors` (a fine-tune's model.safetensors
    under another name, in a folder of its own) is the classifier, with its labels and its
    preprocessing, by the file's header alone; an encoder under another name is an encoder."""
    spec, best = load_classifier(run)[1], tmp_path / "best.safetensors"
    shutil.copy(run / "model.safetensors", best)
    assert cli(["export", str(best), "--to", "timm", str(tmp_path / "t")]) == 0
    assert "10-class classifier" in capsys.readouterr().out
    pretrained = json.loads((tmp_path / "t/config.json").read_text())["pretrained_cfg"]
    assert pretrained["label_names"] == list(spec.label_names)
    assert pretrained["mean"] == list(spec.mean) and pretrained["std"] == list(spec.std)
    assert pretrained["input_size"] == [3, 24, 24] and pretrained["crop_pct"] == 1.0
    (tmp_path / "enc").mkdir()
    cfg = spec.model_config
    save_encoder(build_vit(ModelConfig.from_saved(cfg)), tmp_path / "enc/last.safetensors", cfg)
    with caplog.at_level(logging.INFO):
        assert cli(["export", str(tmp_path / "enc/last.safetensors"), "--to", "timm",
                    str(tmp_path / "e")]) == 0  # fmt: skip
    assert "is an encoder (no classifier head, no labels)" in caplog.text
    assert json.loads((tmp_path / "e/config.json").read_text())["num_classes"] == 0
