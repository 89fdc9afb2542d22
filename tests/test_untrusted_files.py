"""Every file a job reads is untrusted input (issue 38: #1, #10, #14, #15; issue 47: #6, #11).

A weights file whose metadata claims a model far larger than its tensors is refused before any
model is built; malformed JSON (truncated, another shape, nested 200,000 deep, a header length
of 2^62) and oversized YAML or integers are one line naming the file or the key. A classifier or
encoder whose weights or pixel normalisation would make every output NaN, or whose class names
repeat, is refused as it is read; no file the project writes holds a bare NaN. Tiny hand-made
files only.
"""

import json
import math
import resource
import struct
import time

import numpy as np
import pytest
import torch
from conftest import pipeline
from PIL import Image
from safetensors.torch import save_file

from ssl_vit.atomic import read_jsonl, write_json
from ssl_vit.config import ConfigError, load_config
from ssl_vit.config import loader as config_loader
from ssl_vit.config.schema import ModelConfig, PretrainConfig
from ssl_vit.data.shards import read_index, resolve_shards
from ssl_vit.eval.predictions import Predicted, PredictionWriter
from ssl_vit.interop import detect_format
from ssl_vit.interop.keymap import InteropError, check_complete
from ssl_vit.jsonfile import JsonFileError, parse_json, read_json
from ssl_vit.model import vit as vit_module
from ssl_vit.model.shapes import shape_mismatch
from ssl_vit.publish import export_model
from ssl_vit.train import distill, preflight
from ssl_vit.train.checkpoint import (
    CheckpointError,
    PixelStats,
    load_encoder,
    read_pixel_norm,
    save_encoder,
    verify_checkpoint,
    write_manifest,
)
from ssl_vit.train.classifier_file import (
    ClassifierError,
    ClassifierSpec,
    build_classifier,
    load_classifier,
    read_classifier_spec,
    save_classifier,
)
from ssl_vit.train.metrics import MetricsWriter

# The file: one 1x65x8 pos_embed (a 32 px image in 4 px patches, width 8).
SMALL = {"variant": "", "image_size": 32, "patch_size": 4, "width": 8, "depth": 2, "heads": 2}
HUGE = [{"width": 2048, "depth": 8}, {"width": 32768, "depth": 48}]
TINY = ["data.train_shards=x", "model.image_size=16", "model.patch_size=4", "model.width=16"]
TINY += ["model.depth=1", "model.heads=2"]


def _never_built(monkeypatch):
    """A ViT built from here on fails the test: the refusal must come before any model."""

    def refuse(*args, **kwargs):
        pytest.fail("a model was built from untrusted metadata")

    monkeypatch.setattr(vit_module.ViT, "__init__", refuse)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _weights(path, metadata: dict, tensors=None):
    save_file(tensors or {"pos_embed": torch.zeros(1, 65, 8)}, str(path), metadata=metadata)
    return path


# --- #1: metadata claiming a huge model, tensors tiny ------------------------------------------


@pytest.mark.parametrize("claim", HUGE, ids=["2048x8", "32768x48"])
def test_encoder_metadata_claiming_a_huge_model_is_refused_before_building(
    tmp_path, monkeypatch, claim
):
    file = _weights(tmp_path / "encoder.safetensors", {"model_config": json.dumps(SMALL | claim)})
    before = _peak_mb()
    _never_built(monkeypatch)
    with pytest.raises(ConfigError) as err:  # as fewshot --checkpoint / init.checkpoint load it
        preflight.load_init_encoder(
            "--checkpoint", str(file), ModelConfig(image_size=32), "bicubic", "auto"
        )
    line = f"{file}: metadata says width {claim['width']} but pos_embed is 1x65x8"
    assert line in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="metadata says width"):  # export, import, ...
        load_encoder(file)
    assert _peak_mb() - before < 200  # built, the first would take 2.3 GB, the second 12.9 GB


def test_checkpoint_directory_with_a_lying_encoder_is_refused_before_building(
    tmp_path, monkeypatch
):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    _weights(ckpt / "encoder.safetensors", {"model_config": json.dumps(SMALL | HUGE[0])})
    write_manifest(ckpt, step=1)  # a valid checkpoint: the manifest vouches for the bytes only
    _never_built(monkeypatch)
    with pytest.raises(ConfigError, match="metadata says width 2048 but pos_embed is 1x65x8"):
        preflight.load_init_encoder(
            "init.checkpoint", str(tmp_path / "run"), ModelConfig(image_size=32), "bicubic", "auto"
        )


def test_every_size_the_metadata_claims_is_checked_against_the_tensors(tmp_path):
    torch.manual_seed(0)
    vit = vit_module.ViT(32, 4, 8, 2, 2)
    file = tmp_path / "encoder.safetensors"
    save_encoder(vit, file, SMALL)
    state, cfg = load_encoder(file)  # the truth loads, bit for bit
    assert cfg["depth"] == 2 and all(torch.equal(state[k], v) for k, v in vit.state_dict().items())
    tensors = {k: v.contiguous() for k, v in vit.state_dict().items()}
    lies = {
        "depth": ({"depth": 48}, "metadata says depth 48 but there are 2 blocks"),
        "patch": (
            {"patch_size": 8},
            "metadata says patch_size 8 but patch_embed.weight is 8x3x4x4",
        ),
        "image": ({"image_size": 64}, "image_size 64 with patch_size 4 (257 positions) but"),
        "mlp": ({"mlp_ratio": 400.0}, "mlp_ratio 400.0 (hidden size 3200) but blocks.0.mlp.0"),
    }
    for name, (claim, message) in lies.items():
        _weights(file, {"model_config": json.dumps(SMALL | claim)}, tensors)
        with pytest.raises(CheckpointError) as err:
            load_encoder(file)
        assert message in str(err.value), name
    tensors.pop("norm.bias")  # the sizes agree, one tensor is missing: found before loading
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert "missing ['norm.bias']" in shape_mismatch(ModelConfig.from_saved(SMALL), shapes)


def test_classifier_metadata_claiming_a_huge_model_is_refused_before_building(
    tmp_path, monkeypatch
):
    spec = ClassifierSpec(SMALL | HUGE[1], "cls", ("a", "b"), (0.5,) * 3, (0.5,) * 3)
    tensors = {"encoder.pos_embed": torch.zeros(1, 65, 8), "head.weight": torch.zeros(2, 8)}
    file = _weights(tmp_path / "model.safetensors", spec.metadata(), tensors)
    _never_built(monkeypatch)
    with pytest.raises(ClassifierError) as err:  # predict, a distillation teacher, export
        load_classifier(file)
    assert str(err.value) == f"{file}: metadata says width 32768 but pos_embed is 1x65x8"


def test_imported_config_claiming_a_million_layers_is_refused_before_building(monkeypatch):
    state = vit_module.ViT(16, 4, 8, 2, 2).state_dict()
    cfg = SMALL | {"image_size": 16, "depth": 10**6, "mlp_ratio": 4.0, "norm_eps": 1e-12}
    _never_built(monkeypatch)
    with pytest.raises(InteropError, match="hf: its config says depth 1000000 but there are 2"):
        check_complete(state, cfg, "hf", [])


# --- #10: malformed JSON ------------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"labels_per_class": 5, "lab', "not valid JSON (Unterminated string"),
        ("[1, 2]", "expected a JSON object, got a JSON array"),
        (DEEP, "JSON nested deeper than 32 levels"),
        ('{"a":' * 200_000 + "1" + "}" * 200_000, "JSON nested deeper than 32 levels"),
        ("[" * 40 + "]" * 40, "JSON nested deeper than 32 levels"),  # under Python's limit
        ('{"n": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit"),
    ],
    ids=["truncated", "list", "deep-list", "deep-object", "depth-40", "5000-digits"],
)
def test_malformed_json_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "labelled.json"
    path.write_text(text)
    with pytest.raises(JsonFileError) as err:
        read_json(path)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)


def test_json_size_is_bounded_before_parsing(tmp_path):
    path = tmp_path / "index.json"
    path.write_text(json.dumps({"keys": ["x" * 100] * 100}))
    with pytest.raises(JsonFileError, match=f"{path}: over 1000 bytes"):
        read_json(path, max_bytes=1000)
    assert parse_json('{"a": [1, {"b": 2}]}', "x") == {"a": [1, {"b": 2}]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DEEP, "JSON nested deeper than 32 levels"),
        ('{"format": "ssl-vit-shards/1", "shards": 3, "label_names": []}', "a damaged shard"),
        ('{"format": "ssl-vit-shards/1", "shards": [{"name": 1}], "label_names": []}', "a damaged"),
        ('{"format": "ssl-vit-shards/1", "shards"', "not valid JSON"),
        (  # issue 47 #11, the data side: a class named twice
            '{"format": "ssl-vit-shards/1", "shards": [], "label_names": ["a", "b", "a"]}',
            "label_names holds ['a'] more than once",
        ),
    ],
    ids=["deep", "shards-not-a-list", "name-not-a-string", "truncated", "duplicate-label"],
)
def test_malformed_shard_index_is_one_line_naming_it(tmp_path, text, message):
    (tmp_path / "index.json").write_text(text)
    for read in (resolve_shards, read_index):
        with pytest.raises(ValueError) as err:
            read(str(tmp_path))
        assert str(err.value).startswith(f"{tmp_path / 'index.json'}") and message in str(err.value)


@pytest.mark.parametrize(
    ("model_config", "message"),
    [
        ("[1, 2]", "model_config metadata: expected a JSON object, got a JSON array"),
        (json.dumps(SMALL | {"width": {"a": [1]}}), "model_config.width: expected"),
        (DEEP, "model_config metadata: JSON nested deeper than 32 levels"),
        ('{"width": 8', "model_config metadata: not valid JSON"),
    ],
    ids=["list", "nested", "deep", "truncated"],
)
def test_malformed_model_config_metadata_is_one_line_naming_the_file(
    tmp_path, monkeypatch, model_config, message
):
    file = _weights(tmp_path / "encoder.safetensors", {"model_config": model_config})
    _never_built(monkeypatch)
    with pytest.raises(ConfigError) as err:
        preflight.load_init_encoder(
            "--checkpoint", str(file), ModelConfig(image_size=32), "bicubic", "auto"
        )
    assert f"{file}: {message}" in str(err.value) and "\n" not in str(err.value)


def test_safetensors_header_length_of_2_to_the_62_is_one_line(tmp_path):
    for name in ("encoder.safetensors", "model.safetensors"):
        (tmp_path / name).write_bytes(struct.pack("<Q", 2**62) + b"{}")
    encoder, classifier = tmp_path / "encoder.safetensors", tmp_path / "model.safetensors"
    line = "not a readable safetensors file (Error while deserializing header: header too large)"
    with pytest.raises(CheckpointError, match="header too large"):
        load_encoder(encoder)
    with pytest.raises(InteropError, match="header too large"):  # fewshot --checkpoint FILE
        detect_format(encoder)
    with pytest.raises(ConfigError) as err:
        preflight.load_init_encoder(
            "--checkpoint", str(encoder), ModelConfig(image_size=32), "bicubic", "auto"
        )
    assert f"{encoder}: {line}" in str(err.value)
    with pytest.raises(ClassifierError) as err:  # predict, export, a distillation teacher
        load_classifier(classifier)
    assert str(err.value) == f"{classifier}: {line}"


@pytest.mark.parametrize(
    "text",
    [DEEP, '{"files": [1]}', '{"files": {"../x": {"bytes": 1}}}', '{"fi'],
    ids=["deep", "files-a-list", "name-outside", "truncated"],
)
def test_malformed_manifest_is_one_line_naming_it(tmp_path, text):
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(ckpt)
    assert "manifest.json" in str(err.value) and str(ckpt) in str(err.value)


@pytest.mark.parametrize("text", [DEEP, "[]", '{"teacher_sha'], ids=["deep", "list", "truncated"])
def test_malformed_teacher_and_results_files_are_one_line(tmp_path, text):
    (tmp_path / "teacher.json").write_text(text)
    teacher = distill.Teacher(tmp_path / "model.safetensors", "0" * 64, None)
    with pytest.raises(ConfigError) as err:
        distill._check_same_teacher(tmp_path / "teacher.json", teacher)
    assert str(err.value).startswith(f"{tmp_path / 'teacher.json'}: ")
    (tmp_path / "results.json").write_text(text)
    assert distill._teacher_top1(tmp_path) is None  # only shown: no top-1, no traceback


def test_a_metrics_line_nested_200000_deep_is_a_corrupt_line_not_a_traceback(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + DEEP + "\n")
    assert read_jsonl(path) == [{"step": 1}]  # the last line: dropped as torn, with a warning
    path.write_text(DEEP + '\n{"step": 1}\n')
    with pytest.raises(ValueError, match=f"^{path}:1: corrupt line \\(nested too deeply\\)$"):
        read_jsonl(path)


# --- #14: a YAML config of megabytes ------------------------------------------------------------


def test_a_config_over_a_megabyte_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"{" + b"k: 1, " * 200_000 + b"}")  # never parsed: the size alone
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, path)
    size = path.stat().st_size
    assert str(err.value) == (
        f"{path}: {size} bytes, too large for a config (at most {1 << 20} bytes)"
    )
    assert time.perf_counter() - start < 1.0


def test_many_values_without_aliases_do_not_blame_aliases(tmp_path, monkeypatch):
    monkeypatch.setattr(config_loader, "MAX_YAML_VALUES", 50)  # 10,000: seconds of parsing here
    path = tmp_path / "flat.yaml"
    path.write_text("{" + ", ".join(f"k{i}: 1" for i in range(100)) + "}\n")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, path)
    assert str(err.value).endswith("more than 50 values (a config has a few hundred)")
    assert "YAML aliases" not in str(err.value)
    path.write_text("train:\n  x: " + "[" * 100 + "]" * 100 + "\n")  # 100 levels
    with pytest.raises(ConfigError, match=r"line 2, column \d+: more than 32 levels of nesting"):
        load_config(PretrainConfig, path)


# --- #15: a 5,000-digit integer -----------------------------------------------------------------


def test_a_5000_digit_override_is_one_line_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, [*TINY, "train.steps=" + "1" * 5000])
    message = str(err.value)
    assert message.startswith("override 'train.steps=1111") and len(message) < 200
    assert "an integer of 5000 characters is out of range" in message
    with pytest.raises(ConfigError, match=r"^train.steps: out of range \(an integer of 4000 dig"):
        load_config(PretrainConfig, None, [*TINY, "train.steps=" + "1" * 4000])
    with pytest.raises(ConfigError) as err:  # a float key: its value is shown clipped
        load_config(PretrainConfig, None, [*TINY, "train.lr=" + "1" * 4000])
    assert str(err.value).startswith("train.lr: expected float") and len(str(err.value)) < 200


def test_a_5000_digit_integer_in_a_config_file_names_its_line(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("train:\n  steps: " + "1" * 5000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, path, TINY)
    assert str(err.value) == (
        f"{path}, line 2, column 10: an integer of 5000 characters is out of range"
    )


# --- issue 47 #6 / #11: a classifier or encoder that makes every output NaN, repeated classes ---

NAN, INF = float("nan"), float("inf")
CLS = SMALL | {"image_size": 16, "depth": 1}  # ViT(16, 4, 8, 1, 2): 17 positions


def _classifier(path, names=("cat", "dog"), mean=(0.5,) * 3, std=(0.5,) * 3, tensor=None):
    """A tiny classifier file as a fine-tune writes it; `tensor` (name, value): its element 0
    set to value."""
    spec = ClassifierSpec(CLS, "cls", tuple(names), mean, std)
    model = build_classifier(spec)
    if tensor is not None:
        with torch.no_grad():
            model.state_dict()[tensor[0]].view(-1)[0] = tensor[1]
    save_classifier(model, path, spec)
    return path


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"std": (0.0, 0.5, 0.5)}, "preprocess.std must be > 0 (it divides), got [0.0, 0.5, 0.5]"),
        ({"mean": (NAN, 0.5, 0.5)}, "preprocess.mean must be finite, got [nan, 0.5, 0.5]"),
        ({"std": (0.5, INF, 0.5)}, "preprocess.std must be finite, got [0.5, inf, 0.5]"),
        ({"names": ("cat", "dog", "cat")}, "label_names: classes 0 and 2 are both named 'cat'"),
        ({"names": ("cat", "")}, "label_names: class 1 has a blank name ''"),
        ({"names": (" ", "dog")}, "label_names: class 0 has a blank name ' '"),
    ],
    ids=["std-0", "nan-mean", "inf-std", "duplicate-name", "empty-name", "blank-name"],
)
def test_a_classifier_whose_header_is_unusable_is_refused_by_every_reader(
    tmp_path, damage, message
):
    file = _classifier(tmp_path / "model.safetensors", **damage)
    for read in (read_classifier_spec, load_classifier):  # predict's check, predict, a teacher
        with pytest.raises(ClassifierError) as err:
            read(file)
        assert _one_line(err) == f"{file}: {message}"
    with pytest.raises(ClassifierError) as err:  # export: nothing written
        export_model(tmp_path, "timm", tmp_path / "out")
    assert _one_line(err) == f"{file}: {message}" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "tensor", [("encoder.blocks.0.attn.qkv.weight", NAN), ("head.bias", -INF)], ids=["nan", "inf"]
)
def test_a_classifier_with_a_non_finite_weight_is_refused_as_it_is_read(tmp_path, tensor):
    file = _classifier(tmp_path / "best.safetensors", tensor=tensor)
    assert read_classifier_spec(file).num_classes == 2  # the header is sound
    line = f"{file}: tensor {tensor[0]} holds 1 non-finite values (NaN or inf) of "
    with pytest.raises(ClassifierError) as err:
        load_classifier(file)
    assert _one_line(err).startswith(line)
    with pytest.raises(ClassifierError) as err:
        export_model(file, "hf", tmp_path / "out")
    assert _one_line(err).startswith(line) and not (tmp_path / "out").exists()


def test_names_that_differ_only_in_spaces_are_distinct_classes(tmp_path):
    """Every reader matches class names exactly (a source's folders, id2label)."""
    file = _classifier(tmp_path / "model.safetensors", names=("cat", "cat "))
    assert load_classifier(file)[1].label_names == ("cat", "cat ")


@pytest.mark.parametrize(
    "damage, message",
    [
        ({"tensor": ("encoder.patch_embed.weight", NAN)}, "tensor encoder.patch_embed.weight"),
        ({"names": ("a", "b", "a")}, "classes 0 and 2 are both named 'a'"),
    ],
    ids=["nan-weight", "duplicate-name"],
)
def test_predict_refuses_the_classifier_before_any_image(tmp_path, damage, message):
    """Both ran to the end with exit 0 before the fix (issue 47: every score a bare NaN and
    one label; two classes named `a`, and a top-1 that the rows contradict)."""
    rng = np.random.default_rng(0)
    for i, name in enumerate(("a", "b")):
        (tmp_path / "images" / name).mkdir(parents=True)
        pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "images" / name / f"{i}.png")
    file = _classifier(tmp_path / "model.safetensors", **damage)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(file), "--source", str(tmp_path / "images"), "--output", str(out)]
    with pytest.raises(SystemExit) as err:
        pipeline("predict")([*argv, "--ignore-labels", "--top-k", "1", "--workers", "0"])
    assert message in _one_line(err) and str(file) in str(err.value)
    assert not list(out.glob("predictions.*"))


def test_an_encoder_with_a_nan_weight_or_std_is_refused_as_it_is_read(tmp_path):
    """By fine-tuning's and few-shot's init and by export, where the file is read."""
    vit = vit_module.ViT(16, 4, 8, 1, 2)
    # The pixel normalisation stored with an encoder: a NaN std passed `std > 0` (NaN <= 0 is
    # false), and divided every input into NaN.
    file = tmp_path / "encoder.safetensors"
    save_encoder(vit, file, CLS, PixelStats((0.5,) * 3, (0.5, NAN, 0.5)))
    with torch.no_grad():
        vit.blocks[0].mlp[0].weight[3, 1] = NAN
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    save_encoder(vit, ckpt / "encoder.safetensors", CLS)
    write_manifest(ckpt, step=1)  # a valid checkpoint: the manifest vouches for the bytes only
    line = f"{ckpt / 'encoder.safetensors'}: tensor blocks.0.mlp.0.weight holds 1 non-finite"
    with pytest.raises(ConfigError) as err:
        preflight.load_init_encoder(
            "init.checkpoint", str(tmp_path / "run"), ModelConfig(image_size=16), "bicubic", "auto"
        )
    assert _one_line(err).startswith(f"init.checkpoint={str(ckpt)!r}: {line}")
    with pytest.raises(CheckpointError, match=line):
        export_model(tmp_path / "run", "timm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError) as err:
        read_pixel_norm(file)
    why = "std must be finite, got [0.5, nan, 0.5]"
    assert _one_line(err) == f"{file}: malformed pixel_norm metadata ({why})"


def _strict(text: str):
    """json.loads that fails on a bare NaN / Infinity (JSON has neither)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text!r}"))


def test_no_file_the_project_writes_holds_a_bare_nan(tmp_path):
    metrics = MetricsWriter(tmp_path)
    metrics.log({"step": 1, "loss": torch.tensor(NAN), "img_per_s": INF, "lr": 0.5})
    metrics.log({"step": 2, "loss": 1.5, "img_per_s": 10.0, "lr": 0.5})
    metrics.truncate_after(1)  # rewritten on resume
    metrics.write_results({"loss": NAN, "fewshot": {"summary": {"5shot": -INF}}, "step": 1})
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": None, "img_per_s": None, "lr": 0.5}]  # a diverged loss
    results = _strict((tmp_path / "results.json").read_text())
    assert results == {"loss": None, "fewshot": {"summary": {"5shot": None}}, "step": 1}
    # Where no value may be non-finite (an export's config, a manifest), one is a bug: one
    # line naming the file and the key, the file not written.
    with pytest.raises(JsonFileError) as err:
        write_json(tmp_path / "config.json", {"pretrained_cfg": {"mean": [0.5, NAN, 0.5]}})
    assert _one_line(err) == (
        f"{tmp_path / 'config.json'}: pretrained_cfg.mean[1] (nan) is not a finite number, "
        "which JSON cannot hold"
    )
    assert not (tmp_path / "config.json").exists()
    for fmt in ("jsonl", "csv"):  # predictions: a NaN score names the image, no row written
        writer = PredictionWriter(tmp_path, fmt, ["cat", "dog"], labelled=False)
        writer.write(Predicted(0, ["a.png"], [-1], [[1, 0]], [[0.75, 0.25]], []))
        with pytest.raises(JsonFileError, match=r"image 'b.png': score \(nan\) is not a finite"):
            writer.write(Predicted(1, ["b.png"], [-1], [[0, 1]], [[NAN, NAN]], []))
        writer.abort()
        assert not (tmp_path / f"predictions.{fmt}").exists()
    assert math.isnan(metrics.log({"step": 3, "loss": NAN})["loss"])  # the console still sees NaN
