"""`ssl-vit export` / `ssl-vit import`: checkpoint <-> timm or transformers directory.

An export directory holds `model.safetensors` (the encoder in the target's names, pretraining
resolution and position embeddings included; a fine-tuned classifier's is
`ssl_vit.publish.export_classifier`), `config.json` (timm's hub format, with the
preprocessing in its pretrained_cfg, or a transformers ViTConfig plus
`preprocessor_config.json`) and a `README.md` model card. The masked-prediction head has no place
in either library; `keep_head` writes it next to them in our own names
(`masked_patch_head.safetensors`).

Both directions write beside the output directory and rename into place (`atomic.staged_dir`),
and never into or over what a job owns or reads: a run directory, a training checkpoint, a shard
dataset, or (with `overwrite`) the source itself or a folder holding it or inside it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ssl_vit.atomic import staged_dir, write_json, writing
from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.config.schema import ModelConfig
from ssl_vit.errors import ConfigError
from ssl_vit.interop import detect_format, hf_config, hf_preprocessor, timm_config, to_hf, to_timm
from ssl_vit.model.vit import build_vit
from ssl_vit.publish.model_card import model_card, run_config
from ssl_vit.runs.occupancy import check_not_source, occupant
from ssl_vit.train import checkpoint as ckpt
from ssl_vit.train.checkpoint import ENCODER_FILE
from ssl_vit.train.encoder_init import load_any_encoder

__all__ = ["check_output", "check_target", "export_checkpoint", "import_weights", "write_export"]

log = logging.getLogger(__name__)
HEAD_FILE = "masked_patch_head.safetensors"
TARGETS = ("timm", "hf")


def export_checkpoint(
    checkpoint: str | Path,
    to: str,
    outdir: str | Path,
    keep_head: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the encoder of an ssl-vit checkpoint (verified) as a timm or transformers model
    directory. It is written beside `outdir` and renamed into place, so a failure leaves
    `outdir` as it was; a non-empty `outdir` is replaced only with `overwrite`.

    Raises InteropError (a ValueError) naming what does not map. Returns a summary."""
    checkpoint, out = Path(checkpoint), Path(outdir)
    check_target(to)
    check_output(out, {"checkpoint": str(checkpoint)}, overwrite)
    state, model_cfg = ckpt.load_encoder(checkpoint)
    mean, std = _pixel_norm(checkpoint)
    processor = None
    if to == "timm":
        weights, config = to_timm(state, model_cfg), timm_config(model_cfg, mean, std)
    else:
        weights, config = to_hf(state, model_cfg), hf_config(model_cfg)
        processor = hf_preprocessor(model_cfg, mean, std)
    extra = {}
    if keep_head:
        extra[HEAD_FILE] = (ckpt.load_head(checkpoint), {"model_config": json.dumps(model_cfg)})
    n_params = sum(v.numel() for v in weights.values())
    card = model_card(checkpoint, to, out, model_cfg, config, n_params)
    write_export(out, weights, config, card, processor, extra)
    log.info(
        "exported %s (%d tensors, %d parameters) to %s", checkpoint, len(weights), n_params, out
    )
    return {
        "format": to,
        "outdir": str(out),
        "tensors": len(weights),
        "parameters": n_params,
        "model_config": model_cfg,
    }


def check_target(to: str) -> None:
    if to not in TARGETS:
        raise ConfigError(f"--to must be one of {TARGETS}, got {to!r}")


def write_export(
    out: Path,
    weights: dict[str, torch.Tensor],
    config: dict[str, Any],
    card: str,
    processor: dict[str, Any] | None = None,
    extra: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None,
) -> None:
    """An export directory, staged beside `out` and renamed into place: model.safetensors,
    config.json, preprocessor_config.json (transformers), `extra` {file name: (tensors,
    metadata)} and the README.md model card."""
    with staged_dir(out) as tmp, writing(out):
        # "format": "pt" is what transformers checks in the safetensors header.
        ckpt.save_weights(weights, tmp / "model.safetensors", {"format": "pt"})
        write_json(tmp / "config.json", config, indent=2)
        if processor is not None:
            write_json(tmp / "preprocessor_config.json", processor, indent=2)
        for name, (tensors, metadata) in (extra or {}).items():
            ckpt.save_weights(tensors, tmp / name, metadata)
        (tmp / "README.md").write_text(card)


def _pixel_norm(checkpoint: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The encoder's pixel mean and std: stored with it, else its run's config.yaml, else
    PIXEL_NORM (checkpoints written before the encoder carried them)."""
    stored = ckpt.read_pixel_norm(checkpoint)
    if stored is not None:
        return stored.mean, stored.std
    data = run_config(checkpoint).get("data", {})
    return tuple(data.get("mean") or PIXEL_NORM), tuple(data.get("std") or PIXEL_NORM)


def check_output(out: Path, sources: dict[str, str], overwrite: bool) -> None:
    """Refuse to write the directory `out` (before anything is read or written): with
    `overwrite`, when it is, holds or is inside one of the `sources` {name: path} (a checkpoint:
    its whole run directory); when it is, holds or lies in a run directory, checkpoint or shard
    dataset (whatever `overwrite` says); when it is not empty and `overwrite` is not given."""
    if overwrite:
        check_not_source("outdir", out, sources)
    why = occupant(out)
    if why is not None:
        raise FileExistsError(f"{out}: {why}, which is never written into or replaced here")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty; pass --overwrite to replace it")


def import_weights(
    source: str | Path,
    fmt: str,
    outdir: str | Path,
    heads: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """timm / transformers ViT weights -> an ssl-vit encoder directory (encoder.safetensors
    with its model config), usable as `init.checkpoint` and by `fewshot.py --checkpoint`.
    Written beside `outdir` and renamed into place; a non-empty `outdir` is replaced only with
    `overwrite`, and never when it is a checkpoint or run directory (`check_output`)."""
    out = Path(outdir)
    check_output(out, {"source": str(source)}, overwrite)
    fmt = detect_format(source) if fmt == "auto" else fmt
    state, cfg = load_any_encoder(source, fmt, heads)
    pixels = ckpt.read_pixel_norm(source)  # what the source's folder records, if anything
    encoder = build_vit(ModelConfig.from_saved(cfg))
    encoder.load_state_dict(state, strict=True)  # keys and shapes were checked on reading
    with staged_dir(out) as tmp, writing(out):
        ckpt.save_encoder(encoder, tmp / ENCODER_FILE, cfg, pixels)
        record = {"source": str(source), "format": fmt, "model_config": cfg}
        record["pixel_norm"] = pixels._asdict() if pixels is not None else None
        write_json(tmp / "source.json", record, indent=2)
    log.info("imported %s (%s) to %s", source, fmt, out / ENCODER_FILE)
    if pixels is None:
        log.warning(
            "%s records no pixel normalisation: jobs take data.mean / data.std as given "
            "(default 0.5); give the ones the weights were trained with",
            source,
        )
    else:
        log.info("pixel normalisation (the source's): mean %s, std %s", *map(list, pixels))
    return {"outdir": str(out), "model_config": cfg, "pixel_norm": record["pixel_norm"]}
