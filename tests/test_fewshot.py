"""Tests for ssl_vit.eval.fewshot: closed-form ridge few-shot evaluation."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from ssl_vit.eval.fewshot import (
    BIAS_CONSTANT,
    STD_EPS,
    fewshot_sweep,
    ridge_accuracies,
    ridge_solve,
    select_fewshot_indices,
    standardize,
)


def fewshot_linear_accuracy(xtr, ytr, xte, yte, l2_reg=1024.0, num_classes=None, standardize=True):
    """One l2_reg's accuracy (the library solves several at once: `ridge_accuracies`)."""
    return ridge_accuracies(xtr, ytr, xte, yte, [l2_reg], num_classes, standardize)[0]


def _lstsq_ridge(X: np.ndarray, Y: np.ndarray, l2_reg: float) -> np.ndarray:
    """Reference: least squares on the augmented system [X; sqrt(l2) I] W = [Y; 0]."""
    D, K = X.shape[1], Y.shape[1]
    A = np.concatenate([X, np.sqrt(l2_reg) * np.eye(D)])
    B = np.concatenate([Y, np.zeros((D, K))])
    return np.linalg.lstsq(A, B, rcond=None)[0]


def _reference_accuracy(xtr, ytr, xte, yte, l2_reg, K) -> float:
    """The whole recipe in numpy, written out independently."""
    mean, std = xtr.mean(0), xtr.std(0) + STD_EPS
    Xtr = np.c_[(xtr - mean) / std, np.full(len(xtr), BIAS_CONSTANT)]
    Xte = np.c_[(xte - mean) / std, np.full(len(xte), BIAS_CONSTANT)]
    Y = 2.0 * np.eye(K)[ytr] - 1.0
    W = _lstsq_ridge(Xtr, Y, l2_reg)
    return float(np.mean((Xte @ W).argmax(1) == yte))


def _clusters(rng, num_classes, per_class, dim, sep, centers=None):
    """Gaussian clusters: unit noise around per-class centers of scale `sep`."""
    if centers is None:
        centers = sep * rng.standard_normal((num_classes, dim))
    y = np.repeat(np.arange(num_classes), per_class)
    x = centers[y] + rng.standard_normal((len(y), dim))
    return x.astype(np.float32), y, centers


@pytest.mark.parametrize(("n", "d"), [(60, 12), (12, 60)], ids=["primal", "dual"])
@pytest.mark.parametrize("l2_reg", [0.5, 1024.0])
def test_ridge_solve_matches_lstsq(n: int, d: int, l2_reg: float) -> None:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d))
    Y = rng.standard_normal((n, 4))
    W = ridge_solve(torch.from_numpy(X), torch.from_numpy(Y), l2_reg)
    assert W.dtype == torch.float64 and W.shape == (d, 4)
    np.testing.assert_allclose(W.numpy(), _lstsq_ridge(X, Y, l2_reg), rtol=1e-9, atol=1e-12)
    # numpy inputs work too.
    np.testing.assert_array_equal(ridge_solve(X, Y, l2_reg).numpy(), W.numpy())


@pytest.mark.parametrize(("per_class", "d"), [(20, 8), (3, 40)], ids=["primal", "dual"])
@pytest.mark.parametrize("l2_reg", [0.1, 1024.0])
def test_accuracy_matches_reference(per_class: int, d: int, l2_reg: float) -> None:
    rng = np.random.default_rng(1)
    # Overlapping clusters so accuracy is between chance and 1 and sensitive to W.
    xtr, ytr, c = _clusters(rng, 5, per_class, d, sep=0.4)
    xte, yte, _ = _clusters(rng, 5, 40, d, sep=0.4, centers=c)
    # Feature scales and offsets that standardization has to undo.
    scale, shift = rng.uniform(0.1, 10, d), rng.uniform(-5, 5, d)
    xtr, xte = xtr * scale + shift, xte * scale + shift
    got = fewshot_linear_accuracy(xtr, ytr, xte, yte, l2_reg=l2_reg)
    assert isinstance(got, float)
    assert 0.2 < got < 1.0
    assert got == pytest.approx(_reference_accuracy(xtr, ytr, xte, yte, l2_reg, 5), abs=1e-12)
    # Torch tensors (any float dtype) give the same answer.
    got_t = fewshot_linear_accuracy(
        torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), yte, l2_reg=l2_reg
    )
    assert got_t == got


def test_standardize_hand_example() -> None:
    train = torch.tensor([[0.0, 5.0], [2.0, 5.0]], dtype=torch.float64)
    test = torch.tensor([[4.0, 6.0]], dtype=torch.float64)
    # Train mean (1, 5), population std (1, 0): std + eps = (1 + 1e-5, 1e-5).
    tr, te = standardize(train, test)
    s = 1.0 + STD_EPS
    torch.testing.assert_close(tr, torch.tensor([[-1 / s, 0.0], [1 / s, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(te, torch.tensor([[3 / s, 1 / STD_EPS]], dtype=torch.float64))


def test_test_statistics_are_not_used() -> None:
    # Scoring the test split one sample at a time gives the same accuracy as all at once.
    rng = np.random.default_rng(2)
    xtr, ytr, c = _clusters(rng, 4, 5, 16, sep=0.5)
    xte, yte, _ = _clusters(rng, 4, 10, 16, sep=0.5, centers=c)
    xte = xte + 3.0  # shifted test split: its own mean must not be subtracted
    whole = fewshot_linear_accuracy(xtr, ytr, xte, yte, num_classes=4)
    single = [
        fewshot_linear_accuracy(xtr, ytr, xte[i : i + 1], yte[i : i + 1], num_classes=4)
        for i in range(len(yte))
    ]
    assert whole == pytest.approx(np.mean(single), abs=1e-12)


def test_constant_feature_is_harmless() -> None:
    rng = np.random.default_rng(3)
    xtr, ytr, c = _clusters(rng, 3, 4, 10, sep=0.5)
    xte, yte, _ = _clusters(rng, 3, 20, 10, sep=0.5, centers=c)
    base = fewshot_linear_accuracy(xtr, ytr, xte, yte)
    # A constant train column standardizes to exactly 0, so it cannot change the fit.
    xtr_c = np.c_[xtr, np.full(len(xtr), 7.0)]
    xte_c = np.c_[xte, rng.standard_normal(len(xte))]
    got = fewshot_linear_accuracy(xtr_c, ytr, xte_c, yte)
    assert np.isfinite(got) and got == base


def test_separated_clusters_five_shot() -> None:
    rng = np.random.default_rng(4)
    pool_x, pool_y, c = _clusters(rng, 10, 50, 64, sep=1.0)
    test_x, test_y, _ = _clusters(rng, 10, 100, 64, sep=1.0, centers=c)
    res = fewshot_sweep(pool_x, pool_y, test_x, test_y, shots=(1, 5), seeds=(0, 1, 2))
    assert res["5shot"] >= 0.99
    assert min(res["shots"][5]["l2_reg"]["1024.0"]["per_seed"]) >= 0.99


def test_nested_subsets_and_seeds() -> None:
    labels = np.random.default_rng(5).integers(0, 6, size=300)
    sel1 = select_fewshot_indices(labels, (1,), seeds=(0, 1))
    sel5 = select_fewshot_indices(labels, (1, 5), seeds=(0, 1))
    for seed in (0, 1):
        assert set(sel1[seed]) <= set(sel5[seed])
        assert np.bincount(labels[sel1[seed]], minlength=6).tolist() == [1] * 6
        assert np.bincount(labels[sel5[seed]], minlength=6).tolist() == [5] * 6
        # Class-ordered, within a class in permutation order: the 1-shot pick leads each class.
        assert np.all(np.diff(labels[sel5[seed]]) >= 0)
        np.testing.assert_array_equal(sel5[seed][::5], sel1[seed])
        # The draw: per class in order, a permutation from default_rng(seed).
        rng = np.random.default_rng(seed)
        ref = [rng.permutation(np.flatnonzero(labels == c))[:5] for c in range(6)]
        np.testing.assert_array_equal(sel5[seed], np.concatenate(ref))
    assert set(sel5[0]) != set(sel5[1])


def test_sweep_uses_the_nested_subsets() -> None:
    rng = np.random.default_rng(6)
    pool_x, pool_y, c = _clusters(rng, 4, 12, 8, sep=0.3)
    test_x, test_y, _ = _clusters(rng, 4, 25, 8, sep=0.3, centers=c)
    res = fewshot_sweep(pool_x, pool_y, test_x, test_y, shots=(2, 5), seeds=(0, 3))
    for k in (2, 5):
        sel = select_fewshot_indices(pool_y, (k,), seeds=(0, 3))
        expected = [
            fewshot_linear_accuracy(pool_x[i], pool_y[i], test_x, test_y) for i in sel.values()
        ]
        assert res["shots"][k]["l2_reg"]["1024.0"]["per_seed"] == expected


def test_sweep_on_preselected_pool_matches_full_pool() -> None:
    # The documented recipe: extract features only for the selected rows, remap, same result.
    rng = np.random.default_rng(7)
    x, y, c = _clusters(rng, 5, 40, 8, sep=0.3)
    test_x, test_y, _ = _clusters(rng, 5, 20, 8, sep=0.3, centers=c)
    shots, seeds = (1, 3), (0, 1, 2)
    full = fewshot_sweep(x, y, test_x, test_y, shots=shots, seeds=seeds)
    sel = select_fewshot_indices(y, shots, seeds)
    rows = np.unique(np.concatenate(list(sel.values())))
    remapped = {s: np.searchsorted(rows, i) for s, i in sel.items()}
    part = fewshot_sweep(x[rows], y[rows], test_x, test_y, shots, seeds, selection=remapped)
    assert part == full


def test_shots_larger_than_class_warns_once_and_uses_all() -> None:
    labels = np.array([0] * 20 + [1] * 3 + [2] * 20)
    with pytest.warns(UserWarning, match="fewer than 10") as record:
        sel = select_fewshot_indices(labels, (5, 10), seeds=(0, 1))
    assert len(record) == 1
    assert np.bincount(labels[sel[0]]).tolist() == [10, 3, 10]

    rng = np.random.default_rng(8)
    x = rng.standard_normal((len(labels), 4)).astype(np.float32)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = fewshot_sweep(x, labels, x, labels, shots=(1, 5, 10), seeds=(0, 1))
    assert len(record) == 1 and issubclass(record[0].category, UserWarning)
    assert len(res["shots"][10]["l2_reg"]["1024.0"]["per_seed"]) == 2


def test_result_structure() -> None:
    rng = np.random.default_rng(9)
    x, y, c = _clusters(rng, 3, 10, 6, sep=0.5)
    tx, ty, _ = _clusters(rng, 3, 10, 6, sep=0.5, centers=c)
    res = fewshot_sweep(x, y, tx, ty, shots=(1, 2), seeds=(4, 5, 6), l2_regs=(8.0, 1024.0))
    assert set(res) == {"shots", "seeds", "num_classes", "standardize", "1shot", "2shot"}
    assert res["seeds"] == [4, 5, 6] and res["num_classes"] == 3
    assert set(res["shots"]) == {1, 2}
    for k in (1, 2):
        by_l2 = res["shots"][k]["l2_reg"]
        assert set(by_l2) == {"8.0", "1024.0"}
        for entry in by_l2.values():
            assert set(entry) == {"mean", "std", "per_seed"}
            assert len(entry["per_seed"]) == 3
            assert all(isinstance(a, float) and 0 <= a <= 1 for a in entry["per_seed"])
            assert entry["mean"] == pytest.approx(np.mean(entry["per_seed"]))
            assert entry["std"] == pytest.approx(np.std(entry["per_seed"]))
        assert res[f"{k}shot"] == by_l2["8.0"]["mean"]  # the first l2_reg
    json.loads(json.dumps(res))


def test_ridge_solve_rejects_nonpositive_l2() -> None:
    with pytest.raises(ValueError, match="l2_reg"):
        ridge_solve(np.eye(3), np.eye(3), 0.0)
