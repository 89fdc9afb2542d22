"""The fine-tuned classifier file: `model.safetensors` of a fine-tuning run.

It holds the weights (encoder and head) and, in its metadata, everything it takes to use them:
the encoder's shape at the fine-tuning resolution, the pooling, the class names in label order
and the evaluation transform with its pixel normalisation. `ssl-vit predict`, a distillation
teacher and `ssl-vit export` read this file and nothing else, so they all see the fine-tune's
own preprocessing (a checkpoint carries what it takes to use it, as timm's `pretrained_cfg`).

The metadata is untrusted input: the tensors' shapes are compared with what it describes
before any model is built from it, the pixel normalisation must be finite with a std > 0 and
the class names distinct and not blank (two classes of one name make the rows' labels
ambiguous and the accuracy contradict them); the weights must be finite. Whether a file is a
classifier at all is decided from its metadata, never its name (`file_kind`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssl_vit.atomic import replacing
from ssl_vit.config.schema import ModelConfig
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.jsonfile import parse_json
from ssl_vit.model.pixels import pixel_norm_problem
from ssl_vit.model.shapes import size_mismatch
from ssl_vit.train.weights_file import WeightsFileError, check_finite, read_header

__all__ = [
    "CLASSIFIER_FILE",
    "ClassifierSpec",
    "file_kind",
    "find_classifier",
    "load_classifier",
    "read_classifier_spec",
    "save_classifier",
]

CLASSIFIER_FILE = "model.safetensors"
# The one evaluation transform (ssl_vit.data.images.eval_transform): the shorter side resized
# to image_size (bilinear, antialiased), then the central image_size x image_size square.
EVAL_RESIZE = "shorter_side_bilinear_center_crop"
_MAX_METADATA = 1 << 20  # bytes of JSON metadata a classifier may carry


class ClassifierError(InputError):
    """A file that is not a usable fine-tuned classifier: one line naming it."""


@dataclass(frozen=True)
class ClassifierSpec:
    """What a fine-tuned classifier needs besides its weights."""

    model_config: dict[str, Any]  # the encoder at the fine-tuning resolution (image_size)
    pool: str  # cls or gap
    label_names: tuple[str, ...]  # class names in label order
    mean: tuple[float, float, float]  # pixel normalisation of [0, 1] RGB
    std: tuple[float, float, float]
    resize: str = EVAL_RESIZE

    @property
    def image_size(self) -> int:
        return int(self.model_config["image_size"])

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def metadata(self) -> dict[str, str]:
        preprocess = {
            "image_size": self.image_size,
            "resize": self.resize,
            "mean": list(self.mean),
            "std": list(self.std),
        }
        return {
            "format": "pt",
            "model_config": json.dumps(self.model_config),
            "pool": self.pool,
            "label_names": json.dumps(list(self.label_names)),
            "preprocess": json.dumps(preprocess),
        }

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], path: Path) -> ClassifierSpec:
        """The spec from a file's metadata; ClassifierError naming `path` if it is none."""
        kind = _kind(meta)
        if kind != "classifier":
            what = "an encoder" if kind == "encoder" else "not an ssl-vit model"
            raise ClassifierError(
                f"{path}: {what}, not a fine-tuned classifier (its metadata has no label names)"
            )
        if sum(len(v) for v in meta.values()) > _MAX_METADATA:
            raise ClassifierError(f"{path}: metadata over {_MAX_METADATA} bytes")
        try:
            model = ModelConfig.from_saved(parse_json(meta["model_config"], "model_config"))
            names = parse_json(meta["label_names"], "label_names", list)
            pre = parse_json(meta["preprocess"], "preprocess")
            mean, std = pre["mean"], pre["std"]
            if pre["image_size"] != model.image_size or pre["resize"] != EVAL_RESIZE:
                raise ValueError(f"unknown preprocessing {pre}")
        except KeyError as e:
            raise ClassifierError(f"{path}: classifier metadata lacks {e}") from None
        except (ValueError, TypeError, ConfigError) as e:
            raise ClassifierError(f"{path}: malformed classifier metadata: {e}") from None
        pixels = pixel_norm_problem(mean, std)  # a std of 0 or a NaN: every row NaN
        why = f"preprocess.{pixels}" if pixels else _label_names_problem(names)
        if why is None and meta.get("pool") not in ("cls", "gap"):
            why = f"unknown pooling {meta.get('pool')!r}"
        if why is not None:
            raise ClassifierError(f"{path}: {why}")
        from ssl_vit.config.loader import to_dict

        mean, std = (tuple(map(float, v)) for v in (mean, std))
        return cls(to_dict(model), meta["pool"], tuple(names), mean, std)


def _label_names_problem(names: Any) -> str | None:
    """What makes `names` unusable as class names (a non-empty list of distinct strings, none
    blank), or None. Names that differ only in spaces are distinct classes: every reader
    matches them exactly (predict's source folders, id2label)."""
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return "label_names must be a non-empty list of names"
    blank = [i for i, n in enumerate(names) if not n.strip()]
    if blank:
        return f"label_names: class {blank[0]} has a blank name {names[blank[0]]!r}"
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            return f"label_names: classes {seen[name]} and {i} are both named {name!r}"
        seen[name] = i
    return None


def save_classifier(model: nn.Module, path: str | Path, spec: ClassifierSpec) -> None:
    """The classifier's weights and `spec` as one safetensors file, written atomically
    (`atomic.replacing`)."""
    from ssl_vit.train.checkpoint import save_weights

    with replacing(path) as tmp:
        save_weights(model.state_dict(), tmp, spec.metadata())


def find_classifier(path: str | Path) -> Path:
    """The classifier file that `path` names: the file itself, or a fine-tuning run directory's
    `model.safetensors`. ClassifierError (one line) when there is none."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        if not (path / CLASSIFIER_FILE).is_file():
            why = (
                "a pretraining run or checkpoint (no model.safetensors): fine-tune it first"
                if (path / "checkpoints").is_dir() or (path / "encoder.safetensors").is_file()
                else f"no {CLASSIFIER_FILE} in it (a fine-tuning run writes one when it ends)"
            )
            raise ClassifierError(f"{path}: {why}")
        path = path / CLASSIFIER_FILE
    if not path.is_file():
        raise ClassifierError(f"{path}: no such file or run directory")
    return path


def file_kind(path: str | Path) -> str | None:
    """What the weights file at `path` (or a directory's model.safetensors) is, from its
    metadata alone, whatever its name: 'classifier' (it names labels), 'encoder' (a model
    config and no labels: a checkpoint's encoder.safetensors), 'other' (neither: timm or
    transformers weights, an export), 'unreadable' (not a safetensors file, or damaged: the
    caller's own reader says why); None when there is no such file."""
    path = Path(os.path.expanduser(str(path)))
    file = path / CLASSIFIER_FILE if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        return _kind(_header(file)[0])
    except ClassifierError:
        return "unreadable"


def _kind(meta: Mapping[str, str]) -> str:
    """The one test of what a weights file is, from its metadata (see `file_kind`)."""
    if "label_names" in meta:
        return "classifier"
    return "encoder" if "model_config" in meta else "other"


def _header(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(metadata, tensor shapes) from the safetensors header, without reading any tensor."""
    try:
        return read_header(path)
    except WeightsFileError as e:
        raise ClassifierError(str(e)) from None


def read_classifier_spec(path: str | Path) -> ClassifierSpec:
    """The spec of the classifier at `path` (a run directory or its model.safetensors), read
    from the header only."""
    file = find_classifier(path)
    return ClassifierSpec.from_metadata(_header(file)[0], file)


def build_classifier(spec: ClassifierSpec) -> nn.Module:
    """An (untrained) classifier of `spec`'s shape, taking uint8 images."""
    from ssl_vit.model import Classifier, PixelNorm, build_vit

    encoder = build_vit(ModelConfig.from_saved(spec.model_config))
    return Classifier(encoder, spec.num_classes, spec.pool, PixelNorm(spec.mean, spec.std))


def load_classifier(path: str | Path) -> tuple[nn.Module, ClassifierSpec]:
    """(the classifier in eval mode on the CPU, its spec) from a fine-tuning run directory or
    its model.safetensors. The tensors' shapes are checked against the metadata's model before
    it is built, so a file whose metadata lies allocates nothing."""
    from safetensors.torch import load_file

    file = find_classifier(path)
    meta, shapes = _header(file)
    spec = ClassifierSpec.from_metadata(meta, file)
    # The sizes first, by arithmetic: the meta-device build below takes time in the depth and
    # width claimed (depth 10^6 would take minutes), the tensors bound them.
    encoder = {k.removeprefix("encoder."): v for k, v in shapes.items() if k.startswith("encoder.")}
    why = size_mismatch(ModelConfig.from_saved(spec.model_config), encoder)
    if why is not None:
        raise ClassifierError(f"{file}: {why}")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_classifier(spec).state_dict().items()}
    if shapes != expected:
        wrong = sorted(set(shapes) ^ set(expected)) or [
            f"{k} {shapes[k]} != {expected[k]}" for k in expected if shapes[k] != expected[k]
        ]
        raise ClassifierError(
            f"{file}: tensors do not fit the model its metadata describes: {wrong[:4]}"
        )
    model = build_classifier(spec)
    try:
        state = load_file(str(file))
        check_finite(state, file)  # a NaN weight: every row NaN, refused before any image
        model.load_state_dict(state, strict=True)
    except WeightsFileError as e:
        raise ClassifierError(str(e)) from None
    except Exception as e:
        raise ClassifierError(f"{file}: cannot read its weights: {e}") from None
    return model.eval(), spec
