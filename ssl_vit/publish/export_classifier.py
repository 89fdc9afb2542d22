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
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ssl_vit import interop
from ssl_vit.interop import InteropError
from ssl_vit.publish.export import check_output, check_target, write_export
from ssl_vit.publish.model_card import classifier_card
from ssl_vit.train import classifier_file
from ssl_vit.train.classifier_file import CLASSIFIER_FILE, ClassifierSpec, read_classifier_spec

__all__ = ["export_classifier", "is_classifier"]

log = logging.getLogger(__name__)


def is_classifier(path: str | Path) -> bool:
    """Whether `path` names a fine-tuned classifier (a fine-tuning run directory holding
    model.safetensors, or that file) rather than an encoder checkpoint. A model.safetensors
    that is readable and has no class names (e.g. an export directory's) is not one; an
    unreadable one is, so that exporting it fails with the classifier's own error."""
    p = Path(path).expanduser()
    file = p / CLASSIFIER_FILE if p.is_dir() else p
    if file.name != CLASSIFIER_FILE or not file.is_file():
        return False
    return classifier_file.names_labels(file) is not False


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
    check_pool(spec, to, file)
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


def check_pool(spec: ClassifierSpec, to: str, file: Path) -> None:
    """InteropError (one line) when the target library cannot pool as the classifier does."""
    if to == "hf" and spec.pool != "cls":
        raise InteropError(
            f"{file}: pool '{spec.pool}' (the mean of the patch tokens) has no transformers "
            "equivalent (ViTForImageClassification classifies the [class] token); "
            "timm can take it: --to timm"
        )
