"""Training-curve figures of the report: pretraining loss / colour accuracy, few-shot accuracy
over pretraining steps, versus shots and versus layer (fine-tuning's: finetune_figures.py).

Each function returns a matplotlib Figure (Agg canvas, no pyplot global state), or None when
the runs hold nothing to draw. matplotlib is imported here only: the core library never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ssl_vit.eval.shots import ALL_SHOTS, shot_key, shot_order
from ssl_vit.report.runs import Run

__all__ = [
    "new_figure",
    "pretrain_curves",
    "fewshot_over_steps",
    "fewshot_vs_shots",
    "fewshot_vs_layer",
    "finish_log_x",
    "series",
]


def new_figure(width: float, height: float, **subplots: Any) -> tuple[Figure, Any]:
    """A Figure on the Agg canvas and its axes (plt.subplots without pyplot)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(**subplots)


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the metrics rows that logged `key`."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def pretrain_curves(runs: list[Run]) -> Figure | None:
    """Loss and colour accuracy of the corrupted patches vs step, one line per run."""
    runs = [r for r in runs if series(r.rows, "loss")[0]]
    if not runs:
        return None
    fig, (ax_loss, ax_acc) = new_figure(10, 3.6, ncols=2)
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax_loss.plot(*series(run.rows, "loss"), color=color, label=run.name)
        ax_acc.plot(*series(run.rows, "color_acc"), color=color, label=run.name)
        steps, majority = series(run.rows, "color_acc_majority")
        ax_acc.plot(steps, majority, color=color, ls=":", lw=1)
    ax_loss.set(xlabel="pretraining step", ylabel="loss", title="Pretraining loss")
    ax_acc.set(
        xlabel="pretraining step",
        ylabel="accuracy on corrupted patches",
        title="Colour accuracy (dotted: most frequent colour)",
    )
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _shots_of(key: str) -> tuple[int, int]:
    """Sort key of a logged few-shot key: 'fewshot/10shot' -> 10's, 'fewshot/allshot' last."""
    k = key.split("/", 1)[-1].removesuffix("shot")
    return shot_order(k) if k == ALL_SHOTS or k.isdigit() else (0, 0)


KNN_KEY = "knn/top1"  # the k-NN monitor's rows (pipelines/pretrain.py, fewshot.knn_k)


def _monitor_keys(rows: list[dict]) -> list[str]:
    """The few-shot keys by shots, then the k-NN monitor's if logged."""
    fewshot = sorted({k for r in rows for k in r if k.startswith("fewshot/")}, key=_shots_of)
    return fewshot + ([KNN_KEY] if any(KNN_KEY in r for r in rows) else [])


def fewshot_over_steps(runs: list[Run]) -> Figure | None:
    """Few-shot accuracy (and k-NN top-1, when logged) during pretraining vs step: one panel
    per shot count, one line per run."""
    runs = [r for r in runs if _monitor_keys(r.rows)]
    if not runs:
        return None
    keys = _monitor_keys([row for r in runs for row in r.rows])  # every run's, in one order
    fig, axes = new_figure(3.2 * len(keys), 3.2, ncols=len(keys), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for i, run in enumerate(runs):
            steps, acc = series(run.rows, key)
            ax.plot(steps, [100 * a for a in acc], "o-", color=f"C{i}", label=run.name)
        title = "k-NN top-1" if key == KNN_KEY else key.split("/", 1)[1]
        ax.set(xlabel="pretraining step", ylabel="accuracy (%)", title=title)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return fig


def fewshot_vs_shots(curves: list[tuple[str, dict[int, dict]]]) -> Figure | None:
    """Few-shot accuracy vs shots per class, one line per (label, fewshot_table): mean over
    seeds with a +-1 std band and each seed as a dot."""
    curves = [(label, t) for label, t in curves if t]
    if not curves:
        return None
    # "all" (the full linear probe) sits right of the largest count, on a tick of its own.
    counts = [k for _, t in curves for k in t if k != ALL_SHOTS]
    x_all = 4 * max(counts, default=25)

    def x_of(k):
        return x_all if k == ALL_SHOTS else k

    fig, ax = new_figure(7, 4.2)
    for i, (label, table) in enumerate(curves):
        shots = [x_of(k) for k in table]
        mean = np.array([100 * e["mean"] for e in table.values()])
        std = np.array([100 * e.get("std", 0.0) for e in table.values()])
        ax.plot(shots, mean, "o-", color=f"C{i}", label=label)
        ax.fill_between(shots, mean - std, mean + std, color=f"C{i}", alpha=0.15)
        for k, e in table.items():
            seeds = e.get("per_seed") or []
            ax.plot([x_of(k)] * len(seeds), [100 * a for a in seeds], ".", color=f"C{i}", alpha=0.5)
    all_shots = sorted({k for _, t in curves for k in t}, key=shot_order)
    finish_log_x(
        ax,
        {x_of(k): str(k) for k in all_shots},
        xlabel="examples per class",
        ylabel="test accuracy (%)",
        title="Few-shot linear accuracy (mean +- std over seeds; dots: seeds)",
    )
    return fig


def finish_log_x(ax, ticks: dict[float, str], **labels: str) -> None:
    """A log x axis with exactly `ticks` ({x: label}), axis labels and title, grid, legend."""
    ax.set_xscale("log")
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.minorticks_off()
    ax.set(**labels)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def fewshot_vs_layer(curves: list[tuple[str, dict[str, Any]]]) -> Figure | None:
    """Few-shot accuracy vs block, one panel per shot count: per (label, `layers` table of a
    few-shot result) a line per pooling (solid cls+gap, dashed gap, dotted cls) and the
    last blocks' concatenation as a star right of the last block."""
    curves = [(label, t) for label, t in curves if t and t.get("readouts")]
    if not curves:
        return None
    shots = sorted(
        {shot_key(k) for _, t in curves for r in t["readouts"].values() for k in r["shots"]},
        key=shot_order,
    )
    depth = max(t["depth"] for _, t in curves)
    fig, axes = new_figure(3.6 * len(shots), 4.4, ncols=len(shots), squeeze=False)
    styles = {"cls+gap": "-", "gap": "--", "cls": ":"}
    for ax, k in zip(axes[0], shots, strict=True):
        for i, (label, table) in enumerate(curves):
            for pool, ls in styles.items():
                pts = sorted(
                    (r["layers"][0], 100 * _shot(r, k)["mean"])
                    for r in table["readouts"].values()
                    if r["pool"] == pool and len(r["layers"]) == 1 and _shot(r, k)
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls=ls, marker="o", ms=3, color=f"C{i}",
                            label=f"{label}, {pool}")  # fmt: skip
            for name, r in table["readouts"].items():
                if len(r["layers"]) > 1 and r["pool"] == "cls+gap" and _shot(r, k):
                    ax.plot(depth, 100 * _shot(r, k)["mean"], "*", ms=10, color=f"C{i}")
                    ax.annotate(name.split("/")[0], (depth, 100 * _shot(r, k)["mean"]), fontsize=7)
        ax.set_xticks(range(depth + 1), [str(b) for b in range(depth)] + ["cat"])
        ax.set(xlabel="block", ylabel="test accuracy (%)", title=f"{k}-shot")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8)
    fig.suptitle("Few-shot accuracy vs layer (star: last blocks concatenated, cls+gap)")
    return fig


def _shot(readout: dict[str, Any], k: int | str) -> dict[str, Any] | None:
    """A readout's entry for `k` shots (int keys in memory, str keys read back from JSON)."""
    return readout["shots"].get(k) or readout["shots"].get(str(k))
