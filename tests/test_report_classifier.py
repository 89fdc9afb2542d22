"""The report's classifier figures (confusion matrix, per-class accuracy) for fine-tunes and
predict output directories, and the fine-tuning figure grouped by encoder and label budget,
from run directories written by hand."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("matplotlib")

from ssl_vit.cli import main as cli_main  # noqa: E402
from ssl_vit.eval.confusion import confusion_summary  # noqa: E402
from ssl_vit.report import build_report  # noqa: E402
from ssl_vit.report.budget import finetune_groups  # noqa: E402
from ssl_vit.report.classifier import (  # noqa: E402
    chosen_runs,
    confusion_of,
    most_confused,
    per_class_accuracy,
    row_normalised,
    top1_of,
    worst_classes,
)
from ssl_vit.report.classifier_section import MAP_UP_TO, TOP_N, classifier_section  # noqa: E402
from ssl_vit.report.runs import link_runs, load_runs  # noqa: E402

CKPT = "runs/s/pretrain/paper_mpp/checkpoints/step_00001200"
NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# Per-class offsets from a run's top-1 (they sum to 0: 100 images a class keep top-1 exact).
OFFSETS = [-9, -7, -5, -3, -1, 1, 3, 5, 7, 9]
# {(encoder, K): top-1 (%) of seeds 0 and 1}, the quick start's 2 x 3 x 2 fine-tunes.
TOP1 = {
    ("mpp", 10): (40, 46),
    ("mpp", 100): (66, 64),  # seed 0 the better one
    ("mpp", 0): (80, 84),
    ("scratch", 10): (20, 24),
    ("scratch", 100): (32, 36),
    ("scratch", 0): (60, 62),
}


def _write(path: Path, config: dict | None, results: dict | None, rows: tuple = ()) -> None:
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None:
        (path / "results.json").write_text(json.dumps(results))


def _matrix(top1: int) -> list[list[int]]:
    """100 images a class: class c right top1 + OFFSETS[c] times, the rest taken for c + 1."""
    m = [[0] * 10 for _ in range(10)]
    for c, off in enumerate(OFFSETS):
        m[c][c] = top1 + off
        m[c][(c + 1) % 10] = 100 - (top1 + off)
    return m


def _finetune(root: Path, enc: str, k: int, seed: int, top1: int) -> None:
    """A finished fine-tune as pipelines/finetune.py writes it (results with the matrix)."""
    m = _matrix(top1)
    summary = confusion_summary(torch.tensor(m), NAMES)
    results = {
        "top1": top1 / 100,
        "labels_per_class": k,
        "num_labelled": 10 * k or 6000,
        "num_classes": 10,
        "label_names": NAMES,
        "per_class_top1": summary["per_class_top1"],
        "confusion_matrix": m,
        "seed": seed,
        "recipe": "paper",
    }
    init = CKPT if enc == "mpp" else "none"
    config = {"init": {"checkpoint": init}, "data": {"labels_per_class": k}, "seed": seed}
    # Lower for the pretrained encoder and more labels; seed 1 0.2 lower than seed 0.
    loss0 = 2.3 - 0.2 * seed - (0.4 if enc == "mpp" else 0.0) + {10: 0.3, 100: 0.15, 0: 0.0}[k]
    rows = [{"step": s, "loss": loss0 - s / 400} for s in (100, 200, 300)]
    rows[-1]["top1"] = top1 / 100  # evaluated at the end only
    _write(root / f"ft-{enc}-l{k}-s{seed}", {**config, "recipe": "paper"}, results, rows)


def _quickstart(root: Path) -> Path:
    for (enc, k), top1s in TOP1.items():
        for seed, top1 in enumerate(top1s):
            _finetune(root, enc, k, seed, top1)
    return root


# A predict run's hand-made 3-class matrix: rows true, columns predicted.
PRED_M = [[3, 1, 0], [0, 0, 0], [2, 2, 4]]


def _predict(path: Path, labelled: bool = True, config: bool = False) -> Path:
    results = {
        "job": "predict",
        "checkpoint": "runs/ft-mpp-l0-s1",
        "source": "data/photos",
        "images": 12,
        "skipped": 1,
        "label_names": ["cat", "dog", "fox"],
    }
    if labelled:
        results |= confusion_summary(torch.tensor(PRED_M), ["cat", "dog", "fox"])
    cfg = {"checkpoint": results["checkpoint"], "source": "data/photos", "top_k": 5}
    _write(path, cfg if config else None, results)
    # One row per image predicted (PredictionWriter's), as results.json's "images" says.
    row = {"key": "a.png", "label": "cat", "score": 0.9, "top_k": [["cat", 0.9]]}
    (path / "predictions.jsonl").write_text((json.dumps(row) + "\n") * results["images"])
    return path


def test_row_normalised_and_per_class_accuracy_hand_computed(tmp_path):
    assert row_normalised(PRED_M) == [
        [0.75, 0.25, 0.0],  # 3 / 4, 1 / 4
        [None, None, None],  # no image of "dog"
        [0.25, 0.25, 0.5],  # 2 / 8, 2 / 8, 4 / 8
    ]
    assert per_class_accuracy(PRED_M) == [0.75, None, 0.5]
    assert top1_of(PRED_M) == 7 / 12
    assert top1_of([[0, 0], [0, 0]]) is None
    # What the report draws agrees with what the jobs wrote (ssl_vit.eval.confusion).
    run = load_runs([_predict(tmp_path / "pred")])[0]
    conf = confusion_of(run)
    assert conf.names == ["cat", "dog", "fox"] and conf.counts == PRED_M
    written = run.results["per_class_top1"]
    assert [written[n] for n in conf.names] == per_class_accuracy(conf.counts)
    assert run.results["top1"] == top1_of(conf.counts)


def test_a_bad_matrix_leaves_the_run_out(tmp_path, caplog):
    """A matrix that does not match its label names: the run is left out when read, with one
    line naming its results.json (issue 47 #12), never drawn."""
    path = _predict(tmp_path / "pred")
    results = json.loads((path / "results.json").read_text())
    results["confusion_matrix"] = [[1, 2], [3, 4]]  # 2 x 2 for 3 names
    (path / "results.json").write_text(json.dumps(results))
    _predict(tmp_path / "good")
    with caplog.at_level("WARNING", logger="ssl_vit.report.runs"):
        assert [r.name for r in load_runs([tmp_path])] == ["good"]
    assert [m.split(":")[0] for m in caplog.messages] == [str(path / "results.json")]


def test_predict_dirs_are_runs_of_their_own(tmp_path):
    """Found in a folder with or without a config.yaml, still running (its config.yaml only)
    or finished, in no encoder's group."""
    _predict(tmp_path / "a" / "pred")
    _predict(tmp_path / "b" / "pred-cfg", config=True)
    _write(tmp_path / "b" / "pred-running", {"checkpoint": "x", "source": "y", "top_k": 5}, None)
    _finetune(tmp_path / "c", "scratch", 10, 0, 20)
    runs = load_runs([tmp_path])
    assert [(r.name, r.job.name, r.finished) for r in runs] == [
        ("pred", "predict", True),
        ("pred-cfg", "predict", True),
        ("pred-running", "predict", False),
        ("ft-scratch-l10-s0", "finetune", True),
    ]
    assert {k: [r.name for r, _ in v] for k, v in link_runs(runs).items()} == {
        None: ["ft-scratch-l10-s0"]
    }


def test_finetune_groups_of_the_quickstart(tmp_path):
    """12 runs: 2 encoders x 3 budgets x 2 seeds -> 6 groups of 2 seeds, encoders by name with
    scratch last, budgets ascending with every label (0) last."""
    groups = finetune_groups(load_runs([_quickstart(tmp_path)]))
    assert {g: [r.name for r in runs] for g, runs in groups.items()} == {
        ("paper_mpp", 10): ["ft-mpp-l10-s0", "ft-mpp-l10-s1"],
        ("paper_mpp", 100): ["ft-mpp-l100-s0", "ft-mpp-l100-s1"],
        ("paper_mpp", 0): ["ft-mpp-l0-s0", "ft-mpp-l0-s1"],
        ("scratch", 10): ["ft-scratch-l10-s0", "ft-scratch-l10-s1"],
        ("scratch", 100): ["ft-scratch-l100-s0", "ft-scratch-l100-s1"],
        ("scratch", 0): ["ft-scratch-l0-s0", "ft-scratch-l0-s1"],
    }
    assert list(groups) == [(e, k) for e in ("paper_mpp", "scratch") for k in (10, 100, 0)]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_finetune_figure_has_a_bar_per_group_and_a_dot_per_seed(tmp_path):
    from ssl_vit.report.finetune_figures import finetune_figure

    groups = finetune_groups(load_runs([_quickstart(tmp_path)]))
    fig = finetune_figure(groups, 600.0)
    ax_loss, ax_top1 = fig.axes  # evaluated at the end only: no top-1-during-training panel
    assert [t.get_text() for t in ax_top1.get_xticklabels()] == ["10", "100", "all (600)"]
    heights = [round(p.get_height(), 6) for p in ax_top1.patches]
    # Bars: means of the seeds, paper_mpp's budgets then scratch's.
    assert heights == [43.0, 65.0, 82.0, 22.0, 34.0, 61.0]
    dots = sorted(y for line in ax_top1.lines for y in line.get_ydata())
    assert dots == sorted(float(t) for pair in TOP1.values() for t in pair)
    assert len(ax_loss.lines) == 6  # a loss line per group (mean of its seeds)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0] == "paper_mpp, 10 / class (2 seeds)"
    assert legend[-1] == "scratch, all (600) / class (2 seeds)"
    # The mean loss of the two seeds at each step (seed 1 starts 0.2 lower).
    assert ax_loss.lines[0].get_ydata().tolist() == pytest.approx([1.85, 1.6, 1.35])
    # No metrics rows (only results.json): the final top-1 alone, the legend its encoders.
    for runs in groups.values():
        for run in runs:
            run.rows = []
    fig = finetune_figure(groups, 600.0)
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 6
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["paper_mpp", "scratch"]


def test_chosen_runs_best_seed_per_group_or_all_when_few(tmp_path):
    runs = load_runs([_quickstart(tmp_path / "qs"), _predict(tmp_path / "pred")])
    chosen, how = chosen_runs(runs)
    assert [r.name for r in chosen] == [
        "pred",
        "ft-mpp-l10-s1",
        "ft-mpp-l100-s0",  # 66 > 64
        "ft-mpp-l0-s1",
        "ft-scratch-l10-s1",
        "ft-scratch-l100-s1",
        "ft-scratch-l0-s1",
    ]
    assert "best seed" in how and "6 of 12" in how
    few = [r for r in runs if re.fullmatch(r"ft-mpp-l(10|0)-s\d", r.name)]  # 4 fine-tunes
    assert [r.name for r in chosen_runs(few)[0]] == [
        "ft-mpp-l10-s0",
        "ft-mpp-l10-s1",
        "ft-mpp-l0-s0",
        "ft-mpp-l0-s1",
    ]


def _images(page: str) -> list[str]:
    return re.findall(r"<img alt='([^']*)' src='data:image/png;base64,", page)


def test_report_of_one_predict_dir(tmp_path):
    """`ssl-vit report PREDICT_DIR`: its confusion figure and the runs, no empty sections."""
    pred = _predict(tmp_path / "pred")
    assert cli_main(["report", str(pred), "--output", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    assert _images(page) == ["confusion_pred"]
    assert ">Per-class accuracy</h2>" in page and ">Runs</h2>" in page
    assert ">Pretraining</h2>" not in page and ">Summary</h2>" not in page
    assert "`ssl-vit predict` of runs/ft-mpp-l0-s1 on data/photos (12 images, 1 skipped)" in page
    md = (tmp_path / "out" / "report.md").read_text()
    assert "figures/confusion_pred.png" in md
    png = tmp_path / "out" / "figures" / "confusion_pred.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The runs table names the classifier it ran.
    assert "| pred | predict | runs/ft-mpp-l0-s1 |" in md


def test_report_of_an_unlabelled_predict_dir_says_so(tmp_path):
    pred = _predict(tmp_path / "pred", labelled=False, config=True)
    _write(tmp_path / "running", {"checkpoint": "x", "source": "y", "top_k": 5}, None)
    paths = build_report([pred, tmp_path / "running"], tmp_path / "out")
    page = paths["html"].read_text()
    assert _images(page) == []
    assert "pred: 12 images predicted from data/photos without labels: no accuracy" in page
    assert "running:" not in page  # not finished: only the runs table names it
    assert "no results.json (running or stopped)" in page


@pytest.mark.system
def test_report_of_the_quickstart_and_a_predict_dir(tmp_path):
    """12 fine-tunes and a predict run: the grouped fine-tuning figure, accuracy vs labels,
    and 7 confusion figures (the predict run, the best seed of each of the 6 groups)."""
    root = _quickstart(tmp_path / "runs")
    _predict(root / "predict" / "photos")
    paths = build_report([root], tmp_path / "out")
    page = paths["html"].read_text()
    assert _images(page) == [
        "finetune_curves",
        "accuracy_vs_labels",
        "confusion_photos",
        *[f"confusion_ft-{e}-l{k}-s{s}" for e, k, s in
          [("mpp", 10, 1), ("mpp", 100, 0), ("mpp", 0, 1), ("scratch", 10, 1),
           ("scratch", 100, 1), ("scratch", 0, 1)]],
    ]  # fmt: skip
    titles = re.findall(r"<h2 id='[^']*'>([^<]*)</h2>", page)
    assert titles == [
        "Summary",
        "Pretraining",
        "Few-shot",
        "Fine-tuning",
        "Accuracy vs labels per class",
        "Per-class accuracy",
        "What the model learned",
        "Runs",
    ]
    assert "ft-mpp-l100-s0: fine-tune of paper_mpp, 100 labels / class, seed 0" in page
    assert "Fine-tunes shown: the best seed (top-1) of each encoder and label budget" in page


def test_a_captions_label_budget_is_the_runs_own(tmp_path):
    """K per class, every label with the run's own count (uneven classes have no per-class
    figure), or the labels picked without theirs (named with the encoder), never "all"."""
    from ssl_vit.report.classifier_section import _what

    base = {"top1": 0.5, "num_classes": 10, "seed": 0}
    picked = {"labels_per_class": 0, "labels_select": "typiclust", "labels_budget": 100}
    runs = {
        "k10": ({"labels_per_class": 10}, {"labels_per_class": 10, "num_labelled": 100}),
        "all": ({"labels_per_class": 0}, {"labels_per_class": 0, "num_labelled": 6043}),
        "pick": (picked, {"labels_per_class": 0, "num_labelled": 100}),
    }
    for name, (data, results) in runs.items():
        _write(tmp_path / name, {"init": {"checkpoint": CKPT}, "data": data}, base | results)
    captions = {r.name: _what(r)[1] for r in load_runs([tmp_path])}
    assert captions == {
        "k10": "k10: fine-tune of paper_mpp, 10 labels / class, seed 0, on its data.eval.",
        "all": "all: fine-tune of paper_mpp, every label (6,043 images), seed 0, on its data.eval.",
        "pick": "pick: fine-tune of paper_mpp [100 labels by typiclust], seed 0, on its data.eval.",
    }


# --- Issue 47 #8: many classes (ImageNet's 1,000) are listed, not drawn, in bounded memory ---


def test_most_confused_pairs_and_worst_classes_hand_computed():
    m = [
        [5, 3, 0, 2],  # class 0: 5 / 10 right; 3 taken for 1, 2 for 3
        [0, 9, 1, 0],  # class 1: 9 / 10
        [0, 3, 1, 0],  # class 2: 1 / 4, 3 taken for 1
        [0, 0, 0, 0],  # class 3: no images, in no list
    ]
    # (0 -> 1) and (2 -> 1) have 3 images each: 2 -> 1 is 3/4 of class 2, 0 -> 1 3/10 of 0.
    assert most_confused(m, 3) == [(2, 1, 3), (0, 1, 3), (0, 3, 2)]
    assert most_confused(m, 10) == [(2, 1, 3), (0, 1, 3), (0, 3, 2), (1, 2, 1)]
    assert worst_classes(m, 2) == [(2, 0.25, 1), (0, 0.5, 1)]
    assert worst_classes([[4, 0], [0, 0]], 5) == [(0, 1.0, None)]  # never wrong: taken for none


def _many_classes(
    path: Path, K: int, per_class: int, finetune: bool = False, planted: tuple = (421, 7)
) -> Path:
    """A K-class predict output directory (or fine-tune) as the jobs write them: results.json
    with the K x K matrix (indent=2, as MetricsWriter writes it), one predictions.jsonl row
    per image. Class i is right per_class - 2 times, taken for i + 1 twice, but for the
    planted most confused pair (i, j): class i right once, taken for j 7 times of 10."""
    names = [f"class_{i:04d}" for i in range(K)]
    m = torch.zeros(K, K, dtype=torch.int64)
    m[torch.arange(K), torch.arange(K)] = per_class - 2
    m[torch.arange(K), (torch.arange(K) + 1) % K] = 2
    i, j = planted
    m[i] = 0
    m[i, i], m[i, j], m[i, (i + 1) % K] = 1, 7, 2
    summary = confusion_summary(m, names)
    images = summary["num_labelled"]
    path.mkdir(parents=True)
    if finetune:
        results = {"step": 10, "labels_per_class": 0, "num_classes": K, "label_names": names}
        config = {"init": {"checkpoint": "none"}, "data": {"labels_per_class": 0}}
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    else:
        results = {"job": "predict", "checkpoint": "runs/ft", "source": "data/val"}
        results |= {"images": images, "skipped": 0, "label_names": names}
        row = {"key": "a.png", "label": names[0], "score": 0.5, "top_k": [[names[0], 0.5]]}
        (path / "predictions.jsonl").write_text((json.dumps(row) + "\n") * images)
    (path / "results.json").write_text(json.dumps(results | summary, indent=2) + "\n")
    return path


def test_many_classes_are_listed_not_drawn(tmp_path, monkeypatch):
    """Over MAP_UP_TO classes, a fine-tune (like a predict run) is two tables: its TOP_N most
    confused pairs, the planted one first, and its TOP_N worst classes; no heat map. A run of
    MAP_UP_TO classes is still drawn (test_report_of_one_predict_dir draws one)."""
    from ssl_vit.report import classifier_section as section

    drawn = []
    monkeypatch.setattr(section, "_draw", lambda s, runs: drawn.extend(runs))
    ft = _many_classes(tmp_path / "ft-many", MAP_UP_TO + 10, 10, finetune=True, planted=(21, 7))
    pred = _many_classes(tmp_path / "pred-50", MAP_UP_TO, 10, planted=(21, 7))
    s = classifier_section(load_runs([ft, pred]))
    assert [(run.name, len(conf.names)) for run, conf in drawn] == [("pred-50", MAP_UP_TO)]
    pairs, worst = s.tables
    assert pairs.header == ["true class", "predicted as", "images", "% of the true class"]
    assert len(pairs.rows) == len(worst.rows) == TOP_N
    assert pairs.rows[0] == ["class_0021", "class_0007", "7", "70%"]
    assert pairs.rows[1] == ["class_0000", "class_0001", "2", "20%"]  # then 2 of 10, by class
    assert worst.rows[0] == ["class_0021", "10.0", "1 / 10", "class_0007 (70%)"]
    assert worst.rows[1] == ["class_0000", "80.0", "8 / 10", "class_0001 (20%)"]
    assert pairs.caption.startswith("ft-many (scratch, every label (600 images), seed ?), top-1")
    assert "60 classes" in pairs.caption
    assert any(n.startswith(f"A classifier of more than {MAP_UP_TO} classes") for n in s.notes)


@pytest.mark.system
def test_report_of_1000_classes_in_bounded_memory(tmp_path):
    """Issue 47 #8: `ssl-vit report` of a 1,000-class predict directory (ImageNet's) in a
    process limited to 1 GiB of address space (it took 3.9 GB and 55 s before: the heat map
    grew with K^2) names the planted most confused pair and draws no K x K figure."""
    import resource
    import subprocess
    import sys

    pred, out = _many_classes(tmp_path / "imagenet-val", 1000, 10), tmp_path / "out"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    cmd = [sys.executable, "-m", "ssl_vit.cli", "report", str(pred), "--output", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, preexec_fn=limited, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    md = (out / "report.md").read_text()
    assert "| class_0421 | class_0007 | 7 | 70% |" in md
    assert "| class_0421 | 10.0 | 1 / 10 | class_0007 (70%) |" in md
    assert not list((out / "figures").glob("*.png"))
