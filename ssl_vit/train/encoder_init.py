"""An encoder built from saved weights: an ssl-vit checkpoint or timm / transformers ViT
weights, for another image size if asked (its position embeddings 2D-interpolated), the shape
given by the config checked against the saved one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ssl_vit.config.frozen import validated
from ssl_vit.config.schema import SHAPE_KEYS, ModelConfig
from ssl_vit.config.variants import resolve_variant
from ssl_vit.train.checkpoint import CheckpointError, load_encoder

__all__ = ["ArchitectureError", "LoadedEncoder", "encoder_from_checkpoint", "load_any_encoder"]


class ArchitectureError(CheckpointError):
    """Shape keys set in a model config disagree with the checkpoint's (one line naming them)."""


def load_any_encoder(
    path: str | Path, fmt: str = "auto", heads: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict in our names, model config) from an ssl-vit checkpoint or from timm /
    transformers ViT weights (`fmt`: auto, ssl_vit, timm, hf; see ssl_vit.interop)."""
    from ssl_vit.interop import detect_format, read_foreign

    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "ssl_vit":
        return load_encoder(path)
    return read_foreign(path, fmt, heads)


class LoadedEncoder(NamedTuple):
    """What `encoder_from_checkpoint` returns: the encoder, the caller's model config completed
    from the checkpoint (a new object), and the checkpoint's own model config."""

    encoder: nn.Module
    model_config: ModelConfig
    saved: dict[str, Any]


def encoder_from_checkpoint(
    path: str | Path, model_cfg: ModelConfig, pos_interp: str = "bicubic", fmt: str = "auto"
) -> LoadedEncoder:
    """Build the encoder saved at `path` for `model_cfg.image_size` (which may differ from the
    pretraining resolution: the position embeddings are 2D-interpolated to the new grid).
    `path` may also hold timm or transformers ViT weights (`fmt`, see `load_any_encoder`).

    Shape fields (`SHAPE_KEYS`) set in `model_cfg` (not None) must match the checkpoint
    (ArchitectureError naming each `model.<key>` and both values); the returned config
    has them all, and the variant, from the checkpoint (`model_cfg` itself is left as it is)."""
    from ssl_vit.model.pos_embed import interpolate_pos_embed
    from ssl_vit.model.vit import build_vit

    # A bare timm state dict does not say its number of heads: model.heads does.
    state, saved = load_any_encoder(path, fmt, heads=model_cfg.heads)
    _check_same_shape(path, model_cfg, saved)
    resolved = dataclasses.replace(
        model_cfg,
        variant=saved.get("variant") or model_cfg.variant,
        **{k: saved[k] for k in SHAPE_KEYS},
    )
    validated(resolved)  # the checks of a loaded config (image_size a multiple of the patch)
    encoder = build_vit(resolved)
    old = saved["image_size"] // saved["patch_size"]
    if state["pos_embed"].shape != encoder.pos_embed.shape:
        state["pos_embed"] = interpolate_pos_embed(
            state["pos_embed"],
            encoder.grid,
            num_prefix_tokens=1,
            old_grid=(old, old),
            mode=pos_interp,
        )
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit the encoder (missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)})"
        )
    return LoadedEncoder(encoder, resolved, saved)


def _check_same_shape(path: str | Path, model_cfg: ModelConfig, saved: dict[str, Any]) -> None:
    """ArchitectureError unless every shape key set in `model_cfg` is the checkpoint's."""
    differ = [
        k
        for k in SHAPE_KEYS
        if getattr(model_cfg, k) is not None and getattr(model_cfg, k) != saved.get(k)
    ]
    if not differ:
        return
    from_variant = resolve_variant(model_cfg.variant) if model_cfg.variant else {}

    def given(k: str) -> str:
        value = getattr(model_cfg, k)
        via = f" (model.variant={model_cfg.variant})" if from_variant.get(k) == value else ""
        return f"model.{k}={value}{via}"

    verb = "disagrees" if len(differ) == 1 else "disagree"
    raise ArchitectureError(
        f"{', '.join(given(k) for k in differ)} {verb} with the checkpoint {path} "
        f"({', '.join(f'{k} {saved.get(k)}' for k in differ)})"
    )
