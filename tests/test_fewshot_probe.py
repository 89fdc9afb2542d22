"""Few-shot next to a full linear probe: shots "all", the primal/dual ridge, `standardize`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import pipeline

from ssl_vit.config import FewshotConfig, load_config
from ssl_vit.config.loader import ConfigError
from ssl_vit.eval.fewshot import (
    BIAS_CONSTANT,
    STD_EPS,
    fewshot_sweep,
    ridge_accuracies,
    ridge_solve,
)
from ssl_vit.eval.readouts import best_readout, format_layer_table
from ssl_vit.eval.shots import shot_order
from ssl_vit.report.runs import fewshot_table, link_runs, load_runs
from ssl_vit.report.tables import summary_section

ROOT = Path(__file__).resolve().parents[1]


def fewshot_linear_accuracy(xtr, ytr, xte, yte, l2_reg=1024.0, num_classes=None, standardize=True):
    """One l2_reg's accuracy (the library solves several at once: `ridge_accuracies`)."""
    return ridge_accuracies(xtr, ytr, xte, yte, [l2_reg], num_classes, standardize)[0]


@pytest.mark.parametrize("n, d", [(40, 7), (7, 40), (12, 12)])
def test_primal_and_dual_give_the_same_weights(n: int, d: int) -> None:
    g = torch.Generator().manual_seed(n * 100 + d)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    Y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    primal = ridge_solve(X, Y, 0.7, form="primal")
    dual = ridge_solve(X, Y, 0.7, form="dual")
    torch.testing.assert_close(primal, dual, rtol=1e-9, atol=1e-11)
    # auto is whichever of the two is the smaller system; same weights either way
    torch.testing.assert_close(ridge_solve(X, Y, 0.7), primal, rtol=1e-9, atol=1e-11)


def test_auto_solves_the_smaller_system(monkeypatch) -> None:
    """N > D (a full probe: 50,000 images, width 192) factors a D x D matrix, not N x N."""
    sizes = []
    real = torch.linalg.cholesky
    monkeypatch.setattr(torch.linalg, "cholesky", lambda a: sizes.append(a.shape) or real(a))
    ridge_solve(torch.randn(500, 9, dtype=torch.float64), torch.randn(500, 2), 1.0)
    ridge_solve(torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 2), 1.0)
    assert sizes == [(9, 9), (5, 5)]


def _data(n_per_class: int, k: int = 4, d: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(k, d)) * 2
    y = np.repeat(np.arange(k), n_per_class)
    return centers[y] + rng.normal(size=(len(y), d)), y


def test_all_shots_is_the_full_probe_once_for_every_seed() -> None:
    xtr, ytr = _data(30)
    xte, yte = _data(20, seed=1)
    res = fewshot_sweep(xtr, ytr, xte, yte, shots=[1, 5, "all"], seeds=[0, 1, 2])
    full = fewshot_linear_accuracy(xtr, ytr, xte, yte)
    entry = res["shots"]["all"]["l2_reg"]["1024.0"]
    assert entry["per_seed"] == [full] * 3 and entry["std"] == 0.0
    assert res["allshot"] == full and list(res["shots"]) == [1, 5, "all"]
    # the 1- and 5-shot subsets are unchanged by asking for "all" too
    alone = fewshot_sweep(xtr, ytr, xte, yte, shots=[1, 5], seeds=[0, 1, 2])
    assert res["1shot"] == alone["1shot"] and res["5shot"] == alone["5shot"]
    # JSON keys come back as strings; the report reads them back in order, "all" last
    table = fewshot_table(json.loads(json.dumps(res)))
    assert list(table) == [1, 5, "all"] and table["all"]["mean"] == full


def test_only_all_needs_no_subset_draw() -> None:
    xtr, ytr = _data(10)
    res = fewshot_sweep(xtr, ytr, xtr, ytr, shots=["all"], seeds=[0])
    assert res["allshot"] == fewshot_linear_accuracy(xtr, ytr, xtr, ytr)


def test_standardize_false_is_the_raw_features_and_true_the_train_statistics() -> None:
    """Hand example: class 1 is x > 0, features a thousandth of a unit, 3:1 imbalance. Raw,
    the ridge (l2 = 0.01) cannot lift x's weight above the bias: everything is class 0. With
    the train mean/std applied (mean -5e-4, std 8.66e-4 + eps) x is O(1) and separates."""
    xtr = 1e-3 * np.array([[-1.0], [-1.0], [-1.0], [1.0]])
    ytr = np.array([0, 0, 0, 1])
    xte, yte = 1e-3 * np.array([[-1.0], [1.0]]), np.array([0, 1])
    assert fewshot_linear_accuracy(xtr, ytr, xte, yte, 0.01, standardize=False) == 0.5
    assert fewshot_linear_accuracy(xtr, ytr, xte, yte, 0.01, standardize=True) == 1.0
    # hand-standardized features through the raw path: the same accuracy
    mean, std = xtr.mean(0), xtr.std(0) + STD_EPS
    assert mean[0] == pytest.approx(-5e-4) and std[0] == pytest.approx(
        np.sqrt(3) / 2 * 1e-3 + STD_EPS
    )
    hand = fewshot_linear_accuracy((xtr - mean) / std, ytr, (xte - mean) / std, yte, 0.01, 2, False)
    assert hand == 1.0


def test_standardize_option_matches_an_independent_numpy_recipe() -> None:
    xtr, ytr = _data(5, d=8)
    xte, yte = _data(25, d=8, seed=3)
    xtr[:, 0] *= 1e3  # badly scaled dimensions: the two options differ
    xte[:, 0] *= 1e3
    for standardize in (True, False):
        mean = xtr.mean(0) if standardize else 0.0
        std = xtr.std(0) + STD_EPS if standardize else 1.0
        A = np.c_[(xtr - mean) / std, np.full(len(xtr), BIAS_CONSTANT)]
        B = np.c_[(xte - mean) / std, np.full(len(xte), BIAS_CONSTANT)]
        Y = 2.0 * np.eye(4)[ytr] - 1.0
        W = np.linalg.solve(A.T @ A + 8.0 * np.eye(A.shape[1]), A.T @ Y)
        want = float(np.mean((B @ W).argmax(1) == yte))
        got = fewshot_linear_accuracy(xtr, ytr, xte, yte, 8.0, standardize=standardize)
        assert got == pytest.approx(want)
    res = fewshot_sweep(xtr, ytr, xte, yte, shots=[5], seeds=[0], standardize=False)
    assert res["standardize"] is False


def test_layer_table_orders_all_last() -> None:
    table = {
        "block0/cls": {"shots": {1: {"mean": 0.2, "std": 0.0}, "all": {"mean": 0.5, "std": 0.0}}},
        "block1/cls": {"shots": {1: {"mean": 0.3, "std": 0.0}, "all": {"mean": 0.4, "std": 0.0}}},
    }
    best = best_readout(table)
    assert list(best["per_shot"]) == [1, "all"]
    assert best["per_shot"]["all"]["readout"] == "block0/cls"
    text = format_layer_table({"readouts": table, "best": best})
    assert text.splitlines()[0].split()[1:] == ["1-shot", "all-shot"]
    assert sorted(["all", 10, 1], key=shot_order) == [1, 10, "all"]


def test_config_accepts_counts_and_all_and_names_bad_shots() -> None:
    need = ["fewshot.train=x", "fewshot.eval=y"]
    overrides = [*need, "fewshot.shots=[1, 5, all]", "fewshot.standardize=false"]
    cfg = load_config(FewshotConfig, None, overrides).fewshot
    assert cfg.shots == [1, 5, "all"] and cfg.standardize is False
    assert load_config(FewshotConfig, None, need).fewshot.standardize is True  # today's recipe
    for bad in ("shots=[0, 5]", "shots=[5, 5]", "shots=[]", "shots=[every]"):
        with pytest.raises(ConfigError, match="fewshot.shots"):
            load_config(FewshotConfig, None, [*need, f"fewshot.{bad}"])


def test_fewshot_pipeline_with_all_shots_writes_allshot(synthetic_shards, tmp_path) -> None:
    """A real run: the "all" features are every train image; results.json, metrics and the
    report's summary table carry it as "all" / "allshot" / "all-shot"."""
    out = tmp_path / "fs"
    res = pipeline("fewshot")(
        [
            "--checkpoint",
            "random",
            "--config",
            str(ROOT / "configs/fewshot/smoke.yaml"),
            f"fewshot.train={synthetic_shards}",
            f"fewshot.eval={synthetic_shards}",
            f"output_dir={out}",
            "fewshot.shots=[1, all]",
            "fewshot.standardize=false",
        ]
    )
    saved = json.loads((out / "results.json").read_text())
    assert saved["num_train_features"] == 96 and saved["standardize"] is False
    assert set(saved["summary"]) == {"1shot", "allshot"}
    assert saved["summary"]["allshot"] == res["allshot"]
    assert saved["shots"]["all"]["l2_reg"]["1024.0"]["std"] == 0.0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "fewshot/allshot" in metrics[0]
    runs = load_runs([out])
    section = summary_section(runs, link_runs(runs))
    header = section.tables[0].header
    assert header[4:6] == ["1-shot (%)", "all-shot (%)"]
