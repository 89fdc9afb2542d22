"""Linear probe, then fine-tune (LP-FT, Kumar et al. 2022; beyond the paper, `init.head: probe`).

The paper zero-initializes the head (section 3.2): the first steps then move a pretrained
encoder with the gradients of a head that knows nothing, which on few labels costs features a
frozen probe shows are there (docs/results.md). Here the head starts as the closed-form ridge
probe of the frozen encoder on the labelled training images (the few-shot evaluation's solve:
standardized pooled features, {-1, 1} targets, `PROBE_L2`), folded into one linear layer, its
scale fitted for cross-entropy. Deterministic: the evaluation transform, no random draw.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import broadcast

from ssl_vit.data import eval_loader
from ssl_vit.eval.fewshot import BIAS_CONSTANT, STD_EPS, ridge_solve
from ssl_vit.eval.fewshot_job import extract_features
from ssl_vit.eval.readouts import Extraction
from ssl_vit.model.classifier import Classifier

__all__ = ["fit_probe_head", "probe_head_weights"]

log = logging.getLogger(__name__)

PROBE_L2 = 1024.0  # the few-shot probe's default ridge (big_vision's fewshot_lsr)
# Logit scales tried for cross-entropy: ridge outputs live near [-1, 1], far too flat for it.
SCALES = tuple(2.0**k for k in range(9))


def probe_head_weights(
    feats_ND: torch.Tensor, labels_N: torch.Tensor, num_classes: int, l2_reg: float = PROBE_L2
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight [K, D], bias [K], scale) of the head that computes the ridge probe's outputs
    on raw features, times the scale in SCALES of least cross-entropy on these features."""
    x_ND = feats_ND.double()
    mean_D = x_ND.mean(dim=0)  # the few-shot probe's standardization (fewshot.standardize)
    std_D = x_ND.std(dim=0, correction=0) + STD_EPS
    z_ND = (x_ND - mean_D) / std_D
    y_NK = F.one_hot(labels_N.long(), num_classes).double() * 2 - 1
    design = torch.cat([z_ND, z_ND.new_full((len(z_ND), 1), BIAS_CONSTANT)], dim=1)
    w_DK = ridge_solve(design, y_NK, l2_reg)
    # ((x - mean) / std) @ W + c * b  ==  x @ (W / std) + (c * b - (mean / std) @ W)
    weight_KD = (w_DK[:-1] / std_D[:, None]).T
    bias_K = BIAS_CONSTANT * w_DK[-1] - (mean_D / std_D) @ w_DK[:-1]
    logits_NK = x_ND @ weight_KD.T + bias_K
    losses = [F.cross_entropy(s * logits_NK, labels_N.long()).item() for s in SCALES]
    scale = SCALES[min(range(len(SCALES)), key=losses.__getitem__)]
    return (scale * weight_KD).float(), (scale * bias_K).float(), scale


@torch.no_grad()
def fit_probe_head(model: Classifier, source: str, image_size: int, run: Any) -> dict | None:
    """Set `model.head` to the probe of its frozen encoder on `source`, the images normalized
    as the model does (`model.pixels`), in the run's precision and per-process evaluation
    batch (`run.plan`). The main process fits it (deterministic: one fit is every rank's) and
    gives it to the others (one broadcast), so the EMA copy and every replica start from the
    same head. -> its figures on those images (main process; None elsewhere)."""
    acc, plan = run.acc, run.plan
    figures = None
    if acc.is_main_process:
        figures = _fit(model, source, image_size, plan, acc.mixed_precision)
    if plan.world > 1:
        broadcast(model.head.weight.data, from_process=0)
        broadcast(model.head.bias.data, from_process=0)
    return figures


def _fit(
    model: Classifier, source: str, image_size: int, plan: Any, precision: str
) -> dict[str, float]:
    num_classes = model.head.out_features
    loader = eval_loader(
        source, plan.local_eval, image_size, num_workers=plan.num_workers, num_classes=num_classes
    )
    batches = ((b.images, b.labels) for b in loader)
    mean, std = tuple(model.pixels.mean.tolist()), tuple(model.pixels.std.tolist())
    device = next(model.parameters()).device
    how = Extraction(mean, std, device, precision=precision)
    feats_ND, labels_N = extract_features(model.encoder, batches, how, model.pool)
    weight_KD, bias_K, scale = probe_head_weights(feats_ND, labels_N, num_classes)
    model.head.weight.copy_(weight_KD)
    model.head.bias.copy_(bias_K)
    logits_NK = feats_ND @ weight_KD.T + bias_K
    figures = {
        "images": len(labels_N),
        "train_acc": (logits_NK.argmax(-1) == labels_N).float().mean().item(),
        "scale": scale,
    }
    log.info(
        "init.head=probe: the ridge probe of %d labelled images (train accuracy %.3f, logit "
        "scale %g) starts the head",
        figures["images"], figures["train_acc"], scale,
    )  # fmt: skip
    return figures
