"""Few-shot evaluation of a frozen encoder on a labelled dataset, end to end.

Features are extracted once per call: for the train split only for the samples that some
(seed, shot) subset uses (a few hundred, not the whole split), for the test split for all of
it; then every shot x seed x l2_reg is solved in closed form from those features. With
`layers` other than `last`, one pass extracts every block asked for and each readout
(`eval.readouts`) gets its own sweep; with `knn_k` > 0 the test features also go to a
weighted k-NN classifier over `knn_train` train images (`eval.knn`). Everything to do comes
in one `FewshotEvalConfig` (the `fewshot:` section of both jobs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ssl_vit.config.fewshot import FewshotEvalConfig
from ssl_vit.config.run import CompileConfig
from ssl_vit.data import eval_loader, open_source
from ssl_vit.eval.fewshot import fewshot_sweep, select_fewshot_indices
from ssl_vit.eval.knn import knn_predict
from ssl_vit.eval.readouts import (
    Extraction,
    Readout,
    extract_layer_features,
    frozen_forward,
    layer_sweep,
    parse_layers,
    plan_readouts,
)
from ssl_vit.eval.shots import ALL_SHOTS, format_summary
from ssl_vit.model.vit import ViT
from ssl_vit.progress import progress_bar
from ssl_vit.watchdog import watched

__all__ = ["extract_features", "fewshot_evaluate", "knn_train_rows", "log_fewshot"]

log = logging.getLogger(__name__)


@torch.no_grad()
def extract_features(
    encoder: ViT,
    images: Iterable[tuple[torch.Tensor, torch.Tensor]],
    how: Extraction,
    pool: str = "cls",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [B, 3, S, S], labels [B]) batches -> (features [M, D] float32 on CPU,
    labels [M]), computed as `how` says. The representation is the pooled output of the final
    LayerNorm."""

    def pooled(x: torch.Tensor) -> torch.Tensor:
        return encoder(x, pool)

    feats, labels = frozen_forward(encoder, images, how, pooled)
    return torch.cat(feats), labels


def _subset_batches(
    spec: str,
    rows: np.ndarray,
    image_size: int,
    batch_size: int,
    num_workers: int,
    kept: list[int],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) of the chosen samples `rows` (ascending) of a labelled source,
    decoded by the loader's workers (one pass, each sample once). A sample that fails to decode
    is a counted, logged skip, as in the streams; `kept` collects each yielded image's index,
    in the order yielded (the workers' batches interleave)."""
    keys = np.asarray(open_source(spec).sample_keys(), dtype=object)[rows]
    index_of = dict(zip(keys.tolist(), rows.tolist(), strict=True))
    if len(index_of) < len(rows):  # repeated keys: one worker, matched in source order
        num_workers, index_of = 0, None
    loader = eval_loader(spec, batch_size, image_size, num_workers=num_workers, indices=rows)
    pending = iter(zip(keys.tolist(), rows.tolist(), strict=True))
    for batch in loader:
        if not len(batch.labels):
            continue  # a batch that only reports skips
        for key in batch.keys:
            if index_of is not None:
                kept.append(index_of[key])
            else:
                kept.append(next(i for k, i in pending if k == key))
        yield batch.images, batch.labels


def _in_index_order(features: Any, labels: torch.Tensor, kept: list[int]) -> tuple:
    """Features (a tensor [M, D] or {block: {pool: [M, D]}}) and labels [M] of the rows
    `kept` (in loader order), reordered to ascending row index; the sorted rows too."""
    order = torch.as_tensor(np.argsort(np.asarray(kept, dtype=np.int64), kind="stable"))
    feats = tree_map(lambda t: t[order], features)
    return feats, labels[order], np.sort(np.asarray(kept, dtype=np.int64))


def _counted(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], bar) -> Iterator[tuple]:
    """Pass (images, labels) batches through, advancing `bar` by the images of each; a batch
    that takes longer than the data timeout ends the job (ssl_vit.watchdog)."""
    for x, y in watched(batches, "the few-shot data"):
        yield x, y
        bar.update(len(y))


def fewshot_evaluate(
    encoder: ViT,
    spec: FewshotEvalConfig,
    *,
    image_size: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    device: torch.device | str = "cpu",
    compile: CompileConfig | None = None,
    precision: str = "bf16",
) -> dict[str, Any]:
    """Few-shot linear accuracy of `encoder` (frozen) as `spec` (the `fewshot:` section) says,
    on images of `image_size` normalized by `mean` / `std` (the encoder's input); `compile`:
    torch.compile of the feature extraction (None: eager); `precision`: its autocast on a GPU
    (the job's mixed precision: bf16, fp16 or no; see readouts.Extraction).

    Returns `fewshot_sweep`'s dict for the last block's output pooled by `spec.pool`, plus
    'summary' ({"{k}shot": mean accuracy at the first l2_reg}) and timing. `spec.layers`
    other than `last`, or `concat_last` > 1, adds 'layers' (`layer_sweep`: every block x
    cls/gap/cls+gap, the last N concatenated, the best readout). `knn_k` > 0 adds 'knn'
    ({"top1", "k", "temperature", "num_train"}): weighted k-NN of the same test features
    against `knn_train` train images (0: all; a fixed random draw otherwise). A shot "all"
    extracts every train image (a full linear probe).
    """
    t0 = time.perf_counter()
    depth = len(encoder.blocks)
    wanted = parse_layers(spec.layers, depth)
    per_layer = spec.layers != "last" or spec.concat_last > 1
    extract_at = sorted({*wanted, *range(depth - max(spec.concat_last, 1), depth)})
    labels, labelled, num_classes = _train_labels(spec.train)
    selection, rows = _train_rows(spec, labels, labelled, num_classes)
    compiling = (compile.enabled, compile.mode) if compile is not None else (False, "default")
    how = Extraction(mean, std, device, *compiling, precision)
    features = _extractor(encoder, spec.pool, per_layer, extract_at, how)
    loading = (image_size, spec.batch_size, spec.num_workers)
    train_f, test_f, skipped = _train_and_test(spec, features, rows, loading, num_classes)
    t_features = time.perf_counter() - t0
    sweep = _sweep_args(spec, num_classes, selection, kept_rows=train_f[2])
    last = Readout("last", (depth - 1,), spec.pool)
    train_x, test_x = last.features(train_f[0]), last.features(test_f[0])
    result = fewshot_sweep(train_x, train_f[1], test_x, test_f[1], **sweep)
    result["summary"] = {f"{k}shot": result[f"{k}shot"] for k in spec.shots}
    if per_layer:
        readouts = plan_readouts(wanted, depth, concat_last=spec.concat_last)
        result["layers"] = {"depth": depth, **layer_sweep(readouts, train_f, test_f, **sweep)}
        log.info("best frozen readout: %s", result["layers"]["best"])
    if spec.knn_k > 0:
        result["knn"] = _knn(spec, labelled, features, loading, test_x, test_f[1], num_classes)
    result.update(
        num_train_features=len(train_x),
        skipped_train=skipped[0],  # images that failed to decode
        skipped_train_labels=int((~labelled).sum()),  # labels outside [0, K)
        skipped_eval=skipped[1],
        num_test=len(test_x),
        feature_time_s=t_features,
        time_s=time.perf_counter() - t0,
    )
    log.info("few-shot: %s (%d test images, %.1fs)", format_summary(result["summary"]),
             len(test_x), result["time_s"])  # fmt: skip
    if len(test_x) == 0:  # its accuracies are NaN: results.json's null, "not measured"
        log.warning(
            "fewshot.eval=%s: none of its images was scored (%d skipped: unreadable, or "
            "labelled outside the classes): the accuracies are not measured", spec.eval,
            skipped[1],
        )  # fmt: skip
    return result


def log_fewshot(metrics: Any, step: int, res: dict) -> None:
    """`res` as the jobs' metrics rows at `step` (`metrics`: a `MetricsWriter`): the summary
    (`fewshot/{k}shot`), then the k-NN monitor (fewshot.knn_k > 0) on the same test features."""
    metrics.log({"step": step, **{f"fewshot/{k}": v for k, v in res["summary"].items()}})
    if "knn" in res:
        metrics.log({"step": step, "knn/top1": res["knn"]["top1"]})


def _train_labels(source: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(the train source's labels, which are in [0, K), K: its label names or max label + 1)."""
    train_src = open_source(source)
    labels = train_src.labels()
    num_classes = len(train_src.label_names) or int(labels.max()) + 1
    return labels, _labelled_rows(train_src, labels, num_classes), num_classes


def _extractor(
    encoder: ViT,
    pool: str,
    per_layer: bool,
    extract_at: list[int],
    how: Extraction,
) -> Any:
    """`features(batches, pool, per_layer)` -> ({block: {pool: [N, D]}}, labels [N]): the
    pooled last output only, or every block of `extract_at` (`extract_layer_features`)."""
    depth = len(encoder.blocks)

    def features(batches, pool=pool, per_layer=per_layer):
        if not per_layer:  # the one readout: pooled last output (unchanged default path)
            x, y = extract_features(encoder, batches, how, pool)
            return {depth - 1: {pool: x}}, y
        return extract_layer_features(encoder, batches, how, extract_at)

    return features


def _train_rows(
    spec: FewshotEvalConfig, labels: np.ndarray, labelled: np.ndarray, num_classes: int
) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """(each seed's few-shot draw, the train rows whose features are needed)."""
    # Out-of-range labels -> K: bincount(minlength=K)[:K] and the per-class draws ignore them.
    selection = select_fewshot_indices(
        np.where(labelled, labels, num_classes), spec.shots, spec.seeds, num_classes=num_classes
    )
    rows = np.unique(np.concatenate(list(selection.values())))
    if ALL_SHOTS in spec.shots:  # the full probe needs every (in-range) train image's features
        rows = np.flatnonzero(labelled)
    return selection, rows


def _train_and_test(
    spec: FewshotEvalConfig, features: Any, rows: np.ndarray, loading: tuple, num_classes: int
) -> tuple[tuple, tuple, tuple[int, int]]:
    """`features` of the train `rows` (in index order, with the rows kept) and of the test
    split, and the images skipped in each (train: failed to decode; test: counted skips)."""
    num_eval = len(open_source(spec.eval))
    num_eval = min(num_eval, spec.max_eval) if spec.max_eval > 0 else num_eval
    bar = progress_bar(len(rows) + num_eval, desc="few-shot features", unit="img", every_s=30)
    kept: list[int] = []  # the train rows that decoded, in loader order
    train_f = features(_counted(_subset_batches(spec.train, rows, *loading, kept), bar))
    train_f = _in_index_order(*train_f, kept)  # features row i is sample kept_rows[i]
    skipped_eval = [0]
    test_f = features(_counted(_test_batches(spec, loading[0], num_classes, skipped_eval), bar))
    bar.close()
    return train_f, test_f, (len(rows) - len(kept), skipped_eval[0])


def _test_batches(
    spec: FewshotEvalConfig, image_size: int, num_classes: int, skipped: list[int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The test split's (images, labels) batches; `skipped[0]` counts the skipped images."""
    loader = eval_loader(
        *(spec.eval, spec.batch_size, image_size),
        num_workers=spec.num_workers,
        limit=spec.max_eval,
        num_classes=num_classes,  # a test label outside [0, K): a counted skip
    )
    for b in loader:
        skipped[0] += b.skipped + b.skipped_shards
        yield b.images, b.labels


def _sweep_args(
    spec: FewshotEvalConfig, num_classes: int, selection: dict, kept_rows: np.ndarray
) -> dict[str, Any]:
    """`fewshot_sweep`'s grid and the draw, as rows of the features of `kept_rows`."""
    return dict(
        shots=spec.shots,
        seeds=spec.seeds,
        l2_regs=spec.l2_reg,
        num_classes=num_classes,
        # A skipped image leaves its class one shot short in that seed's subsets.
        selection={
            s: np.searchsorted(kept_rows, idx[np.isin(idx, kept_rows)])
            for s, idx in selection.items()
        },
        standardize=spec.standardize,
    )


def _knn(spec, labelled, features, loading, test_x, test_y, num_classes) -> dict[str, Any]:
    """Weighted k-NN top-1 of the test features against `spec.knn_train` train images."""
    t_knn = time.perf_counter()
    valid = np.flatnonzero(labelled)
    knn_rows = valid[knn_train_rows(len(valid), spec.knn_train)]
    kept: list[int] = []
    store, knn_y = features(_subset_batches(spec.train, knn_rows, *loading, kept), per_layer=False)
    knn_x, knn_y, _ = _in_index_order(next(iter(store.values()))[spec.pool], knn_y, kept)
    pred = knn_predict(knn_x, knn_y, test_x, spec.knn_k, spec.knn_temperature, num_classes)
    return {
        "top1": (pred.cpu() == test_y.reshape(-1).cpu().long()).double().mean().item(),
        "k": spec.knn_k,
        "temperature": spec.knn_temperature,
        "num_train": len(knn_x),
        "time_s": time.perf_counter() - t_knn,
    }


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
