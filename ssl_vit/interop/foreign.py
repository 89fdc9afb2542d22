"""Reading encoder weights saved by timm or transformers (files or directories).

Weights are read with safetensors, or torch.load(weights_only=True) for .bin/.pth/.pt files,
never with pickle-executing loaders. Formats:
- `ssl_vit`: a checkpoint directory / encoder.safetensors with model_config metadata;
- `timm`: a state dict file (model.safetensors, *.pth, ...), or a directory with
  config.json (timm's hub format: `architecture`, optional `model_args`) and the weights;
- `hf`: a directory with config.json (model_type vit) and model.safetensors /
  pytorch_model.bin (also sharded, with an index).
"""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from ssl_vit.interop.hf_format import from_hf
from ssl_vit.interop.keymap import InteropError
from ssl_vit.interop.timm_format import from_timm
from ssl_vit.jsonfile import JsonFileError, read_json
from ssl_vit.model.pixels import pixel_norm_problem

__all__ = ["detect_format", "foreign_pixel_norm", "read_foreign", "read_weights"]

log = logging.getLogger(__name__)
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors")


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a torch file (weights_only=True)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        with warnings.catch_warnings():  # its pickle-protocol warning would precede our line
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refuses code and arbitrary objects
        raise InteropError(
            f"{path}: a pickle file; only safetensors and weights-only torch files "
            "(tensors in plain containers) are read"
        ) from None
    for key in ("state_dict", "model", "state_dict_ema"):  # training checkpoints nest it
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            return obj[key]
    return obj


def _weights_in(directory: Path) -> dict[str, torch.Tensor]:
    for name in _WEIGHT_FILES:
        if (directory / name).is_file():
            return read_weights(directory / name)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (directory / index).is_file():  # sharded: every file the index names
            weight_map = read_json(directory / index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and Path(f).name == f for f in weight_map.values()
            ):
                raise InteropError(f"{directory / index}: no weight_map of tensor to file name")
            files = sorted(set(weight_map.values()))
            return {k: v for f in files for k, v in read_weights(directory / f).items()}
    raise InteropError(f"{directory}: no weights ({' / '.join(_WEIGHT_FILES)})")


def _config(path: Path) -> dict[str, Any] | None:
    cfg = path / "config.json" if path.is_dir() else path.parent / "config.json"
    if not cfg.is_file():
        return None
    try:
        return read_json(cfg)
    except JsonFileError as e:
        raise InteropError(str(e)) from None


def detect_format(path: str | Path) -> str:
    """'ssl_vit', 'timm' or 'hf' for a checkpoint path (InteropError if none fits)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if path.is_dir() and (path / "encoder.safetensors").is_file():
        return "ssl_vit"
    if path.is_file() and path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - several types for damaged files (a 2^62 header)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise InteropError(f"{path}: not a readable safetensors file ({first})") from None
        if "model_config" in meta:
            return "ssl_vit"
    cfg = _config(path)
    if cfg is not None and "model_type" in cfg:
        return "hf"
    if cfg is not None and "architecture" in cfg:
        return "timm"
    if path.is_file():
        keys = read_weights(path).keys()
        if "patch_embed.proj.weight" in keys:
            return "timm"
        if any("patch_embeddings.projection" in k for k in keys):
            raise InteropError(
                f"{path}: transformers weights need their config.json: "
                "pass the directory holding both"
            )
    raise InteropError(
        f"{path}: not an ssl-vit checkpoint, timm ViT weights or a transformers "
        "ViT directory (config.json + model.safetensors)"
    )


def _timm_heads(cfg: dict[str, Any] | None) -> int | None:
    """num_heads from timm's config.json: model_args, else the registered architecture."""
    if not cfg:
        return None
    if "num_heads" in cfg.get("model_args", {}):
        return int(cfg["model_args"]["num_heads"])
    import timm

    arch = (cfg.get("architecture") or "").split(".")[0]
    if not arch or not timm.is_model(arch):
        return None
    with torch.device("meta"):
        model = timm.create_model(arch, pretrained=False)
    return model.blocks[0].attn.num_heads


def read_foreign(
    path: str | Path, fmt: str = "auto", heads: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(our encoder state dict, model config) from timm or transformers weights at `path`.

    `heads` is needed only for a bare timm state dict without config.json. Classifier and
    pooler weights are dropped (logged); any other missing or unexpected key is an error."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in ("timm", "hf"):
        raise InteropError(f"read_foreign reads timm or hf weights, not {fmt!r}")
    cfg = _config(path)
    if fmt == "hf" and cfg is None:
        raise InteropError(f"{path}: no config.json next to the transformers weights")
    state = _weights_in(path) if path.is_dir() else read_weights(path)
    if fmt == "hf":
        ours, model_cfg, dropped = from_hf(state, cfg, str(path))
    else:
        heads = heads if heads is not None else _timm_heads(cfg)
        ours, model_cfg, dropped = from_timm(state, heads, str(path))
    if dropped:
        log.info("%s: dropped the classifier / pooler weights %s", path, dropped)
    return ours, model_cfg


def foreign_pixel_norm(path: str | Path) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(mean, std) of [0, 1] RGB that timm or transformers weights at `path` were trained on,
    as their directory records it: timm's config.json `pretrained_cfg`, transformers'
    preprocessor_config.json `image_mean` / `image_std`; None where it records none (a bare
    state dict). InteropError naming the file when the values are no usable normalisation."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    cfg = _config(path) or {}
    timm_cfg, hf_proc = cfg.get("pretrained_cfg"), folder / "preprocessor_config.json"
    if isinstance(timm_cfg, dict) and "mean" in timm_cfg and "std" in timm_cfg:
        where, mean, std = folder / "config.json", timm_cfg["mean"], timm_cfg["std"]
    elif "model_type" in cfg and hf_proc.is_file():
        try:
            proc = read_json(hf_proc)
        except JsonFileError as e:
            raise InteropError(str(e)) from None
        if not proc.get("do_normalize", True) or "image_mean" not in proc:
            return None
        where, mean, std = hf_proc, proc["image_mean"], proc.get("image_std")
    else:
        return None
    if (why := pixel_norm_problem(mean, std)) is not None:
        raise InteropError(f"{where}: no usable pixel normalisation ({why})")
    return tuple(map(float, mean)), tuple(map(float, std))
