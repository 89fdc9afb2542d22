"""Few-shot evaluation of a frozen encoder on a labelled dataset, end to end.

Features are extracted once per call: for the train split only for the samples that some
(seed, shot) subset uses (a few hundred, not the whole split), for the test split for all of
it; then every shot x seed x l2_reg is solved in closed form from those features.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ssl_vit.data import decode_image, eval_loader, eval_transform, open_source
from ssl_vit.eval.fewshot import fewshot_sweep, select_fewshot_indices
from ssl_vit.model.pixels import normalize_pixels
from ssl_vit.model.vit import ViT
from ssl_vit.progress import progress_bar

__all__ = ["extract_features", "fewshot_evaluate"]

log = logging.getLogger(__name__)


@torch.no_grad()
def extract_features(
    encoder: ViT,
    images: Iterable[tuple[torch.Tensor, torch.Tensor]],
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    pool: str = "cls",
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [B, 3, S, S], labels [B]) batches -> (features [M, D] float32 on CPU,
    labels [M]). The representation is the pooled output of the final LayerNorm."""
    was_training = encoder.training
    encoder.eval()
    feats, labels = [], []
    autocast = torch.autocast(
        device_type=torch.device(device).type,
        dtype=torch.bfloat16,
        enabled=torch.device(device).type == "cuda",
    )
    for x_u8, y in images:
        x = normalize_pixels(x_u8.to(device, non_blocking=True), mean, std)
        with autocast:
            feats.append(encoder(x, pool).float().cpu())
        labels.append(y)
    encoder.train(was_training)
    if not feats:
        raise ValueError("no images to extract features from")
    return torch.cat(feats), torch.cat(labels)


def _subset_batches(
    source, indices: np.ndarray, image_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode only the chosen samples of a large source, in index order."""
    transform = eval_transform(image_size)
    xs, ys = [], []
    for _, data, label in source.iter_samples(indices):
        xs.append(transform(decode_image(data)))
        ys.append(label)
        if len(xs) == batch_size:
            yield torch.stack(xs), torch.tensor(ys)
            xs, ys = [], []
    if xs:
        yield torch.stack(xs), torch.tensor(ys)


def _counted(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], bar) -> Iterator[tuple]:
    """Pass (images, labels) batches through, advancing `bar` by the images of each."""
    for x, y in batches:
        yield x, y
        bar.update(len(y))


def fewshot_evaluate(
    encoder: ViT,
    train: str,
    eval: str,
    *,
    image_size: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    shots: Sequence[int] = (1, 5, 10, 25),
    seeds: Sequence[int] = (0, 1, 2),
    l2_regs: Sequence[float] = (1024.0,),
    batch_size: int = 256,
    num_workers: int = 2,
    max_eval: int = 0,
    device: torch.device | str = "cpu",
    pool: str = "cls",
) -> dict[str, Any]:
    """Few-shot linear accuracy of `encoder` (frozen).

    `train` and `eval` are labelled sources (shards, image folder, HF dataset); `max_eval` > 0
    uses only the first N test images. Returns `fewshot_sweep`'s dict plus 'summary'
    ({"{k}shot": mean accuracy at the first l2_reg}) and timing.
    """
    t0 = time.perf_counter()
    train_src = open_source(train)
    labels = train_src.labels()
    num_classes = len(train_src.label_names) or int(labels.max()) + 1
    selection = select_fewshot_indices(labels, shots, seeds, num_classes=num_classes)
    rows = np.unique(np.concatenate(list(selection.values())))
    num_eval = len(open_source(eval))
    num_eval = min(num_eval, max_eval) if max_eval > 0 else num_eval
    bar = progress_bar(len(rows) + num_eval, desc="few-shot features", unit="img", every_s=30)
    train_x, train_y = extract_features(
        encoder,
        _counted(_subset_batches(train_src, rows, image_size, batch_size), bar),
        mean,
        std,
        pool,
        device,
    )
    test_batches = (
        (b.images, b.labels)
        for b in eval_loader(eval, batch_size, image_size, num_workers=num_workers, limit=max_eval)
    )
    test_x, test_y = extract_features(encoder, _counted(test_batches, bar), mean, std, pool, device)
    bar.close()
    t_features = time.perf_counter() - t0
    result = fewshot_sweep(
        train_x,
        train_y,
        test_x,
        test_y,
        shots=shots,
        seeds=seeds,
        l2_regs=l2_regs,
        num_classes=num_classes,
        selection={s: np.searchsorted(rows, idx) for s, idx in selection.items()},
    )
    result["summary"] = {f"{k}shot": result[f"{k}shot"] for k in shots}
    result["num_train_features"] = len(train_x)
    result["num_test"] = len(test_x)
    result["feature_time_s"] = t_features
    result["time_s"] = time.perf_counter() - t0
    log.info(
        "few-shot: %s (%d test images, %.1fs)", result["summary"], len(test_x), result["time_s"]
    )
    return result
