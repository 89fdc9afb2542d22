"""Classification figures from one confusion matrix: what fine-tuning's final evaluation and
`ssl-vit predict` report (top-1, per-class accuracy, the matrix itself), computed one way.

The matrix is counted on the device (`add_confusion`, no host sync), summed over ranks by the
caller, and summarised once on the host (`confusion_summary`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["add_confusion", "confusion_summary"]


def add_confusion(conf_KK: torch.Tensor, labels_B: torch.Tensor, pred_B: torch.Tensor) -> None:
    """Count each (true label, prediction) pair into `conf_KK` [K, K] in place; labels outside
    [0, K) (unlabelled images: -1) are not counted."""
    K = conf_KK.shape[0]
    valid = (labels_B >= 0) & (labels_B < K)
    cell = torch.where(valid, labels_B * K + pred_B, K * K)  # invalid rows land in a spare slot
    counts = torch.zeros(K * K + 1, dtype=conf_KK.dtype, device=conf_KK.device)
    counts.index_add_(0, cell, torch.ones_like(cell, dtype=conf_KK.dtype))
    conf_KK += counts[: K * K].view(K, K)


def confusion_summary(conf_KK: torch.Tensor, label_names: Sequence[str]) -> dict[str, Any]:
    """{"top1", "per_class_top1" {name: accuracy or None}, "confusion_matrix" [[int]] (rows:
    true class, columns: predicted), "num_labelled"} of a [K, K] count matrix."""
    conf = conf_KK.detach().to("cpu", torch.int64)
    total = int(conf.sum())
    per_row = conf.sum(dim=1).tolist()
    diag = conf.diagonal().tolist()
    return {
        "top1": sum(diag) / total if total else None,
        "per_class_top1": {
            name: (d / n if n else None)
            for name, d, n in zip(label_names, diag, per_row, strict=True)
        },
        "confusion_matrix": conf.tolist(),
        "num_labelled": total,
    }
