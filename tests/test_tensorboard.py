"""TensorBoard event files written by MetricsWriter next to metrics.jsonl."""

import json

import pytest

from ssl_vit.train.metrics import MetricsWriter

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    acc = event_accumulator.EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_numeric_values_become_scalars_at_the_rows_step(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.truncate_after(0)
    w.log({"step": 10, "loss": 2.5, "lr": 1e-3, "name": "x", "flag": True, "images": 640})
    w.log({"step": 20, "loss": 1.5, "lr": 5e-4, "fewshot/5shot": 0.25})
    w.write_results({"loss": 1.5})  # closes the writer
    assert scalars(tmp_path, "loss") == [(10, 2.5), (20, 1.5)]
    assert scalars(tmp_path, "images") == [(10, 640.0)]
    assert scalars(tmp_path, "fewshot/5shot") == [(20, 0.25)]
    tags = event_accumulator.EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"]
    assert sorted(tags) == ["fewshot/5shot", "images", "loss", "lr"]  # no strings, no bools
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    for step in (10, 20, 30):
        w.log({"step": step, "loss": float(step)})
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=True)  # resumed from the checkpoint at step 20
    w.truncate_after(20)
    w.log({"step": 30, "loss": 3.0})
    w.close()
    assert scalars(tmp_path, "loss") == [(10, 10.0), (20, 20.0), (30, 3.0)]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [10.0, 20.0, 3.0]


def test_off_by_default_and_nothing_on_other_ranks(tmp_path):
    MetricsWriter(tmp_path).log({"step": 1, "loss": 1.0})
    MetricsWriter(tmp_path, enabled=False, tensorboard=True).log({"step": 2, "loss": 1.0})
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
