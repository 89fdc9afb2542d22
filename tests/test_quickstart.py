"""The quick start's flow (scripts/quickstart.sh -> configs/study/quickstart.yaml) at a tiny
budget: pretraining, few-shot of the pretrained and of a random encoder, fine-tuning at a higher
resolution from both, the table and the report's path."""

import json
from pathlib import Path

import pytest
import yaml
from test_study import in_process, load_study

from ssl_vit.config import StudyConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/study/quickstart.yaml"


def test_quickstart_script_runs_the_study_on_both_synthetic_splits():
    script = (ROOT / "scripts/quickstart.sh").read_text()
    assert "make-synthetic --output data/shapes " in script
    assert "make-synthetic --output data/shapes-test " in script
    assert "scripts/study.py --config configs/study/quickstart.yaml --jobs 2" in script
    cfg = load_config(StudyConfig, CONFIG)
    assert (cfg.data.train, cfg.data.eval) == ("data/shapes", "data/shapes-test")
    assert cfg.full == cfg.quick  # one budget: the same command on a CPU and on a GPU
    # Fine-tuning at the pretraining resolution: 2.2x cheaper than 48 px for the same accuracy,
    # which pays for the label budgets' 12 fine-tunes (docs/results.md).
    assert cfg.quick.finetune_image_size in (0, cfg.quick.model.image_size)
    # Few labels: the use case, 2 budgets of a few labels per class next to every label, with
    # at least 2 fine-tuning seeds each.
    budgets = [b.per_class for b in cfg.labels]
    assert len([k for k in budgets if 0 < k <= 50]) >= 2 and 0 in budgets
    assert len(cfg.finetune_seeds) >= 2


@pytest.mark.system
def test_quickstart_flow_at_a_tiny_budget(synthetic_shards, tmp_path, monkeypatch, capsys):
    study = load_study()
    monkeypatch.setattr(study, "start", in_process)
    reports = []
    monkeypatch.setattr(study, "report", lambda runs, out: reports.append((runs, out)))
    monkeypatch.chdir(ROOT)  # the config's base configs are relative to the checkout
    tiny = {
        "output_dir": str(tmp_path / "qs"),
        "model": {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "heads": 2},
        "finetune_image_size": 24,
        "pretrain": ["train.steps=2", "train.log_every=1", "train.checkpoint_every=0"],
        "fewshot": [
            *("fewshot.shots=[1, 2]", "fewshot.seeds=[0]", "fewshot.pool=gap"),
            "fewshot.num_workers=0",
        ],
        "finetune": ["train.steps=2", "train.batch_size=8", "data.num_workers=0"],
    }
    overrides = [
        f"data.train={synthetic_shards}",
        f"data.eval={synthetic_shards}",
        f"quick={yaml.safe_dump(tiny, default_flow_style=True, width=10_000).strip()}",
        # The fixture has ~10 images per class; at 2 per class also self-training and the
        # online stage, as the quick start's 10 per class.
        "labels=[{per_class: 2, self_train: [train.steps=2], semi: [train.steps=2]}, "
        "{per_class: 0}]",
    ]
    summary = study.main(["--config", str(CONFIG), "--quick", *overrides])
    rows = {r["variant"]: r for r in summary["rows"]}
    v = "mean_color_50"
    methods = ("control", "self-trained", "semi-supervised")
    assert set(rows) == {"random init", v, *(f"{v} + {m}" for m in methods)}
    for method in methods:  # each method beside its (one) equal-compute control
        by_labels = rows.pop(f"{v} + {method}")["finetune_by_labels"]
        assert [len(c["top1"]) for c in by_labels.values()] == [2, 0]  # 2 seeds at 2 / class
    for seed in (0, 1):
        run = json.loads(
            (tmp_path / f"qs/finetune/mean_color_50-l2-st-s{seed}/results.json").read_text()
        )
        assert run["distill"]["teacher"].endswith(f"mean_color_50-l2-s{seed}/model.safetensors")
        assert run["distill"]["unlabelled_images_seen"] == 2 * 8
        control = json.loads(
            (tmp_path / f"qs/finetune/mean_color_50-l2-ctl-s{seed}/results.json").read_text()
        )  # the same steps and labels, no teacher
        assert control["step"] == run["step"] and not control.get("distill")
        assert control["num_labelled"] == run["num_labelled"]
        semi = json.loads(
            (tmp_path / f"qs/finetune/mean_color_50-l2-semi-s{seed}/results.json").read_text()
        )
        assert semi["distill"]["mode"] == "online" and semi["step"] == control["step"]
        assert semi["distill"]["unlabelled_images_seen"] == 2 * 8
    for r in rows.values():  # both inits: few-shot per shot, fine-tune per budget and seed
        assert set(r["fewshot"]) == {"1", "2"}
        by_labels = r["finetune_by_labels"]
        assert list(by_labels) == ["2/class", "all labels"]
        assert [len(c["top1"]) for c in by_labels.values()] == [2, 2]
        assert by_labels["2/class"]["num_labelled"] == 20
    # One subset for both inits and both seeds: the same chosen keys in every 2-per-class run.
    fine = tmp_path / "qs" / "finetune"
    records = [
        json.loads((fine / f"{enc}-l2-s{seed}" / "labelled.json").read_text())
        for enc in ("scratch", "mean_color_50")
        for seed in (0, 1)
    ]
    assert all(r["keys"] == records[0]["keys"] for r in records)
    out = capsys.readouterr().out
    assert "| random init |" in out and "| mean_color_50 |" in out and "2-shot (%)" in out
    assert "fine-tune 2/class (%)" in out
    ((runs, report_dir),) = reports
    assert report_dir == tmp_path / "qs" and len(runs) == 2 + 1 + 2 * 4 + 2 + 2 + 2  # controls


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: logs which installer installed the package, finds the package,
# prints a torch version. `pip install uv==...` succeeds unless the venv holds a file NO_UV.
case "$*" in
    *"-e .[dev]"*) echo pip >> "$(dirname "$0")/../calls" ;;
    *"pip install"*"uv=="*) [ ! -f "$(dirname "$0")/../NO_UV" ] ;;
    *"import torch"*) echo "torch 0.0" ;;
esac
"""
# Stands in for .venv/bin/uv: logs its install.
FAKE_UV = """#!/usr/bin/env bash
echo uv >> "$(dirname "$0")/../calls"
"""


@pytest.mark.system
def test_setup_installs_only_when_the_pins_change(tmp_path):
    """scripts/setup.sh (the first step of both quick-start commands) installs when the venv has
    no stamp of the current constraints + pyproject.toml, and only then; with uv, or with pip
    where uv cannot be installed."""
    import shutil
    import subprocess

    (tmp_path / "scripts").mkdir()
    for f in ("scripts/setup.sh", "scripts/constraints.txt", "pyproject.toml"):
        shutil.copy(ROOT / f, tmp_path / f)
    bin_dir = tmp_path / ".venv/bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("uv", FAKE_UV)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / ".venv/calls"

    def setup() -> list[str]:
        subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, check=True, timeout=60)
        return calls.read_text().split() if calls.exists() else []

    assert setup() == ["uv"]  # no stamp: install
    assert setup() == ["uv"]  # same pins: nothing to do
    with open(tmp_path / "pyproject.toml", "a") as f:
        f.write("\n# a changed dependency\n")
    assert setup() == ["uv", "uv"]
    assert setup() == ["uv", "uv"]
    (tmp_path / ".venv/.ssl-vit-setup").unlink()
    (tmp_path / ".venv/NO_UV").touch()  # uv cannot be installed: pip does it
    assert setup() == ["uv", "uv", "pip"]
