"""`ssl-vit export` of a fine-tuned classifier: a fine-tuning run's `model.safetensors` (encoder
and head, `ssl_vit.train.classifier_file`) as a whole timm or transformers classifier.

- timm: `VisionTransformer(num_classes=K)` with the head as timm's `head`, our pooling as its
  `global_pool` ('token', or 'avg' with the final norm before pooling, as ours), the class names
  and the fine-tune's eval transform in `pretrained_cfg`.
- transformers: `ViTForImageClassification` (id2label / label2id) with a `BitImageProcessor`
  that resizes the shorter side and center-crops, as our eval transform does. It classifies the
  [class] token, so a classifier pooling the mean of patch tokens (`pool: gap`) is refused.

Written at the fine-tuning resolution, staged and renamed into place like an encoder export
(`export.write_export`), with a model card naming the classes, the label budget and the
fine-tune's top-1 (`model_card.classifier_card`).

`export_model` is `ssl-vit export`: whether its source is a classifier or an encoder is decided
from the contents of the weights file it names (`export_source`), never from the file's name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ssl_vit import interop, jobs
from ssl_vit.errors import ConfigError
from ssl_vit.interop import InteropError
from ssl_vit.publish.export import check_output, check_target, export_checkpoint, write_export
from ssl_vit.publish.model_card import classifier_card
from ssl_vit.runs.occupancy import saved_job
from ssl_vit.train import classifier_file
from ssl_vit.train.checkpoint import resolve_checkpoint
from ssl_vit.train.classifier_file import (
    CLASSIFIER_FILE,
    ClassifierError,
    file_kind,
    read_classifier_spec,
)

__all__ = ["export_classifier", "export_model", "export_source"]

log = logging.getLogger(__name__)
ENCODER_MODEL = {"hf": "transformers ViTModel", "timm": "timm VisionTransformer with no head"}


def export_model(
    source: str | Path,
    to: str,
    outdir: str | Path,
    keep_head: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """`ssl-vit export`: the fine-tuned classifier or the encoder at `source` (`export_source`)
    as a timm or transformers directory. An encoder found where a classifier could be (a
    directory's model.safetensors, a file named on the command line) is said in one log line.
    Returns `export_classifier`'s summary (with num_classes) or `export_checkpoint`'s."""
    check_target(to)
    kind, path = export_source(source)
    if kind == "classifier":
        if keep_head:
            raise ConfigError("--keep-head: a fine-tuned classifier has no masked-prediction head")
        return export_classifier(path, to, outdir, overwrite=overwrite)
    if kind == "encoder":
        log.info(
            "%s is an encoder (no classifier head, no labels): exporting a %s",
            path,
            ENCODER_MODEL[to],
        )
    else:
        path = resolve_checkpoint(path)  # a run directory: its newest valid checkpoint (logged)
    return export_checkpoint(path, to, outdir, keep_head=keep_head, overwrite=overwrite)


def export_source(source: str | Path) -> tuple[str, Path]:
    """What `ssl-vit export SOURCE` exports, from the contents of the weights file SOURCE names
    (itself, or a directory's model.safetensors: `classifier_file.file_kind`):
    - ('classifier', file): its metadata names labels, whatever the file is called; or a
      directory's model.safetensors that cannot be read (the classifier reader says why);
    - ('encoder', file): an ssl-vit encoder, unless it lies in a fine-tuning run directory,
      whose model.safetensors is its classifier: then one ClassifierError line;
    - ('checkpoint', SOURCE): anything else (a checkpoint or run directory without
      model.safetensors, foreign weights), for `resolve_checkpoint` and the encoder reader."""
    path = Path(source).expanduser()
    file = path / CLASSIFIER_FILE if path.is_dir() else path
    kind = file_kind(file)
    if kind == "classifier" or (kind == "unreadable" and path.is_dir()):
        return "classifier", file
    if kind != "encoder":
        return "checkpoint", path
    run = file.parent
    if saved_job(run) is jobs.FINETUNE:
        raise ClassifierError(
            f"{file}: an encoder (no classifier head, no labels) in the fine-tuning run {run}, "
            f"whose {CLASSIFIER_FILE} is the classifier it trained: replaced or mismatched; to "
            f"export an encoder, name a checkpoint ({run}/checkpoints/step_N)"
        )
    return "encoder", file


def export_classifier(
    source: str | Path, to: str, outdir: str | Path, overwrite: bool = False
) -> dict[str, Any]:
    """Write the fine-tuned classifier at `source` (a fine-tuning run directory or its
    model.safetensors) as a timm or transformers classifier directory. It is written beside
    `outdir` and renamed into place; a non-empty `outdir` is replaced only with `overwrite`.

    Raises ClassifierError / InteropError (ValueErrors, one line) before anything is written.
    Returns a summary."""
    out = Path(outdir)
    check_target(to)
    file = classifier_file.find_classifier(source)
    check_output(out, {"classifier": str(file)}, overwrite)
    spec = read_classifier_spec(file)  # the header only: refuse before reading the weights
    if to == "hf" and spec.pool != "cls":  # transformers cannot pool as the classifier does
        raise InteropError(
            f"{file}: pool '{spec.pool}' (the mean of the patch tokens) has no transformers "
            "equivalent (ViTForImageClassification classifies the [class] token); "
            "timm can take it: --to timm"
        )
    model, spec = classifier_file.load_classifier(file)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    encoder = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    head = {"weight": state["head.weight"], "bias": state["head.bias"]}
    cfg, processor = spec.model_config, None
    if to == "timm":
        weights = interop.to_timm(encoder, cfg, head)
        config = interop.timm_config(cfg, spec.mean, spec.std, spec.label_names, spec.pool)
    else:
        weights = interop.to_hf(encoder, cfg, head)
        config = interop.hf_classifier_config(cfg, spec.label_names)
        processor = interop.hf_preprocessor(cfg, spec.mean, spec.std, crop=True)
    n_params = sum(v.numel() for v in weights.values())
    card = classifier_card(file, to, out, spec, n_params)
    write_export(out, weights, config, card, processor)
    log.info(
        "exported the %d-class classifier %s (%d parameters) to %s",
        spec.num_classes,
        file,
        n_params,
        out,
    )
    return {
        "format": to,
        "outdir": str(out),
        "tensors": len(weights),
        "parameters": n_params,
        "model_config": cfg,
        "num_classes": spec.num_classes,
    }
