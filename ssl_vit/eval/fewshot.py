"""Few-shot linear evaluation by closed-form ridge regression (paper section 4.1).

The paper reports few-shot accuracy from a regularized least-squares regression of frozen
representations onto {-1, 1} one-hot targets; this follows big_vision's `fewshot_lsr`
evaluator: standardize with the few-shot subset's statistics, add a constant bias feature,
solve in closed form, take the argmax. `standardize=False` skips the standardization (raw
features + bias). A shot count may be "all": every sample of the train pool, i.e. a full
linear probe by the same closed-form ridge (solved in the D x D primal form when N > D).

Shape legend: N train (few-shot) samples, M test samples, D feature width, K classes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from ssl_vit.errors import ConfigError
from ssl_vit.eval.shots import ALL_SHOTS, Shot

__all__ = [
    "BIAS_CONSTANT",
    "STD_EPS",
    "ridge_accuracies",
    "fewshot_sweep",
    "ridge_solve",
    "select_fewshot_indices",
    "standardize",
]

# Large so that the bias weight is barely regularized: its penalty is l2_reg / 100^2.
BIAS_CONSTANT = 100.0
# Added to the std (as big_vision does) so a constant feature becomes 0, not NaN.
STD_EPS = 1e-5

ArrayLike = torch.Tensor | np.ndarray


def _as_float64(x: ArrayLike, device: torch.device | None = None) -> torch.Tensor:
    return torch.as_tensor(x).to(device=device, dtype=torch.float64)


def _as_labels(y: ArrayLike, device: torch.device | None = None) -> torch.Tensor:
    return torch.as_tensor(y).to(device=device, dtype=torch.int64).reshape(-1)


def standardize(
    train_x: torch.Tensor, test_x: torch.Tensor, eps: float = STD_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardize train_x [N, D] and test_x [M, D] with train_x's per-feature mean and
    population std (ddof=0); test_x never contributes to the statistics. `eps` (added to the
    std) maps a constant feature to 0 instead of NaN."""
    mean_1D = train_x.mean(dim=0, keepdim=True)
    std_1D = train_x.std(dim=0, correction=0, keepdim=True) + eps
    return (train_x - mean_1D) / std_1D, (test_x - mean_1D) / std_1D


def _add_bias(x_ND: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, D + 1] with a last column of BIAS_CONSTANT."""
    return torch.cat([x_ND, x_ND.new_full((x_ND.shape[0], 1), BIAS_CONSTANT)], dim=1)


def ridge_solve(
    X: ArrayLike,
    Y: ArrayLike,
    l2_reg: float,
    form: Literal["auto", "primal", "dual"] = "auto",
) -> torch.Tensor:
    """Closed-form ridge regression W = argmin |X W - Y|^2 + l2_reg |W|^2, in float64.

    Primal W = (X^T X + l2 I)^-1 X^T Y when N >= D, else the (identical) dual
    W = X^T (X X^T + l2 I)^-1 Y, so the system solved is min(N, D) square: a full probe on
    50,000 images of width 192 solves 193 x 193, not 50,000 x 50,000. Solved by Cholesky
    (the matrix is symmetric positive definite for l2_reg > 0), never an explicit inverse.

    Args:
        X: [N, D] design matrix (features, already standardized and with the bias column).
        Y: [N, K] targets.
        l2_reg: ridge strength, > 0.
        form: "auto" (the smaller system), or force "primal" / "dual" (tests compare them).

    Returns:
        W: [D, K] float64 on X's device.
    """
    if not l2_reg > 0:
        raise ConfigError(f"l2_reg must be > 0, got {l2_reg}")
    X_ND = _as_float64(X)
    Y_NK = _as_float64(Y, X_ND.device)
    N, D = X_ND.shape
    if form == "primal" or (form == "auto" and N >= D):
        gram_DD = X_ND.T @ X_ND
        gram_DD.diagonal().add_(l2_reg)
        return torch.cholesky_solve(X_ND.T @ Y_NK, torch.linalg.cholesky(gram_DD))
    gram_NN = X_ND @ X_ND.T
    gram_NN.diagonal().add_(l2_reg)
    return X_ND.T @ torch.cholesky_solve(Y_NK, torch.linalg.cholesky(gram_NN))


def ridge_accuracies(
    train_x: ArrayLike,
    train_y: ArrayLike,
    test_x: ArrayLike,
    test_y: ArrayLike,
    l2_regs: Sequence[float] = (1024.0,),
    num_classes: int | None = None,
    standardize_features: bool = True,
) -> list[float]:
    """Accuracy on the whole test split of the ridge classifier fit on the train set, for each
    l2_reg (the preprocessing shared).

    train_x [N, D], train_y [N], test_x [M, D], test_y [M] (torch or numpy, any float dtype);
    num_classes K (None: the largest label + 1); standardize_features: the train features'
    per-dimension mean/std applied to both sets (big_vision's default), else the raw features.
    Returns mean(argmax(X_test W) == test_y) per l2_reg, Python floats."""
    train_ND = _as_float64(train_x)
    device = train_ND.device
    test_MD = _as_float64(test_x, device)
    train_N, test_M = _as_labels(train_y, device), _as_labels(test_y, device)
    K = num_classes
    if K is None:
        K = int(max(train_N.max().item(), test_M.max().item())) + 1
    if standardize_features:
        train_ND, test_MD = standardize(train_ND, test_MD)
    train_ND, test_MD = _add_bias(train_ND), _add_bias(test_MD)
    # One-hot rescaled to {-1, 1}: every class gets a target, present or not.
    Y_NK = 2.0 * torch.nn.functional.one_hot(train_N, K).to(torch.float64) - 1.0
    accs = []
    for l2_reg in l2_regs:
        W_DK = ridge_solve(train_ND, Y_NK, l2_reg)
        pred_M = (test_MD @ W_DK).argmax(dim=1)
        accs.append((pred_M == test_M).double().mean().item())
    return accs


def _class_permutations(labels: np.ndarray, seed: int, num_classes: int) -> list[np.ndarray]:
    """Per class c = 0..K-1 in order, a random permutation of its indices (big_vision's draw)."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]


def select_fewshot_indices(
    labels: ArrayLike,
    shots: Sequence[Shot],
    seeds: Sequence[int],
    num_classes: int | None = None,
) -> dict[int, np.ndarray]:
    """Indices of the samples the few-shot subsets need: {seed: [n_seed] int64 indices into
    `labels`}, the [N] labels of the whole train pool (K = num_classes, None: max label + 1).

    For each seed, every class gets a random permutation of its indices drawn from
    `np.random.default_rng(seed)` (classes 0..K-1 in order); the k-shot subset is the first k
    of each class's permutation, so subsets are nested across shots. Only the largest shot's
    prefixes are needed, which lets a caller extract features for just these samples. The
    indices are ordered class by class, each class in permutation order. A class with fewer
    samples than a shot contributes all it has (warned once); "all" needs no draw (every
    sample) and is ignored here.
    """
    labels_N = _int_labels(labels)
    K = int(labels_N.max()) + 1 if num_classes is None else num_classes
    max_shot = max([k for k in shots if k != ALL_SHOTS], default=0)
    counts = np.bincount(labels_N, minlength=K)[:K]
    short = np.flatnonzero(counts < max_shot)
    if short.size:
        msg = (
            f"{short.size} of {K} classes have fewer than {max_shot} samples "
            f"(smallest: {int(counts.min())}); they contribute all the samples they have"
        )
        warnings.warn(msg, stacklevel=2)
    return {
        seed: np.concatenate(
            [perm[:max_shot] for perm in _class_permutations(labels_N, seed, K)]
        ).astype(np.int64)
        for seed in seeds
    }


def _shot_subset(selection: np.ndarray, labels_N: np.ndarray, shots: int) -> np.ndarray:
    """The first `shots` indices of each class in a class-ordered selection."""
    sel_labels = labels_N[selection]
    # Rank of each index within its class: position minus the class's first position.
    order = np.argsort(sel_labels, kind="stable")
    ranks = np.empty_like(order)
    sorted_labels = sel_labels[order]
    starts = np.searchsorted(sorted_labels, sorted_labels, side="left")
    ranks[order] = np.arange(order.size) - starts
    return selection[ranks < shots]


def fewshot_sweep(
    train_features: ArrayLike,
    train_labels: ArrayLike,
    test_features: ArrayLike,
    test_labels: ArrayLike,
    shots: Sequence[Shot] = (1, 5, 10, 25),
    seeds: Sequence[int] = (0, 1, 2),
    l2_regs: Sequence[float] = (1024.0,),
    num_classes: int | None = None,
    selection: dict[int, np.ndarray] | None = None,
    standardize: bool = True,
) -> dict[str, Any]:
    """Few-shot accuracy for every (shot, l2_reg), averaged over seeds of nested subsets.

    Args:
        train_features, train_labels: [N, D], [N]: the pool the few-shot subsets are drawn from.
        test_features, test_labels: [M, D], [M]: the whole test split.
        shots, seeds, l2_regs: the grid; subsets as in `select_fewshot_indices`; the shot
            "all" is every row of train_features, the same for every seed (solved once, its
            per_seed values are that one accuracy repeated, std 0).
        num_classes: K; None means max label over train and test + 1.
        selection: {seed: row indices into train_features}, class-ordered as returned by
            `select_fewshot_indices`. None draws it from `train_labels`. Pass it when the
            pool holds only pre-selected samples, to keep the draw made on the full dataset:
            `sel = select_fewshot_indices(all_labels, shots, seeds)`,
            `rows = np.unique(np.concatenate(list(sel.values())))`, extract features of `rows`,
            then `selection={s: np.searchsorted(rows, i) for s, i in sel.items()}`.
        standardize: as `standardize_features` of `ridge_accuracies`.

    Returns:
        {
            "shots": {k: {"l2_reg": {str(l2): {"mean": float, "std": float,
                                                "per_seed": [float, ...]}}}},
            "seeds": [int, ...],
            "num_classes": K,
            "{k}shot": mean accuracy at l2_regs[0], for each k,
            "standardize": bool,
        }
        with k the int shot count or "all", per_seed in the order of `seeds` and std the population
        std (ddof=0) over seeds.
    """
    train_labels_N, test_labels_M = _int_labels(train_labels), _int_labels(test_labels)
    if num_classes is None:
        num_classes = int(max(train_labels_N.max(), test_labels_M.max())) + 1
    if selection is None and any(k != ALL_SHOTS for k in shots):
        selection = select_fewshot_indices(train_labels_N, shots, seeds, num_classes)
    train_ND = torch.as_tensor(train_features)
    # Converted once: the whole test split is reused by every (seed, shot).
    test_MD = _as_float64(test_features, train_ND.device)
    test_M = torch.as_tensor(test_labels_M, device=train_ND.device)

    def accuracies(x_ND, y_N):
        return ridge_accuracies(x_ND, y_N, test_MD, test_M, l2_regs, num_classes, standardize)

    # "all" does not depend on the seed: one solve, repeated per seed below.
    accs_all = accuracies(train_ND, train_labels_N) if ALL_SHOTS in shots else []
    per_seed: dict[tuple[Shot, float], list[float]] = {(k, l2): [] for k in shots for l2 in l2_regs}
    for seed in seeds:
        for k in shots:
            if k == ALL_SHOTS:
                accs = accs_all
            else:
                idx = _shot_subset(np.asarray(selection[seed]), train_labels_N, k)
                rows = torch.as_tensor(idx, device=train_ND.device)
                accs = accuracies(train_ND[rows], train_labels_N[idx])
            for l2, acc in zip(l2_regs, accs, strict=True):
                per_seed[(k, l2)].append(acc)
    result = dict(shots={}, seeds=list(seeds), num_classes=num_classes, standardize=standardize)
    for k in shots:
        by_l2 = {}
        for l2 in l2_regs:
            accs = per_seed[(k, l2)]
            by_l2[str(l2)] = {
                "mean": float(np.mean(accs)),
                "std": float(np.std(accs)),
                "per_seed": accs,
            }
        result["shots"][k] = {"l2_reg": by_l2}
        result[f"{k}shot"] = by_l2[str(l2_regs[0])]["mean"]
    return result


def _int_labels(labels: ArrayLike) -> np.ndarray:
    """Labels as a flat int64 NumPy array (on the host)."""
    return np.asarray(torch.as_tensor(labels).cpu()).astype(np.int64).ravel()
