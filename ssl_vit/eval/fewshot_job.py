"""Few-shot evaluation of a frozen encoder on a labelled dataset, end to end.

Features are extracted once per call: for the train split only for the samples that some
(seed, shot) subset uses (a few hundred, not the whole split), for the test split for all of
it; then every shot x seed x l2_reg is solved in closed form from those features. With
`layers` other than `last`, one pass extracts every block asked for and each readout
(`eval.readouts`) gets its own sweep; with `knn_k` > 0 the test features also go to a
weighted k-NN classifier over `knn_train` train images (`eval.knn`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ssl_vit.data import decode_image, eval_loader, eval_transform, open_source
from ssl_vit.eval.fewshot import ALL_SHOTS, Shot, fewshot_sweep, select_fewshot_indices
from ssl_vit.eval.knn import knn_top1
from ssl_vit.eval.readouts import (
    Readout,
    extract_layer_features,
    frozen_forward,
    layer_sweep,
    parse_layers,
    plan_readouts,
)
from ssl_vit.model.vit import ViT
from ssl_vit.progress import progress_bar
from ssl_vit.watchdog import watched

__all__ = ["extract_features", "fewshot_evaluate", "knn_train_rows"]

log = logging.getLogger(__name__)


@torch.no_grad()
def extract_features(
    encoder: ViT,
    images: Iterable[tuple[torch.Tensor, torch.Tensor]],
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    pool: str = "cls",
    device: torch.device | str = "cpu",
    compile: bool | str = False,
    compile_mode: str = "default",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [B, 3, S, S], labels [B]) batches -> (features [M, D] float32 on CPU,
    labels [M]). The representation is the pooled output of the final LayerNorm. `compile`,
    `compile_mode`: see readouts.frozen_forward."""
    feats, labels = [], []

    def pooled(x: torch.Tensor) -> torch.Tensor:
        return encoder(x, pool)

    for x, y in frozen_forward(encoder, images, mean, std, device, pooled, compile, compile_mode):
        feats.append(x)
        labels.append(y)
    if not feats:
        raise ValueError("no images to extract features from")
    return torch.cat(feats), torch.cat(labels)


def _subset_batches(
    source, indices: np.ndarray, image_size: int, batch_size: int, kept: list[int] | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Decode only the chosen samples of a large source, in index order. A sample that fails
    to decode is skipped and logged with where it comes from, as the streams do; `kept`
    collects the indices that were decoded."""
    transform = eval_transform(image_size)
    xs, ys = [], []
    for rec in source.iter_records(indices):
        try:
            xs.append(transform(decode_image(rec.data)))
        except Exception as e:  # any bad sample is skipped, whatever the decoder raised
            log.warning(
                "few-shot train: skipping %s (key %s): %s: %s",
                *(source.describe(rec.index), rec.key, type(e).__name__, e),
            )
            continue
        ys.append(rec.label)
        if kept is not None:
            kept.append(rec.index)
        if len(xs) == batch_size:
            yield torch.stack(xs), torch.tensor(ys)
            xs, ys = [], []
    if xs:
        yield torch.stack(xs), torch.tensor(ys)


def _counted(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], bar) -> Iterator[tuple]:
    """Pass (images, labels) batches through, advancing `bar` by the images of each; a batch
    that takes longer than the data timeout ends the job (ssl_vit.watchdog)."""
    for x, y in watched(batches, "the few-shot data"):
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
    shots: Sequence[Shot] = (1, 5, 10, 25),
    seeds: Sequence[int] = (0, 1, 2),
    l2_regs: Sequence[float] = (1024.0,),
    batch_size: int = 256,
    num_workers: int = 2,
    max_eval: int = 0,
    device: torch.device | str = "cpu",
    pool: str = "cls",
    layers: str | int | Sequence[int] = "last",
    concat_last: int = 0,
    knn_k: int = 0,
    knn_train: int = 10000,
    knn_temperature: float = 0.07,
    standardize: bool = True,
    compile: bool | str = False,
    compile_mode: str = "default",
) -> dict[str, Any]:
    """Few-shot linear accuracy of `encoder` (frozen).

    `train` and `eval` are labelled sources (shards, image folder, HF dataset); `max_eval` > 0
    uses only the first N test images. Returns `fewshot_sweep`'s dict for the last block's
    output pooled by `pool`, plus 'summary' ({"{k}shot": mean accuracy at the first l2_reg})
    and timing. `layers` (`last`, `all` or block indices) other than `last`, or `concat_last`
    > 1, adds 'layers' (`layer_sweep`: every block x cls/gap/cls+gap, the last N concatenated,
    the best readout). `knn_k` > 0 adds 'knn' ({"top1", "k", "temperature", "num_train"}):
    weighted k-NN of the same test features against `knn_train` train images (0: all; a
    fixed random draw otherwise). A shot "all" extracts every train image (a full linear
    probe); `standardize` as in `fewshot_sweep`. `compile`, `compile_mode`: torch.compile of
    the feature extraction (`train.compile`'s values, see readouts.frozen_forward).
    """
    t0 = time.perf_counter()
    depth = len(encoder.blocks)
    wanted = parse_layers(layers, depth)
    per_layer = layers != "last" or concat_last > 1
    last = Readout("last", (depth - 1,), pool)
    extract_at = sorted({*wanted, *range(depth - max(concat_last, 1), depth)})
    train_src = open_source(train)
    labels = train_src.labels()
    num_classes = len(train_src.label_names) or int(labels.max()) + 1
    labelled = _labelled_rows(train_src, labels, num_classes)
    # Out-of-range labels -> K: bincount(minlength=K)[:K] and the per-class draws ignore them.
    selection = select_fewshot_indices(
        np.where(labelled, labels, num_classes), shots, seeds, num_classes=num_classes
    )
    rows = np.unique(np.concatenate(list(selection.values())))
    if ALL_SHOTS in shots:  # the full probe needs every (in-range) train image's features
        rows = np.flatnonzero(labelled)
    num_eval = len(open_source(eval))
    num_eval = min(num_eval, max_eval) if max_eval > 0 else num_eval
    bar = progress_bar(len(rows) + num_eval, desc="few-shot features", unit="img", every_s=30)
    compiling = (compile, compile_mode)

    def features(batches):
        if not per_layer:  # the one readout: pooled last output (unchanged default path)
            x, y = extract_features(encoder, batches, mean, std, pool, device, *compiling)
            return {depth - 1: {pool: x}}, y
        return extract_layer_features(encoder, batches, mean, std, extract_at, device, *compiling)

    kept: list[int] = []  # the train rows that decoded: features row i is sample kept[i]
    train_batches = _subset_batches(train_src, rows, image_size, batch_size, kept)
    train_f = features(_counted(train_batches, bar))
    skipped_eval = [0]

    def test_batches():
        loader = eval_loader(
            *(eval, batch_size, image_size),
            num_workers=num_workers,
            limit=max_eval,
            num_classes=num_classes,  # a test label outside [0, K): a counted skip
        )
        for b in loader:
            skipped_eval[0] += b.skipped + b.skipped_shards
            yield b.images, b.labels

    test_f = features(_counted(test_batches(), bar))
    bar.close()
    t_features = time.perf_counter() - t0
    kept_rows = np.asarray(kept, dtype=np.int64)  # ascending, as iter_records yields
    sweep = dict(
        shots=shots,
        seeds=seeds,
        l2_regs=l2_regs,
        num_classes=num_classes,
        # A skipped image leaves its class one shot short in that seed's subsets.
        selection={
            s: np.searchsorted(kept_rows, idx[np.isin(idx, kept_rows)])
            for s, idx in selection.items()
        },
        standardize=standardize,
    )
    train_x, test_x = last.features(train_f[0]), last.features(test_f[0])
    result = fewshot_sweep(train_x, train_f[1], test_x, test_f[1], **sweep)
    result["summary"] = {f"{k}shot": result[f"{k}shot"] for k in shots}
    if per_layer:
        readouts = plan_readouts(wanted, depth, concat_last=concat_last)
        result["layers"] = {"depth": depth, **layer_sweep(readouts, train_f, test_f, **sweep)}
        log.info("best frozen readout: %s", result["layers"]["best"])
    if knn_k > 0:
        t_knn = time.perf_counter()
        valid = np.flatnonzero(labelled)
        knn_rows = valid[knn_train_rows(len(valid), knn_train)]
        knn_x, knn_y = extract_features(
            encoder,
            _subset_batches(train_src, knn_rows, image_size, batch_size),
            *(mean, std, pool, device, *compiling),
        )
        result["knn"] = {
            "top1": knn_top1(knn_x, knn_y, test_x, test_f[1], knn_k, knn_temperature, num_classes),
            "k": knn_k,
            "temperature": knn_temperature,
            "num_train": len(knn_x),
            "time_s": time.perf_counter() - t_knn,
        }
    result["num_train_features"] = len(train_x)
    result["skipped_train"] = len(rows) - len(kept)  # images that failed to decode
    result["skipped_train_labels"] = int((~labelled).sum())  # labels outside [0, K)
    result["skipped_eval"] = skipped_eval[0]
    result["num_test"] = len(test_x)
    result["feature_time_s"] = t_features
    result["time_s"] = time.perf_counter() - t0
    log.info(
        "few-shot: %s (%d test images, %.1fs)", result["summary"], len(test_x), result["time_s"]
    )
    return result


def _labelled_rows(source, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """bool [N]: the train samples labelled in [0, K); the others are skipped, logged once
    with the first of them (an unlabelled row, or a `.cls` no class name stands for)."""
    labelled = (labels >= 0) & (labels < num_classes)
    bad = np.flatnonzero(~labelled)
    if bad.size:
        log.warning(
            "few-shot train: skipping %d samples labelled outside [0, %d), e.g. %s (label %d)",
            *(bad.size, num_classes, source.describe(int(bad[0])), int(labels[bad[0]])),
        )
    return labelled


def knn_train_rows(n: int, num_train: int) -> np.ndarray:
    """Sorted indices of the k-NN train images: all `n`, or a fixed draw (seed 0) of
    `num_train` of them, the same at every pretraining step so that the values compare."""
    if not 0 < num_train < n:
        return np.arange(n)
    return np.sort(np.random.default_rng(0).choice(n, num_train, replace=False))
