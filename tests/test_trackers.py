"""Experiment trackers (Accelerate's tracking API) next to metrics.jsonl: real TensorBoard
event files read back, resume purging, offline defaults, start-up errors."""

import json
from pathlib import Path

import pytest
from conftest import pipeline

from ssl_vit.config import ConfigError, PretrainConfig, from_dict
from ssl_vit.train import metrics
from ssl_vit.train.metrics import MetricsWriter

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
ROOT = Path(__file__).resolve().parents[1]


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    acc = event_accumulator.EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_numeric_values_become_scalars_at_the_rows_step(tmp_path):
    w = MetricsWriter(tmp_path, log_with=["tensorboard"], config={"model": {"width": 8}})
    w.truncate_after(0)
    w.log({"step": 10, "loss": 2.5, "lr": 1e-3, "name": "x", "flag": True, "images": 640})
    w.log({"step": 20, "loss": 1.5, "lr": 5e-4, "fewshot/5shot": 0.25})
    w.write_results({"loss": 1.5})  # closes the trackers
    assert scalars(tmp_path, "loss") == [(10, 2.5), (20, 1.5)]
    assert scalars(tmp_path, "images") == [(10, 640.0)]
    assert scalars(tmp_path, "fewshot/5shot") == [(20, 0.25)]
    tags = event_accumulator.EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"]
    assert sorted(tags) == ["fewshot/5shot", "images", "loss", "lr"]  # no strings, no bools
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # events only, no hparams folders


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path, log_with=["tensorboard"])
    for step in (10, 20, 30):
        w.log({"step": step, "loss": float(step)})
    w.close()
    w = MetricsWriter(tmp_path, log_with=["tensorboard"])  # resumed from the step-20 checkpoint
    w.truncate_after(20)
    w.log({"step": 30, "loss": 3.0})
    w.close()
    assert scalars(tmp_path, "loss") == [(10, 10.0), (20, 20.0), (30, 3.0)]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [10.0, 20.0, 3.0]


def test_off_by_default_and_nothing_on_other_ranks(tmp_path):
    MetricsWriter(tmp_path).log({"step": 1, "loss": 1.0})
    MetricsWriter(tmp_path, enabled=False, log_with=["tensorboard"]).log({"step": 2, "loss": 1.0})
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_pretrain_writes_the_metrics_rows_as_tensorboard_scalars(synthetic_shards, tmp_path):
    pipeline("pretrain")(
        [
            "--config",
            str(ROOT / "configs/pretrain/smoke.yaml"),
            f"data.train_shards={synthetic_shards}",
            f"output_dir={tmp_path}",
            "train.steps=4",
            "train.log_every=2",
            "train.checkpoint_every=0",
            "trackers=[tensorboard]",
        ]
    )
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in scalars(tmp_path, "loss")] == [2, 4]
    for (step, value), row in zip(scalars(tmp_path, "loss"), rows, strict=True):
        assert step == row["step"] and value == pytest.approx(row["loss"], rel=1e-6)
    assert scalars(tmp_path, "images_seen")[-1] == (4, 64.0)


def test_config_keys_and_old_names():
    data = {"train_shards": "x"}
    assert from_dict(PretrainConfig, {"data": data, "trackers": ["tensorboard"]}).trackers == [
        "tensorboard"
    ]
    # A name renamed before the first release is an unknown key: one line naming it.
    with pytest.raises(ConfigError) as e:
        from_dict(PretrainConfig, {"data": data, "train": {"tensorboard": True}})
    assert "train.tensorboard" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="trackers: unknown tracker 'tensorbored'"):
        from_dict(PretrainConfig, {"data": data, "trackers": ["tensorbored"]})


def test_trackers_are_offline_unless_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args, kwargs = metrics._tracker_args("wandb", tmp_path / "run", None)
    assert kwargs == {"name": "run", "dir": str(tmp_path / "run")}
    assert metrics.os.environ["WANDB_MODE"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's choice wins
    metrics._tracker_args("wandb", tmp_path / "run", None)
    assert metrics.os.environ["WANDB_MODE"] == "online"
    args, kwargs = metrics._tracker_args("tensorboard", tmp_path / "run", 21)
    assert args == ["run", str(tmp_path)] and kwargs == {"purge_step": 21}


def test_a_missing_tracker_package_fails_at_start_up(monkeypatch):
    """As where wandb is not installed: the config is refused when loaded (before the run
    directory), naming the package."""
    import accelerate.tracking

    available = [t for t in accelerate.tracking.get_available_trackers() if str(t) != "wandb"]
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: available)
    with pytest.raises(ConfigError, match="tracker 'wandb' needs its package .*pip install wandb"):
        from_dict(PretrainConfig, {"data": {"train_shards": "x"}, "trackers": ["wandb"]})
