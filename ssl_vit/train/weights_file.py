"""The header of a safetensors weights file, read and checked before any tensor or model.

Every weights file a job reads (a checkpoint's `encoder.safetensors`, a fine-tuned
`model.safetensors`, imported weights) is untrusted input. `read_header` gives its metadata and
tensor shapes without loading a tensor (a header length of 2^62, a damaged file: one line);
`saved_model` parses the `model_config` metadata (bounded JSON, a mapping), validates it as a
model config and compares it with the shapes actually present, so a file whose metadata claims
a model far larger than its tensors is refused before anything is allocated. Once read, the
tensors go through `check_finite`: one NaN weight makes every output NaN (every prediction the
same class, with a score of NaN), so a file holding one is refused as it is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ssl_vit.config.schema import ModelConfig
from ssl_vit.errors import ConfigError, InputError
from ssl_vit.jsonfile import parse_json
from ssl_vit.model.shapes import shape_mismatch

if TYPE_CHECKING:
    import torch

__all__ = ["WeightsFileError", "check_finite", "read_header", "saved_model"]

Shapes = dict[str, tuple[int, ...]]


class WeightsFileError(InputError):
    """A weights file that is unreadable or whose metadata does not fit its tensors: one line
    naming it."""


def read_header(path: str | Path) -> tuple[dict[str, str], Shapes]:
    """(metadata, tensor shapes) of the safetensors file at `path`, no tensor read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise WeightsFileError(f"{path}: not a readable safetensors file ({first})") from None
    return meta, shapes


def saved_model(
    meta: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]], path: str | Path
) -> ModelConfig:
    """The validated model config of a file's `model_config` metadata, once its encoder tensors
    (`shapes`, our state-dict names) are checked to be exactly those of that model."""
    saved = parse_json(meta["model_config"], f"{path}: model_config metadata")
    try:
        model = ModelConfig.from_saved(saved)
    except ConfigError as e:
        raise WeightsFileError(f"{path}: {e}") from None
    why = shape_mismatch(model, shapes)
    if why is not None:
        raise WeightsFileError(f"{path}: {why}")
    return model


def check_finite(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """WeightsFileError naming `path` and its first tensor holding a NaN or an infinity."""
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not v.isfinite().all()]
    if bad:
        v = tensors[bad[0]]
        n = int(v.numel() - v.isfinite().sum())
        more = f" (and {len(bad) - 1} more tensor{'s' * (len(bad) > 2)})" if len(bad) > 1 else ""
        raise WeightsFileError(
            f"{path}: tensor {bad[0]} holds {n} non-finite values (NaN or inf) of "
            f"{v.numel()}{more}: damaged weights, or saved from a diverged run"
        )
