"""timm `VisionTransformer` layout (timm/models/vision_transformer.py, default arguments).

Our encoder is timm's default ViT (class token, position embeddings including the class
token, pre-LN blocks with a fused qkv, exact GELU, LayerNorm eps 1e-6, final norm), so the
weights map one to one; only a few module names differ. A fine-tuned classifier's head is
timm's `head` as it is; its pooling maps to `global_pool` (see `timm_model_args`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ssl_vit.config.variants import VARIANTS
from ssl_vit.interop import keymap
from ssl_vit.interop.keymap import InteropError, Table

__all__ = ["from_timm", "timm_config", "to_timm"]

TIMM_KEYS: Table = [
    ("cls_token", "cls_token"),
    ("pos_embed", "pos_embed"),
    ("patch_embed.{p}", "patch_embed.proj.{p}"),
    ("blocks.{i}.norm1.{p}", "blocks.{i}.norm1.{p}"),
    ("blocks.{i}.attn.qkv.{p}", "blocks.{i}.attn.qkv.{p}"),
    ("blocks.{i}.attn.proj.{p}", "blocks.{i}.attn.proj.{p}"),
    ("blocks.{i}.norm2.{p}", "blocks.{i}.norm2.{p}"),
    ("blocks.{i}.mlp.0.{p}", "blocks.{i}.mlp.fc1.{p}"),
    ("blocks.{i}.mlp.2.{p}", "blocks.{i}.mlp.fc2.{p}"),
    ("norm.{p}", "norm.{p}"),
]
# A classifier is not part of the encoder: dropped on import (and never written on export).
TIMM_HEAD_KEYS = ("head.weight", "head.bias")
# Our classifier's pooling -> timm's global_pool.
TIMM_POOLS = {"cls": "token", "gap": "avg"}
# timm builds LayerNorm(eps=1e-6) and has no config argument for another epsilon.
TIMM_NORM_EPS = 1e-6
# timm's name of each of our variants, found by (width, depth, heads) (config.variants).
_TIMM_NAMES = {"Ti": "tiny", "S": "small", "B": "base", "L": "large", "H": "huge"}
_FAMILIES = {VARIANTS[v]: name for v, name in _TIMM_NAMES.items()}


def timm_architecture(cfg: dict[str, Any]) -> str:
    """The registered timm name of this shape when there is one (e.g. vit_base_patch16_224),
    else vit_base_patch16_224 as the entry point that the explicit model_args reshape."""
    family = _FAMILIES.get((cfg["width"], cfg["depth"], cfg["heads"]))
    if family and cfg["mlp_ratio"] == 4.0:
        import timm  # a dependency, imported only here: it takes ~1 s

        name = f"vit_{family}_patch{cfg['patch_size']}_{cfg['image_size']}"
        if timm.is_model(name):
            return name
    return "vit_base_patch16_224"


def timm_model_args(cfg: dict[str, Any], num_classes: int = 0, pool: str = "cls") -> dict[str, Any]:
    """VisionTransformer keyword arguments of our encoder, with a `num_classes`-way head on
    the `pool` representation (0: no classifier)."""
    args = dict(
        img_size=cfg["image_size"],
        patch_size=cfg["patch_size"],
        embed_dim=cfg["width"],
        depth=cfg["depth"],
        num_heads=cfg["heads"],
        mlp_ratio=cfg["mlp_ratio"],
        qkv_bias=True,
        class_token=True,
        global_pool=TIMM_POOLS[pool],
        num_classes=num_classes,
    )
    if pool == "gap":
        # Ours applies the final norm to every token, then averages the patch tokens; timm's
        # 'avg' default (fc_norm=None) would drop that norm and normalize after pooling.
        args["fc_norm"] = False
    return args


def timm_config(
    cfg: dict[str, Any],
    mean: tuple[float, ...],
    std: tuple[float, ...],
    label_names: tuple[str, ...] = (),
    pool: str = "cls",
) -> dict[str, Any]:
    """config.json in timm's hub format, read by create_model('local-dir:DIR'): the encoder,
    or with `label_names` a classifier (one class per name, in label order) on `pool`."""
    size, num_classes = cfg["image_size"], len(label_names)
    pretrained_cfg = {
        "tag": "ssl_vit",
        "input_size": [3, size, size],
        "fixed_input_size": True,
        # ssl-vit's eval transform: bilinear resize of the shorter side, center crop.
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
        "mean": list(mean),
        "std": list(std),
        "num_classes": num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }
    if label_names:
        pretrained_cfg["label_names"] = list(label_names)
    return {
        "architecture": timm_architecture(cfg),
        "num_classes": num_classes,
        "num_features": cfg["width"],
        "global_pool": TIMM_POOLS[pool],
        "model_args": timm_model_args(cfg, num_classes, pool),
        "pretrained_cfg": pretrained_cfg,
    }


def to_timm(
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    head: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Our encoder state dict -> timm VisionTransformer(num_classes=0) state dict; with a
    classifier's `head` {weight [K, D], bias [K]}, VisionTransformer(num_classes=K)'s."""
    keymap.check_model_config(cfg, "timm")
    if not math.isclose(cfg.get("norm_eps", 1e-6), TIMM_NORM_EPS, rel_tol=1e-9):
        raise InteropError(
            f"norm_eps={cfg['norm_eps']} does not map to timm (its VisionTransformer builds "
            f"LayerNorm with eps {TIMM_NORM_EPS}; export to hf instead)"
        )
    out, unmatched = keymap.rename(state, TIMM_KEYS)
    if unmatched:
        raise InteropError(f"weights with no timm equivalent: {unmatched}")
    if head is not None:
        out.update({f"head.{k}": v for k, v in head.items()})
    return out


def _infer_config(state: dict[str, torch.Tensor], heads: int | None, source: str) -> dict:
    if not {"cls_token", "patch_embed.proj.weight", "pos_embed"} <= state.keys():
        raise InteropError(
            f"{source}: not a timm ViT with a [class] token (missing cls_token, pos_embed or "
            "patch_embed.proj.weight)"
        )
    width = state["cls_token"].shape[-1]
    patch = state["patch_embed.proj.weight"].shape[-1]
    num_patches = state["pos_embed"].shape[1] - 1
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise InteropError(
            f"{source}: pos_embed has {num_patches + 1} positions, not [class] + a square grid "
            "(timm models without position embeddings for the class token, with register "
            "tokens or non-square grids do not map)"
        )
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    if heads is None:
        raise InteropError(
            f"{source}: the number of attention heads is not in the weights; "
            "pass heads (ssl-vit import --heads N) or a config.json with model_args"
        )
    fc1 = state.get("blocks.0.mlp.fc1.weight")  # absent: reported as missing below
    hidden = fc1.shape[0] if fc1 is not None else 4 * width
    return {
        "variant": "",
        "image_size": side * patch,
        "patch_size": patch,
        "width": width,
        "depth": depth,
        "heads": heads,
        "mlp_ratio": keymap.mlp_ratio_for(hidden, width),
        "norm_eps": TIMM_NORM_EPS,
    }


def from_timm(
    state: dict[str, torch.Tensor], heads: int | None, source: str = "timm weights"
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """timm ViT state dict -> (our encoder state, model config, dropped head keys).

    Raises InteropError listing missing and unexpected keys (anything but the classifier)."""
    dropped = sorted(k for k in state if k in TIMM_HEAD_KEYS)
    state = {k: v for k, v in state.items() if k not in TIMM_HEAD_KEYS}
    cfg = _infer_config(state, heads, source)
    ours, unexpected = keymap.rename(state, TIMM_KEYS, reverse=True)
    keymap.check_complete(ours, cfg, source, unexpected)
    return ours, cfg, dropped
