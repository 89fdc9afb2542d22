"""`ssl-vit report` from tiny real runs (pretrain with few-shot, few-shot, fine-tune) on the
synthetic fixture, and the figure data checked against hand-computed values."""

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from conftest import pipeline  # noqa: E402

from ssl_vit.cli import main as cli_main  # noqa: E402
from ssl_vit.objectives.corruption import KEPT, MASKED, UNTOUCHED  # noqa: E402
from ssl_vit.objectives.targets import color_class_to_rgb, patch_pixels  # noqa: E402
from ssl_vit.report.examples import _paste, target_pixels  # noqa: E402
from ssl_vit.report.learned_section import filter_components, position_similarity  # noqa: E402
from ssl_vit.report.runs import link_runs, load_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    *("Summary", "Pretraining", "Few-shot", "Fine-tuning", "Per-class accuracy"),
    *("What the model learned", "Runs"),
)


@pytest.fixture(scope="module")
def runs(synthetic_shards, tmp_path_factory):
    """A 10-step pretraining (few-shot every 5 steps), a few-shot run of its checkpoint and a
    random one, a fine-tune from it and one from scratch."""
    # One thread: for these tiny models the intra-op threads only add synchronisation, and on
    # a busy machine their spinning made this fixture 20x slower (0.7 s vs 21 s measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _make_runs(synthetic_shards, tmp_path_factory.mktemp("report_runs"))
    finally:
        torch.set_num_threads(threads)


def _make_runs(synthetic_shards, root):
    fs = [
        f"fewshot.train={synthetic_shards}",
        f"fewshot.eval={synthetic_shards}",
        "fewshot.shots=[1,2]",
        "fewshot.seeds=[0,1]",
        "fewshot.num_workers=0",
        "fewshot.every=5",
        "fewshot.max_eval=32",
        "fewshot.knn_k=5",
    ]
    pipeline("pretrain")(
        [
            "--config",
            str(ROOT / "configs/pretrain/smoke.yaml"),
            f"data.train_shards={synthetic_shards}",
            f"output_dir={root / 'pre'}",
            "train.steps=10",
            "train.log_every=5",
            *fs,
        ]
    )
    ckpt = str(root / "pre" / "checkpoints" / "step_00000010")
    few = [
        "--config",
        str(ROOT / "configs/fewshot/smoke.yaml"),
        f"fewshot.train={synthetic_shards}",
        f"fewshot.eval={synthetic_shards}",
        "fewshot.seeds=[0,1]",
        "fewshot.l2_reg=[1024.0]",
        "fewshot.max_eval=32",
        "fewshot.layers=all",  # the per-layer table and its figure
        "fewshot.concat_last=2",
    ]
    pipeline("fewshot")(["--checkpoint", ckpt, *few, f"output_dir={root / 'few-pre'}"])
    pipeline("fewshot")(["--checkpoint", "random", *few, f"output_dir={root / 'few-rand'}"])
    ft = [
        "--config",
        str(ROOT / "configs/finetune/smoke.yaml"),
        f"data.train={synthetic_shards}",
        f"data.eval={synthetic_shards}",
        "train.steps=4",
        "train.log_every=2",
        "eval_every=2",
        "data.max_eval=32",
    ]
    pipeline("finetune")([*ft, f"init.checkpoint={ckpt}", f"output_dir={root / 'ft-pre'}"])
    pipeline("finetune")([*ft, f"output_dir={root / 'ft-scratch'}"])
    return root


@pytest.mark.system
def test_report_is_self_contained_with_all_sections(runs, tmp_path):
    assert cli_main(["report", str(runs), "--output", str(tmp_path), "--examples", "4"]) == 0
    page = (tmp_path / "report.html").read_text()
    srcs = re.findall(r"src='([^']*)'", page) + re.findall(r'src="([^"]*)"', page)
    # pretrain curves, few-shot over steps, few-shot vs shots, few-shot vs layer, fine-tune
    # curves, the two fine-tunes' confusion matrices, position similarity, filter components,
    # examples
    assert len(srcs) == 10 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "href='http" not in page and "<link" not in page and "<script" not in page
    for title in SECTIONS:
        assert f">{title}</h2>" in page
    assert "skipped" not in page  # every figure was drawn
    md = (tmp_path / "report.md").read_text()
    pngs = re.findall(r"!\[[^]]*\]\((figures/[^)]+\.png)\)", md)
    assert len(pngs) == 10 and "figures/fewshot_vs_layer.png" in pngs
    assert {"figures/confusion_ft-pre.png", "figures/confusion_ft-scratch.png"} <= set(pngs)
    for p in pngs:
        assert (tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The summary table: one row for the pretraining run, one for random init / scratch.
    table = md.split("## Summary")[1].split("##")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| pre", "| random init / scratch"]
    assert "mean_color" in rows[0] and "50%" in rows[0]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_knn_monitor_and_layer_table_in_the_runs(runs):
    """The k-NN monitor logs next to the few-shot rows; the per-layer figure needs the table."""
    from ssl_vit.report import figures

    by_name = {r.name: r for r in load_runs([runs])}
    knn_steps = [r["step"] for r in by_name["pre"].rows if "knn/top1" in r]
    few_steps = [r["step"] for r in by_name["pre"].rows if "fewshot/1shot" in r]
    assert knn_steps == few_steps == [5, 10]
    assert by_name["pre"].results["fewshot"]["knn"]["k"] == 5
    table = by_name["few-pre"].results["layers"]
    assert table["depth"] == 2 and "last2/cls+gap" in table["readouts"]
    assert figures.fewshot_vs_layer([("pre", table)]) is not None
    assert figures.fewshot_vs_layer([("rand", by_name["few-rand"].results["layers"])]) is not None
    assert figures.fewshot_vs_layer([("no table", {}), ("none", None)]) is None


@pytest.mark.system
def test_report_of_incomplete_runs_says_what_is_missing(runs, tmp_path):
    """No data for the examples, a run without checkpoints, no fine-tuning: notes, no crash."""
    pre = tmp_path / "pre"
    shutil.copytree(runs / "pre", pre)
    cfg = (pre / "config.yaml").read_text()
    (pre / "config.yaml").write_text(re.sub(r"train_shards: .*", "train_shards: nowhere", cfg))
    bare = tmp_path / "bare"
    shutil.copytree(runs / "pre", bare, ignore=shutil.ignore_patterns("checkpoints"))
    assert (
        cli_main(
            [
                "report",
                str(pre),
                str(bare),
                str(runs / "few-rand"),
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    md = (tmp_path / "out" / "report.md").read_text()
    assert "pre: example strip skipped: the run's data (nowhere) is not present here" in md
    assert "bare: no checkpoint, nothing to show." in md
    assert "No fine-tuning runs given." in md
    assert cli_main(["report", str(tmp_path / "missing")]) == 1


def test_runs_are_linked_to_their_pretraining(runs):
    loaded = load_runs([runs])
    assert {r.name: r.job.name for r in loaded} == {
        "pre": "pretrain",
        "few-pre": "fewshot",
        "few-rand": "fewshot",
        "ft-pre": "finetune",
        "ft-scratch": "finetune",
    }
    groups = {k: sorted((r.name, s) for r, s in v) for k, v in link_runs(loaded).items()}
    assert groups == {
        "pre": [("few-pre", 10), ("ft-pre", 10)],
        None: [("few-rand", None), ("ft-scratch", None)],
    }


def test_position_similarity_tiles():
    g = torch.Generator().manual_seed(0)
    pe = torch.randn(1, 1 + 12, 16, generator=g)
    sim = position_similarity(pe, (3, 4))
    assert sim.shape == (3, 4, 3, 4)
    for i in range(3):
        for j in range(4):
            assert sim[i, j, i, j] == pytest.approx(1.0, abs=1e-6)  # itself, on its own tile
    a, b = pe[0, 1 + 5], pe[0, 1 + 2]  # (1, 1) vs (0, 2); the class token row is left out
    assert sim[1, 1, 0, 2] == pytest.approx((a @ b / (a.norm() * b.norm())).item(), abs=1e-6)
    assert torch.allclose(sim.reshape(12, 12), sim.reshape(12, 12).T)


def test_filter_components_orthonormal_by_variance():
    g = torch.Generator().manual_seed(0)
    # Filters varying mostly along one known direction: it must be the first component.
    direction = torch.randn(3 * 4 * 4, generator=g)
    direction /= direction.norm()
    w = torch.randn(64, 1, generator=g) * 10 * direction + 0.1 * torch.randn(64, 48, generator=g)
    comp, explained = filter_components(w.reshape(64, 3, 4, 4), k=28)
    flat = comp.reshape(28, -1).double()
    assert torch.allclose(flat @ flat.T, torch.eye(28, dtype=torch.float64), atol=1e-5)
    assert abs(flat[0] @ direction.double()) > 0.99
    assert (explained[:-1] >= explained[1:]).all() and explained[0] > 0.9


def test_mean_color_pixels_and_paste():
    targets = torch.tensor([0, 511, 64 * 7])  # black, white bins, red bin
    logits = torch.zeros(3, 512)
    logits[:, 9] = 1.0  # predicted class 9 = (0, 1, 1)
    tgt, pred = target_pixels("mean_color", targets, logits, patch_size=2)
    assert tgt.shape == (3, 3, 2, 2)
    assert torch.allclose(tgt[1], torch.full((3, 2, 2), 15 / 16))
    assert torch.allclose(tgt[2, :, 0, 0], torch.tensor([15 / 16, 1 / 16, 1 / 16]))
    assert torch.allclose(pred[0, :, 1, 1], torch.tensor([1 / 16, 3 / 16, 3 / 16]))
    with pytest.raises(ValueError, match="no example rendering"):
        target_pixels("unknown", targets, logits, 2)
    # Pasting into a 4x4 image with 2x2 patches: patches 1 and 2 (row-major) replaced.
    img = torch.zeros(1, 3, 4, 4)
    kind = torch.tensor([[UNTOUCHED, MASKED, KEPT, UNTOUCHED]])
    out = _paste(img, kind != 0, tgt[1:])
    assert torch.allclose(out[0, :, :2, 2:], tgt[1]) and torch.allclose(out[0, :, 2:, :2], tgt[2])
    assert out[0, :, :2, :2].abs().sum() == 0 and out[0, :, 2:, 2:].abs().sum() == 0


def test_color_4x4_pixels_follow_the_cell_bounds():
    # P = 6: cells span pixels [0,1), [1,3), [3,4), [4,6) along each side.
    targets = torch.arange(16).unsqueeze(0) * 7  # one patch, cell c has class 7c = (0, 0, 7)..
    logits = torch.zeros(1, 16, 512)
    logits[0, :, 511] = 1.0  # every cell predicted white
    tgt, pred = target_pixels("color_4x4", targets, logits, patch_size=6)
    assert tgt.shape == pred.shape == (1, 3, 6, 6)
    rgb = color_class_to_rgb(targets[0])  # [16, 3]
    rows_of_cell = [[0], [1, 2], [3], [4, 5]]
    for ci, rows in enumerate(rows_of_cell):
        for cj, cols in enumerate(rows_of_cell):
            for r in rows:
                for c in cols:
                    assert torch.equal(tgt[0, :, r, c], rgb[4 * ci + cj])
    assert torch.allclose(pred, torch.full_like(pred, 15 / 16))


def test_pixels_l2_pixels_unpatchify_and_clip():
    images = torch.rand(1, 3, 4, 4)
    targets = patch_pixels(images, 2)[0]  # [4 patches, 12]
    preds = targets * 3 - 1  # out of range: clipped for display
    tgt, pred = target_pixels("pixels_l2", targets, preds, patch_size=2)
    assert torch.allclose(tgt[1], images[0, :, :2, 2:])  # patch 1: rows 0-1, columns 2-3
    assert torch.allclose(tgt[2], images[0, :, 2:, :2])
    assert pred.min() >= 0 and pred.max() <= 1
    assert torch.allclose(pred[3], (images[0, :, 2:, 2:] * 3 - 1).clamp(0, 1))


# --- Accuracy vs labels per class (label budgets, issue 27), from faked run directories ---

CKPT = "runs/s/pretrain/paper_mpp/checkpoints/step_00001200"
# {(encoder init, K): top1 of seeds 0 and 1}; K = 0 (every label) used 6000 images of 10 classes
BUDGET_TOP1 = {
    (CKPT, 10): (0.40, 0.50),
    (CKPT, 0): (0.90, 0.80),
    ("none", 10): (0.20, 0.30),
    ("none", 0): (0.70, 0.72),
}


def _fake_run(path: Path, config: dict, results: dict | None, rows: tuple = ()) -> None:
    import json

    import yaml

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if results is not None:
        (path / "results.json").write_text(json.dumps(results))


def _fake_finetune(root: Path, name: str, init: str, k: int | None, seed: int, top1: float):
    """A finished fine-tune as pipelines/finetune.py writes it; k None: from before label
    budgets (no labels_per_class / num_labelled / num_classes in its results)."""
    results = {"top1": top1, "init": "random" if init == "none" else init, "image_size": 32}
    if k is not None:
        results |= {"labels_per_class": k, "num_labelled": 10 * k or 6000, "num_classes": 10}
        results["seed"] = seed
    config = {"init": {"checkpoint": init}, "data": {"labels_per_class": k or 0}, "seed": seed}
    rows = ({"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "top1": top1})
    _fake_run(root / name, config, results, rows)


def _budget_runs(root: Path, budgets: tuple[int, ...] = (10, 0)) -> Path:
    """2 encoders x `budgets` x 2 seeds of fine-tunes, an older fine-tune (no budget keys),
    an unfinished one and a few-shot run of the pretrained encoder."""
    for (init, k), top1s in BUDGET_TOP1.items():
        if k in budgets:
            enc = "scratch" if init == "none" else "mpp"
            for seed, top1 in enumerate(top1s):
                _fake_finetune(root, f"ft-{enc}-l{k}-s{seed}", init, k, seed, top1)
    _fake_finetune(root, "ft-old", CKPT, None, 0, 0.99)
    _fake_run(root / "ft-running", {"init": {"checkpoint": CKPT}}, None)
    entry = {"l2_reg": {"1024.0": {"mean": 0.3, "std": 0.0, "per_seed": [0.3]}}}
    _fake_run(
        root / "few-mpp",
        {"fewshot": {"shots": [1, 10, "all"], "pool": "cls"}},
        {"checkpoint": CKPT, "shots": {"1": entry, "10": entry, "all": entry}},
    )
    return root


def test_labels_curves_group_seeds_by_encoder_and_budget(tmp_path):
    from ssl_vit.report.budget import all_labels_per_class, encoder_name, labels_curves

    runs = load_runs([_budget_runs(tmp_path)])
    curves = labels_curves(runs)
    # The pretraining run directory names the encoder; the old run (K = 0, size unknown),
    # the unfinished one and the few-shot run are not points.
    assert {e: {k: sorted(v) for k, v in c.items()} for e, c in curves.items()} == {
        "paper_mpp": {10: [0.40, 0.50], 0: [0.80, 0.90]},
        "scratch": {10: [0.20, 0.30], 0: [0.70, 0.72]},
    }
    assert all(list(c) == [10, 0] for c in curves.values())  # K ascending, every label last
    assert all_labels_per_class(runs) == 600.0  # 6000 images / 10 classes
    assert {encoder_name(r) for r in runs if r.name == "few-mpp"} == {"paper_mpp"}


def test_fine_tunes_of_other_settings_are_not_averaged_as_seeds(tmp_path):
    """Runs of one encoder and budget that differ in a setting (here train.steps) are groups of
    their own, named by it; seeds differing in what seeds and runs differ in (seed,
    output_dir, workers, compile mode, a key only one has) stay one group."""
    from ssl_vit.report.budget import finetune_groups

    base = {"init": {"checkpoint": CKPT}, "data": {"labels_per_class": 10}, "train": {"lr": 0.1}}
    settings = {
        "a0": ({"seed": 0, "output_dir": "a0", "train": {"steps": 60}}, 0.40),
        "a1": ({"seed": 1, "output_dir": "a1", "train": {"steps": 60}, "data": {"num_workers": 4,
                "labels_per_class": 10}, "compile": {"mode": "x"}, "only_here": 1},
               0.50),
        "b0": ({"seed": 0, "output_dir": "b0", "train": {"steps": 150}}, 0.60),
    }  # fmt: skip
    for name, (over, top1) in settings.items():
        config = base | over | {"train": base["train"] | over["train"]}
        config["data"] = base["data"] | over.get("data", {})
        results = {"top1": top1, "labels_per_class": 10, "num_labelled": 100, "num_classes": 10}
        _fake_run(tmp_path / name, config, results, ({"step": 1, "loss": 2.0},))
    groups = finetune_groups(load_runs([tmp_path]))
    assert {g: sorted(r.name for r in rs) for g, rs in groups.items()} == {
        ("paper_mpp (train.steps=150)", 10): ["b0"],
        ("paper_mpp (train.steps=60)", 10): ["a0", "a1"],
    }


def test_budget_table_cells_are_mean_std_and_seeds(tmp_path):
    from ssl_vit.report.budget import all_labels_per_class, budget_table, labels_curves

    runs = load_runs([_budget_runs(tmp_path)])
    table = budget_table(labels_curves(runs), all_labels_per_class(runs))
    assert table.header == ["encoder", "10 / class", "all (600) / class"]
    # Population std: half the range of two seeds. Scratch last, as in the summary.
    assert table.rows == [
        ["paper_mpp", "45.0 ± 5.0 (2 seeds)", "85.0 ± 5.0 (2 seeds)"],
        ["scratch", "25.0 ± 5.0 (2 seeds)", "71.0 ± 1.0 (2 seeds)"],
    ]
    one = budget_table({"scratch": {10: [0.25]}}, None)  # one seed, no every-label runs
    assert one.header == ["encoder", "10 / class"]
    assert one.rows == [["scratch", "25.0 ± 0.0 (1 seed)"]]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_report_draws_accuracy_vs_labels(tmp_path):
    from ssl_vit.report import build_report

    paths = build_report([_budget_runs(tmp_path / "runs")], tmp_path / "out")
    md, page = paths["md"].read_text(), paths["html"].read_text()
    assert ">Accuracy vs labels per class</h2>" in page
    section = md.split("## Accuracy vs labels per class")[1].split("\n## ")[0]
    assert "| paper_mpp | 45.0 ± 5.0 (2 seeds) | 85.0 ± 5.0 (2 seeds) |" in section
    assert "| scratch | 25.0 ± 5.0 (2 seeds) | 71.0 ± 1.0 (2 seeds) |" in section
    assert "Left out (every label, but results.json does not say how many): ft-old." in section
    assert "figures/accuracy_vs_labels.png" in section
    png = tmp_path / "out" / "figures" / "accuracy_vs_labels.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.system
@pytest.mark.parametrize("budgets", [(0,), ()])
def test_no_label_budget_no_section(tmp_path, budgets):
    """Every fine-tune on every label (or none finished): the report is as before."""
    from ssl_vit.report import build_report
    from ssl_vit.report.finetune_section import budget_section

    root = _budget_runs(tmp_path / "runs", budgets)
    assert budget_section(load_runs([root])) is None
    paths = build_report([root], tmp_path / "out")
    assert "Accuracy vs labels" not in paths["html"].read_text()
    assert not (tmp_path / "out" / "figures" / "accuracy_vs_labels.png").exists()


def test_accuracy_vs_labels_figure_without_every_label_point():
    from ssl_vit.report import finetune_figures as figures

    fig = figures.accuracy_vs_labels({"a": {1: [0.1, 0.2], 10: [0.5]}}, None, [("a", {5: 0.3})])
    assert fig is not None
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "5", "10"]
    assert figures.accuracy_vs_labels({}, None) is None


def test_several_recipes_are_lines_of_their_own(tmp_path):
    """Fine-tunes of one encoder with two recipes (results.json `recipe`) are two lines."""
    import json

    import yaml

    from ssl_vit.report.budget import labels_curves

    root = _budget_runs(tmp_path, budgets=(10,))
    for name in [p.name for p in root.iterdir() if p.name.startswith("ft-") and "-l10-" in p.name]:
        results = json.loads((root / name / "results.json").read_text())
        modern = {**results, "recipe": "modern", "top1": results["top1"] / 2}
        config = yaml.safe_load((root / name / "config.yaml").read_text())
        _fake_run(root / f"{name}-modern", config, modern)
        (root / name / "results.json").write_text(json.dumps({**results, "recipe": "paper"}))
    curves = labels_curves(load_runs([root]))
    assert {e: {k: sorted(v) for k, v in c.items()} for e, c in curves.items()} == {
        "paper_mpp (paper)": {10: [0.40, 0.50]},
        "paper_mpp (modern)": {10: [0.20, 0.25]},
        "scratch (paper)": {10: [0.20, 0.30]},
        "scratch (modern)": {10: [0.10, 0.15]},
    }


def test_a_control_is_a_line_of_its_own(tmp_path):
    """The study's equal-compute controls (`tag: control`: the same encoder and budget, the
    self-training's schedule, no teacher) are a line of their own, as the self-trained runs
    are: never averaged with the encoder's plain fine-tunes of that budget."""
    from ssl_vit.report.budget import labels_curves

    root = _budget_runs(tmp_path, budgets=(10,))
    for seed, top1 in enumerate((0.45, 0.55)):
        _fake_finetune(root, f"ft-mpp-l10-ctl-s{seed}", CKPT, 10, seed, top1)
        config = root / f"ft-mpp-l10-ctl-s{seed}" / "config.yaml"
        config.write_text(config.read_text() + "tag: control\n")
        _fake_finetune(root, f"ft-mpp-l10-st-s{seed}", CKPT, 10, seed, top1 + 0.1)
        config = root / f"ft-mpp-l10-st-s{seed}" / "config.yaml"
        config.write_text(config.read_text() + "distill: {teacher: t}\n")
    curves = labels_curves(load_runs([root]))
    assert {e: sorted(c[10]) for e, c in curves.items()} == {
        "paper_mpp": [0.40, 0.50],
        "paper_mpp [control]": [0.45, 0.55],
        "paper_mpp + self-trained": [0.55, 0.65],
        "scratch": [0.20, 0.30],
    }


def test_labels_picked_without_labels_are_a_line_of_their_own(tmp_path):
    """A fine-tune on N images picked by data.labels_select (K = 0 in its results) is never
    averaged with the encoder's fine-tunes on every label, nor moves where those sit."""
    from ssl_vit.report.budget import all_labels_per_class, labels_curves

    root = _budget_runs(tmp_path)
    runs_before = load_runs([root])
    picked = {"labels_per_class": 0, "labels_select": "typiclust", "labels_budget": 100}
    for seed, top1 in enumerate((0.3, 0.35)):
        results = {"top1": top1, "init": CKPT, "num_labelled": 100, "num_classes": 10, **picked}
        config = {"init": {"checkpoint": CKPT}, "data": picked, "seed": seed}
        _fake_run(root / f"ft-mpp-l100-typiclust-s{seed}", config, results, ({"step": 1},))
    runs = load_runs([root])
    curves = labels_curves(runs)
    assert sorted(curves.pop("paper_mpp [100 labels by typiclust]")[0]) == [0.3, 0.35]
    assert curves == labels_curves(runs_before)
    assert all_labels_per_class(runs) == all_labels_per_class(runs_before) == 600


@pytest.mark.system
def test_report_that_fails_writing_keeps_the_earlier_one(tmp_path):
    """Issue 29 #13: a write that fails (a file-size limit: EFBIG) leaves the earlier report as
    it was, with one error line naming the file."""
    import resource
    import subprocess
    import sys

    runs, out = _budget_runs(tmp_path / "runs"), tmp_path / "out"
    assert cli_main(["report", str(runs), "--output", str(out)]) == 0  # the earlier report
    cmd = [sys.executable, "-m", "ssl_vit.cli", "report", str(runs), "--output", str(out)]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    limit = len(before[out / "report.html"]) // 2

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=small_disk)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ssl-vit report: error:"), last
    assert f"cannot write {out / 'report.html'}: File too large" in last, last
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # no leftovers


def test_a_walk_never_follows_folder_symlinks(tmp_path, caplog):
    """Issue 38 #4: two symlink loops (`a/up -> ..`, `self -> ../r`) and a link to a run outside
    the folder: each run inside is listed once, no link is followed (each one logged), and a
    run named twice (itself and inside a folder named) is listed once."""
    root, outside = tmp_path / "r", tmp_path / "elsewhere"
    _fake_finetune(root / "a", "ft-1", "none", 10, 0, 0.5)
    _fake_finetune(root, "ft-2", "none", 10, 1, 0.6)
    _fake_finetune(outside, "ft-3", "none", 10, 2, 0.7)
    (root / "a" / "up").symlink_to("..")
    (root / "self").symlink_to("../r")
    (root / "out").symlink_to(outside / "ft-3")
    with caplog.at_level("WARNING", logger="ssl_vit.report.runs"):
        runs = load_runs([root])
    assert [r.path for r in runs] == [root / "a" / "ft-1", root / "ft-2"]
    links = {root / "a" / "up", root / "self", root / "out"}
    assert {Path(m.split(":")[0]) for m in caplog.messages} == links
    assert all("not followed" in m for m in caplog.messages)
    again = load_runs([root / "ft-2", root, root / "a", root / "out"])  # named: taken
    assert [r.path for r in again] == [root / "ft-2", root / "a" / "ft-1", root / "out"]


# --- Issue 47 #12: a damaged run is named (one logged line: file, what is wrong) and left out --

ENTRY = {"l2_reg": {"1024.0": {"mean": 0.3, "std": 0.0, "per_seed": [0.3]}}}
PRED_NAMES = ["cat", "dog", "fox"]


def _fake_predict(path: Path) -> None:
    """A labelled predict output directory as `ssl-vit predict` writes it: results.json (no
    config.yaml) and one predictions.jsonl row per image."""
    import json

    from ssl_vit.eval.confusion import confusion_summary

    results = {"job": "predict", "checkpoint": "runs/ft", "source": "data/photos", "images": 12}
    results |= {"skipped": 0, "label_names": PRED_NAMES}
    results |= confusion_summary(torch.tensor([[3, 1, 0], [0, 2, 0], [2, 2, 2]]), PRED_NAMES)
    _fake_run(path, {}, None)
    (path / "config.yaml").unlink()
    (path / "results.json").write_text(json.dumps(results))
    row = {"key": "a.png", "label": "cat", "score": 0.9, "top_k": [["cat", 0.9]]}
    (path / "predictions.jsonl").write_text((json.dumps(row) + "\n") * 12)


def _kinds_of_runs(root: Path) -> Path:
    """A finished run of each kind: pretrain (few-shot logged), few-shot, fine-tune, predict."""
    pre = root / "pre"
    _fake_run(
        pre,
        {"objective": {"target": "mean_color", "mask_ratio": 0.5}, "output_dir": str(pre)},
        {"step": 2, "loss": 1.0, "wall_time_s": 60.0, "fewshot": {"shots": {"1": ENTRY}}},
        ({"step": 1, "loss": 2.0, "color_acc": 0.1}, {"step": 2, "loss": 1.0, "color_acc": 0.2}),
    )
    ckpt = str(pre / "checkpoints" / "step_00000002")
    _fake_run(
        root / "few", {"fewshot": {"shots": [1]}}, {"checkpoint": ckpt, "shots": {"1": ENTRY}}
    )
    _fake_finetune(root, "ft", ckpt, 10, 0, 0.5)
    _fake_predict(root / "pred")
    return root


def _edit_json(fn):
    """A damage: results.json parsed, changed by `fn`, written back as Python's json writes
    (a NaN as a bare NaN, what the writers wrote before issue 47)."""
    import json

    return lambda text: json.dumps(fn(json.loads(text)))


def _set(key: str, value):
    return _edit_json(lambda r: {**r, key: value})


def _cell(i: int, j: int, value):
    def edit(r: dict) -> dict:
        r["confusion_matrix"][i][j] = value
        return r

    return _edit_json(edit)


def _pretrain_mean(value):
    def edit(r: dict) -> dict:
        r["fewshot"]["shots"]["1"]["l2_reg"]["1024.0"]["mean"] = value
        return r

    return _edit_json(edit)


# {case: (run, file, damage (its text -> the damaged text), what the logged line says)}
DAMAGES = {
    "predict-array": ("pred", "results.json", lambda t: f"[{t}]", "a JSON array, not an object"),
    "predict-torn": ("pred", "results.json", lambda t: t[: len(t) // 2], "unreadable ("),
    "predict-string-count": ("pred", "results.json", _cell(0, 0, "3"), "[0][0] is '3', not a"),
    "predict-nan-count": ("pred", "results.json", _cell(2, 2, math.nan), "[2][2] is nan, not a"),
    "predict-negative-count": ("pred", "results.json", _cell(0, 1, -1), "[0][1] is -1, not a"),
    "predict-string-images": ("pred", "results.json", _set("images", "12"), "images is '12', not"),
    "predict-wrong-shape": (
        "pred", "results.json", _set("confusion_matrix", [[1, 2], [3, 4]]),
        "confusion_matrix has 2 rows for 3 label_names",
    ),
    "predict-ragged-matrix": (
        "pred", "results.json", _set("confusion_matrix", [[1, 2, 3], [4, 5], [6, 7, 8]]),
        "confusion_matrix row 1 has 2 columns, not 3",
    ),
    "predict-truncated-predictions": (
        "pred", "predictions.jsonl", lambda t: t[:-7], "its last line is cut short"
    ),
    "predict-predictions-short-of-rows": (
        "pred", "predictions.jsonl", lambda t: t.split("\n", 1)[1], "11 row(s) for the 12 images"
    ),
    "finetune-array": ("ft", "results.json", lambda t: "[]", "a JSON array, not an object"),
    "finetune-nan-top1": ("ft", "results.json", _set("top1", math.nan), "top1 is nan, not a"),
    "finetune-string-top1": ("ft", "results.json", _set("top1", "0.5"), "top1 is '0.5', not a"),
    "finetune-negative-budget": (
        "ft", "results.json", _set("labels_per_class", -10), "labels_per_class is -10, not a count"
    ),
    "finetune-metrics-array-row": (
        "ft", "metrics.jsonl", lambda t: t + "[1, 2]\n" + t, "row 3 is a JSON array, not an object"
    ),
    "finetune-metrics-string-loss": (
        "ft", "metrics.jsonl", lambda t: t.replace("2.0", '"2.0"'), "row 1: loss is '2.0', not a"
    ),
    "finetune-metrics-corrupt-line": (
        "ft", "metrics.jsonl", lambda t: "{oops\n" + t, "metrics.jsonl:1: corrupt line"
    ),
    "pretrain-nan-step": ("pre", "results.json", _set("step", math.nan), "step is nan, not a"),
    "pretrain-string-fewshot-mean": (
        "pre", "results.json", _pretrain_mean("0.3"), "fewshot.shots[1].l2_reg[1024.0].mean is"
    ),
    "pretrain-metrics-string-acc": (
        "pre", "metrics.jsonl", lambda t: t.replace("0.1", '"x"'), "row 1: color_acc is 'x'"
    ),
    "pretrain-config-list": ("pre", "config.yaml", lambda t: "- 1\n- 2\n", "a YAML list, not a"),
    "fewshot-shots-array": ("few", "results.json", _set("shots", [1]), "shots is a JSON array"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_run_is_named_and_left_out(tmp_path, caplog, case):
    """Issue 47 #12: each damaged file (a results.json that is a JSON array, a count that is a
    string, NaN or negative, a matrix of the wrong shape, a torn predictions.jsonl or
    metrics.jsonl, ...) of each kind of run: the run is left out with one logged line naming
    the file and what is wrong; the other runs are read."""
    run, file, damage, says = DAMAGES[case]
    root = _kinds_of_runs(tmp_path / "runs")
    path = root / run / file
    path.write_text(damage(path.read_text()))
    with caplog.at_level("WARNING", logger="ssl_vit.report.runs"):
        runs = load_runs([root])
    assert [r.name for r in runs] == [n for n in ("few", "ft", "pre", "pred") if n != run]
    (line,) = [m for m in caplog.messages if "left out" in m]
    assert line.startswith(f"{path}") and says in line and line.endswith("(left out of the report)")
    assert "\n" not in line


@pytest.mark.system
def test_report_leaves_out_damaged_runs_and_writes_the_rest(tmp_path, capsys, caplog):
    """Issue 47 #12: a report of runs of each kind and damaged ones of each kind (a predict
    results.json that is a JSON array, NaN and string counts, a fine-tune's string top-1, a
    pretraining's corrupt metrics.jsonl) is written without them, one logged line each; a
    report of damaged runs only is one error line."""
    root = _kinds_of_runs(tmp_path / "runs")
    damaged = _kinds_of_runs(tmp_path / "runs" / "damaged")
    for case in ("predict-array", "finetune-string-top1", "pretrain-metrics-string-acc"):
        run, file, damage, _ = DAMAGES[case]
        (damaged / run / file).write_text(damage((damaged / run / file).read_text()))
    for name, damage in (("pred-nan", _cell(2, 2, math.nan)), ("pred-str", _cell(0, 0, "3"))):
        _fake_predict(damaged / name)
        (damaged / name / "results.json").write_text(
            damage((root / "pred" / "results.json").read_text())
        )
    shutil.rmtree(damaged / "few")
    with caplog.at_level("WARNING", logger="ssl_vit.report.runs"):
        assert cli_main(["report", str(root), "--output", str(tmp_path / "out")]) == 0
    left_out = sorted(m.split(":")[0] for m in caplog.messages if "left out" in m)
    assert left_out == [
        str(damaged / p) for p in ("ft/results.json", "pre/metrics.jsonl", "pred-nan/results.json",
                                   "pred-str/results.json", "pred/results.json")
    ]  # fmt: skip
    md = (tmp_path / "out" / "report.md").read_text()
    runs_table = md.split("## Runs")[1]
    assert [row.split(" | ")[6] for row in runs_table.splitlines()[4:]] == [
        f"{root / n} |" for n in ("few", "ft", "pre", "pred")
    ]
    assert "confusion_pred.png" in md and "## Per-class accuracy" in md
    capsys.readouterr()
    assert cli_main(["report", str(damaged / "pred"), "--output", str(tmp_path / "o2")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ssl-vit report: error: no run to report: the runs found are 1 damaged (logged above)"
    ]
    # A selection (ssl-vit select: picks, no figures) in a folder of runs: left out, named.
    from test_run_ownership import _selection_folder

    _selection_folder(root / "picks")
    caplog.clear()
    with caplog.at_level("INFO", logger="ssl_vit.report.runs"):
        assert cli_main(["report", str(root), "--output", str(tmp_path / "o3")]) == 0
    assert (
        f"{root / 'picks'}: a select run (picks, no trained model's figures): left out of "
        "the report" in caplog.messages
    )
    assert (tmp_path / "o3" / "report.md").read_text().split("## Runs")[1] == runs_table
    capsys.readouterr()
    assert cli_main(["report", str(root / "picks"), "--output", str(tmp_path / "o4")]) == 1
    assert capsys.readouterr().err.strip() == (
        "ssl-vit report: error: no run to report: the runs found are 1 selection(s) (logged above)"
    )
