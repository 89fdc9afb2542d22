"""Whether the tensors of a saved encoder are those of the model its metadata describes.

A model config read from a file (a checkpoint's `encoder.safetensors`, a classifier, imported
weights) is untrusted: a 2 KB file may claim width 32768 and depth 48, 13 GB once built. The
claim is compared with the tensor shapes the file holds (read from its header: nothing
allocated) before any model is built: first the sizes that scale the model (width, patch,
positions, depth, MLP), then, the model now known to be no larger than the file, every tensor
of it built on the meta device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ssl_vit.config.schema import ModelConfig
from ssl_vit.model.vit import build_vit

__all__ = ["expected_shapes", "shape_mismatch", "size_mismatch"]

Shapes = Mapping[str, tuple[int, ...]]


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "a scalar"


def size_mismatch(cfg: ModelConfig, shapes: Shapes, claim: str = "metadata") -> str | None:
    """The first size of `cfg` (validated) that the encoder tensor `shapes` (key -> shape, our
    state-dict names) contradict, as one line ('metadata says width 2048 but pos_embed is
    1x65x8'); None when width, patch, positions, depth and MLP size all agree. Arithmetic on
    the shapes only: safe whatever `cfg` claims."""
    unset = [k for k in ("patch_size", "width", "depth", "mlp_ratio") if getattr(cfg, k) is None]
    if unset:
        return f"{claim} gives no {', '.join(unset)}"
    width, patch, size = cfg.width, cfg.patch_size, cfg.image_size
    pos, proj = shapes.get("pos_embed"), shapes.get("patch_embed.weight")
    if pos is not None and (len(pos) != 3 or pos[-1] != width):
        return f"{claim} says width {width} but pos_embed is {_dims(pos)}"
    if proj is not None and proj != (width, 3, patch, patch):
        return f"{claim} says patch_size {patch} but patch_embed.weight is {_dims(proj)}"
    if pos is None or proj is None:
        key = "pos_embed" if pos is None else "patch_embed.weight"
        return f"{claim} describes a ViT encoder but there is no {key} tensor"
    positions = 1 + (size // patch) ** 2
    if pos != (1, positions, width):
        return (
            f"{claim} says image_size {size} with patch_size {patch} ({positions} positions) "
            f"but pos_embed is {_dims(pos)}"
        )
    blocks = {k.split(".")[1] for k in shapes if k.startswith("blocks.") and k.count(".") > 1}
    if len(blocks) != cfg.depth:
        return f"{claim} says depth {cfg.depth} but there are {len(blocks)} blocks"
    hidden, fc1 = int(width * cfg.mlp_ratio), shapes.get("blocks.0.mlp.0.weight")
    if fc1 is not None and fc1 != (hidden, width):
        return (
            f"{claim} says mlp_ratio {cfg.mlp_ratio} (hidden size {hidden}) but "
            f"blocks.0.mlp.0.weight is {_dims(fc1)}"
        )
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the state dict of `build_vit(cfg)`, built on the meta device (nothing
    allocated, but time and memory in the depth and width `cfg` claims: check the sizes first)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_vit(cfg).state_dict().items()}


def shape_mismatch(cfg: ModelConfig, shapes: Shapes, claim: str = "metadata") -> str | None:
    """`size_mismatch`, then every tensor: None when `shapes` are exactly the state dict of
    `build_vit(cfg)`, else one line naming what differs (missing, unexpected, wrong keys)."""
    why = size_mismatch(cfg, shapes, claim)
    if why is not None:
        return why
    expected = expected_shapes(cfg)  # bounded by the sizes just checked against the file
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    wrong = [
        f"{k} is {_dims(shapes[k])}, not {_dims(expected[k])}"
        for k in expected
        if k in shapes and tuple(shapes[k]) != expected[k]
    ]
    if not (missing or unexpected or wrong):
        return None
    parts = [f"missing {missing[:3]}"] if missing else []
    parts += [f"unexpected {unexpected[:3]}"] if unexpected else []
    parts += wrong[:3]
    return f"the tensors do not fit the encoder its {claim} describes: {'; '.join(parts)}"
