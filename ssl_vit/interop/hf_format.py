"""Hugging Face transformers `ViTModel` layout (the key names `save_pretrained` writes).

Same computation as ours: [class] token, position embeddings including it, pre-LN layers,
exact GELU ("gelu"), final LayerNorm. Two differences are mapped: the fused qkv projection is
stored as separate query / key / value matrices, and the LayerNorm epsilon is a config value
(1e-12 in Google's checkpoints; ours is 1e-6), carried in our config as `norm_eps`.
ViTModel's pooler (dense + tanh on the [class] token) has no counterpart: it is not written,
load with `add_pooling_layer=False` (or get a randomly initialized pooler with a warning).
A fine-tuned classifier with [class]-token pooling is `ViTForImageClassification` (its
`classifier` reads the [class] token after the final LayerNorm, as ours does); one pooling
the mean of patch tokens has no transformers equivalent.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ssl_vit.interop import keymap
from ssl_vit.interop.keymap import InteropError, Table

__all__ = ["from_hf", "hf_classifier_config", "hf_config", "hf_preprocessor", "to_hf"]

_L = "encoder.layer.{i}."
# Our side uses `attn.q/k/v` for the three thirds of the fused `attn.qkv`.
HF_KEYS: Table = [
    ("cls_token", "embeddings.cls_token"),
    ("pos_embed", "embeddings.position_embeddings"),
    ("patch_embed.{p}", "embeddings.patch_embeddings.projection.{p}"),
    ("blocks.{i}.norm1.{p}", _L + "layernorm_before.{p}"),
    ("blocks.{i}.attn.q.{p}", _L + "attention.attention.query.{p}"),
    ("blocks.{i}.attn.k.{p}", _L + "attention.attention.key.{p}"),
    ("blocks.{i}.attn.v.{p}", _L + "attention.attention.value.{p}"),
    ("blocks.{i}.attn.proj.{p}", _L + "attention.output.dense.{p}"),
    ("blocks.{i}.norm2.{p}", _L + "layernorm_after.{p}"),
    ("blocks.{i}.mlp.0.{p}", _L + "intermediate.dense.{p}"),
    ("blocks.{i}.mlp.2.{p}", _L + "output.dense.{p}"),
    ("norm.{p}", "layernorm.{p}"),
]
# transformers >= 5 names the same modules differently in memory (model.state_dict()); a
# file saved that way is first renamed to the names above.
_V5_KEYS: Table = [
    (_L + "attention.attention.query.{p}", "layers.{i}.attention.q_proj.{p}"),
    (_L + "attention.attention.key.{p}", "layers.{i}.attention.k_proj.{p}"),
    (_L + "attention.attention.value.{p}", "layers.{i}.attention.v_proj.{p}"),
    (_L + "attention.output.dense.{p}", "layers.{i}.attention.o_proj.{p}"),
    (_L + "layernorm_before.{p}", "layers.{i}.layernorm_before.{p}"),
    (_L + "layernorm_after.{p}", "layers.{i}.layernorm_after.{p}"),
    (_L + "intermediate.dense.{p}", "layers.{i}.mlp.fc1.{p}"),
    (_L + "output.dense.{p}", "layers.{i}.mlp.fc2.{p}"),
]
_QKV = re.compile(r"^(?P<head>blocks\.\d+)\.attn\.(?P<part>[qkv])\.(?P<tail>weight|bias)$")
# Not part of the encoder: ViTModel's pooler, ViTForImageClassification's classifier.
HF_HEAD_PREFIXES = ("pooler.", "classifier.")
# ViTForImageClassification holds the ViTModel (without pooler) as `vit`.
HF_CLASSIFIER_PREFIX = "vit."


def hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers.ViTModel (model_type vit)."""
    keymap.check_model_config(cfg, "transformers")
    return {
        "architectures": ["ViTModel"],
        "model_type": "vit",
        "hidden_size": cfg["width"],
        "num_hidden_layers": cfg["depth"],
        "num_attention_heads": cfg["heads"],
        "intermediate_size": int(cfg["width"] * cfg["mlp_ratio"]),
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "layer_norm_eps": cfg.get("norm_eps", 1e-6),
        "image_size": cfg["image_size"],
        "patch_size": cfg["patch_size"],
        "num_channels": 3,
        "qkv_bias": True,
        "encoder_stride": cfg["patch_size"],
        "pooler_output_size": cfg["width"],
        "pooler_act": "tanh",
        "initializer_range": 0.02,
        "dtype": "float32",
    }


def hf_classifier_config(cfg: dict[str, Any], label_names: tuple[str, ...]) -> dict[str, Any]:
    """config.json for transformers.ViTForImageClassification: one class per name, in label
    order (id2label / label2id)."""
    return {
        **hf_config(cfg),
        "architectures": ["ViTForImageClassification"],
        "id2label": {str(i): name for i, name in enumerate(label_names)},
        "label2id": {name: i for i, name in enumerate(label_names)},
        "problem_type": "single_label_classification",
    }


def hf_preprocessor(cfg: dict[str, Any], mean, std, crop: bool = False) -> dict[str, Any]:
    """preprocessor_config.json: the model's resolution, [0, 1] scaling and normalization.

    Without `crop`, ViTImageProcessor: it resizes to a square without cropping (ssl-vit's eval
    transform center-crops non-square images: the same for square inputs). With `crop`, ssl-vit's
    eval transform itself: BitImageProcessor resizes the shorter side to S (bilinear,
    antialiased) and takes the central S x S, as `ssl_vit.data.images.eval_transform`."""
    size = cfg["image_size"]
    resize = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": size, "width": size},
    }
    if crop:
        resize = {
            "image_processor_type": "BitImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_convert_rgb": True,
        }
    return {
        **resize,
        "resample": 2,  # PIL bilinear, as ssl-vit's eval transform
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(mean),
        "image_std": list(std),
    }


def to_hf(
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    head: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Our encoder state dict -> ViTModel state dict (legacy key names, no pooler); with a
    classifier's `head` {weight [K, D], bias [K]}, ViTForImageClassification's (`vit.*` and
    `classifier.*`)."""
    keymap.check_model_config(cfg, "transformers")
    split = {}
    for key, value in state.items():
        if ".attn.qkv." in key:  # rows: q of all heads, then k, then v (see Attention.forward)
            for part, chunk in zip("qkv", value.chunk(3, dim=0), strict=True):
                split[key.replace(".attn.qkv.", f".attn.{part}.")] = chunk.contiguous()
        else:
            split[key] = value
    out, unmatched = keymap.rename(split, HF_KEYS)
    if unmatched:
        raise InteropError(f"weights with no transformers equivalent: {unmatched}")
    if head is not None:
        out = {HF_CLASSIFIER_PREFIX + k: v for k, v in out.items()}
        out.update({f"classifier.{k}": v for k, v in head.items()})
    return out


def _model_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Our model config from a ViTConfig dict; raise on settings our ViT does not have."""
    bad = []
    if hf.get("model_type", "vit") != "vit":
        bad.append(f"model_type={hf.get('model_type')!r} (only 'vit')")
    if hf.get("hidden_act", "gelu") != "gelu":
        bad.append(f"hidden_act={hf.get('hidden_act')!r} (only exact 'gelu')")
    if not hf.get("qkv_bias", True):
        bad.append("qkv_bias=false")
    if hf.get("num_channels", 3) != 3:
        bad.append(f"num_channels={hf.get('num_channels')}")
    size, patch = hf.get("image_size", 224), hf.get("patch_size", 16)
    size = size[0] if isinstance(size, list) and len(set(size)) == 1 else size
    patch = patch[0] if isinstance(patch, list) and len(set(patch)) == 1 else patch
    if not isinstance(size, int) or not isinstance(patch, int):
        bad.append(f"non-square image_size={size} / patch_size={patch}")
    if bad:
        raise InteropError(f"{source}: does not map to an ssl-vit ViT: {'; '.join(bad)}")
    width = hf.get("hidden_size", 768)
    return {
        "variant": "",
        "image_size": size,
        "patch_size": patch,
        "width": width,
        "depth": hf.get("num_hidden_layers", 12),
        "heads": hf.get("num_attention_heads", 12),
        "mlp_ratio": keymap.mlp_ratio_for(hf.get("intermediate_size", 3072), width),
        "norm_eps": float(hf.get("layer_norm_eps", 1e-12)),
    }


def from_hf(
    state: dict[str, torch.Tensor], hf: dict[str, Any], source: str = "transformers weights"
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """ViTModel / ViTForImageClassification state dict + its config.json -> (our encoder
    state, model config, dropped head keys). Raises InteropError listing missing and
    unexpected keys (anything but the pooler / classifier)."""
    cfg = _model_config(hf, source)
    state = {k.removeprefix(HF_CLASSIFIER_PREFIX): v for k, v in state.items()}
    dropped = sorted(k for k in state if k.startswith(HF_HEAD_PREFIXES))
    state = {k: v for k, v in state.items() if not k.startswith(HF_HEAD_PREFIXES)}
    legacy, rest = keymap.rename(state, _V5_KEYS, reverse=True)
    legacy.update({k: state[k] for k in rest})
    split, unexpected = keymap.rename(legacy, HF_KEYS, reverse=True)
    ours, thirds = {}, {}
    for key, value in split.items():
        m = _QKV.match(key)
        if m:
            thirds.setdefault((m["head"], m["tail"]), {})[m["part"]] = value
        else:
            ours[key] = value
    for (head, tail), parts in thirds.items():
        if len(parts) == 3:
            ours[f"{head}.attn.qkv.{tail}"] = torch.cat([parts[c] for c in "qkv"], dim=0)
        else:  # an incomplete triple: the fused key is reported missing, the pieces unexpected
            pieces = {f"{head}.attn.{c}.{tail}": parts[c] for c in parts}
            unexpected += list(keymap.rename(pieces, HF_KEYS)[0])
    keymap.check_complete(ours, cfg, source, sorted(unexpected))
    return ours, cfg, dropped
