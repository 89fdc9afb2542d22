"""Schedules at known steps; checkpoints: round trip, atomicity, corruption detection."""

import math

import pytest
import torch

from ssl_vit.model import ViT
from ssl_vit.train.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    latest_valid_checkpoint,
    load_checkpoint,
    load_encoder,
    resolve_checkpoint,
    save_checkpoint,
)
from ssl_vit.train.metrics import format_metrics
from ssl_vit.train.rng import rng_state, set_rng_state
from ssl_vit.train.schedules import warmup_cosine


def test_warmup_cosine_values():
    lr = [warmup_cosine(s, 110, 10, 1.0, 0.0) for s in range(111)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[10] == pytest.approx(1.0)
    assert lr[60] == pytest.approx(0.5)  # half-way through the decay
    assert lr[35] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr[110] == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(110, 110, 10, 1.0, 0.1) == pytest.approx(0.1)


def _save(root, step, vit, **kw):
    return save_checkpoint(
        root,
        step,
        encoder=vit,
        # The shape of ViT(8, 4, 16, 1, 2): loading checks the metadata against the tensors.
        model_config={"image_size": 8, "patch_size": 4, "width": 16, "depth": 1, "heads": 2},
        state={"model": vit.state_dict(), "x": step},
        rng=rng_state(),
        **kw,
    )


def test_a_log_line_leaves_out_what_a_row_lacks_or_holds_as_none():
    """A fine-tune without data.eval ended with 'done: top1 None | wall_time_s 0.56'."""
    row = {"step": 3, "loss": 1.234567, "top1": None, "lr": 0.1}
    assert format_metrics(row, ("step", "loss", "top1", "top1_ema", "lr")) == (
        "step 3 | loss 1.235 | lr 0.1"
    )


def test_checkpoint_round_trip_and_keep_last(tmp_path):
    vit = ViT(8, 4, 16, 1, 2)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, vit, keep=2)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_00000003", "step_00000004"]
    assert not list(tmp_path.glob(".tmp*"))
    state = load_checkpoint(tmp_path / "step_00000004")
    assert state["step"] == 4 and state["x"] == 4
    weights, cfg = load_encoder(tmp_path / "step_00000004")
    assert (cfg["width"], cfg["depth"], cfg["patch_size"]) == (16, 1, 4)
    for k, v in vit.state_dict().items():
        assert torch.equal(weights[k], v)


def test_rng_state_round_trip():
    g = torch.Generator().manual_seed(3)
    state = rng_state(g)
    a = (torch.rand(3), torch.rand(3, generator=g))
    set_rng_state(state, g)
    b = (torch.rand(3), torch.rand(3, generator=g))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_corrupted_checkpoint_is_detected_and_skipped(tmp_path):
    vit = ViT(8, 4, 16, 1, 2)
    _save(tmp_path, 1, vit)
    bad = _save(tmp_path, 2, vit)
    with open(bad / "state.pt", "r+b") as f:  # truncate
        f.truncate(10)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(bad)
    assert latest_valid_checkpoint(tmp_path).name == "step_00000001"
    (tmp_path / "step_00000001" / "manifest.json").unlink()  # incomplete
    assert latest_valid_checkpoint(tmp_path) is None


def test_resolve_checkpoint_takes_the_newest_valid_one_of_a_run(tmp_path, caplog):
    vit, ckpts = ViT(8, 4, 16, 1, 2), tmp_path / "run" / "checkpoints"
    first, second = _save(ckpts, 1, vit), _save(ckpts, 2, vit)
    (second / "manifest.json").unlink()  # the newest is incomplete: the one before is used
    with caplog.at_level("INFO", logger="ssl_vit.train.checkpoint"):
        assert resolve_checkpoint(tmp_path / "run") == first
    assert f"using checkpoint {first}" in caplog.text
    assert resolve_checkpoint(ckpts) == first
    assert resolve_checkpoint(second) == second  # a checkpoint itself: as given
    assert resolve_checkpoint(first / "encoder.safetensors") == first / "encoder.safetensors"
    (first / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        resolve_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "hf").mkdir()  # not a run (e.g. transformers weights): left to the loader
    assert resolve_checkpoint(tmp_path / "hf") == tmp_path / "hf"


def test_load_encoder_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no encoder weights"):
        load_encoder(tmp_path)
    (tmp_path / "encoder.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="encoder.safetensors: not a readable safetensors"):
        load_encoder(tmp_path)


def test_stopwatch_leaves_pauses_out_of_the_lap(monkeypatch):
    from ssl_vit.train import metrics

    clock = iter([0.0, 1.0, 4.0, 10.0])  # start, pause begins, pause ends, lap
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    watch = metrics.Stopwatch()
    watch.add("data", 0.5)
    with watch.paused():
        pass
    elapsed, totals = watch.lap()
    assert elapsed == 7.0 and totals == {"data": 0.5}


def test_batches_start_the_loader_workers_only_inside_the_with_block():
    """The pipelines enter the stop handler before `Batches`: workers must not start earlier,
    or a stop signal during their start-up would kill the job and orphan them."""
    from ssl_vit.train.loop import Batches, new_counters
    from ssl_vit.train.metrics import Stopwatch

    started = []

    class Loader:
        num_workers = 0
        tracker = None

        def __iter__(self):
            started.append(True)
            return iter([])

    batches = Batches(Loader(), new_counters(), 1, Stopwatch())
    assert not started
    with batches:
        assert started == [True]


def test_resume_reads_each_checkpoint_file_once(tmp_path, monkeypatch):
    """--resume checks the newest checkpoint's SHA-256s (to fall back past a corrupt one) and
    loads it without checking them a second time; the weights and RNG state come back."""
    from accelerate import Accelerator

    from ssl_vit.train import checkpoint
    from ssl_vit.train.loop import read_resume_point
    from ssl_vit.train.runtime import RunContext

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = RunContext(Accelerator(cpu=True), None, tmp_path, tmp_path / "checkpoints")
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    checkpoint.save_checkpoint(
        run.ckpt_dir,
        7,
        encoder=ViT(16, 4, 32, 1, 2),
        model_config={},
        state=state,
        rng={**rng_state(), "stream": {"at": 1}},
    )
    hashed = []
    sha256 = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: hashed.append(p.name) or sha256(p))
    fresh = torch.nn.Linear(3, 2)
    start = read_resume_point(run, True)
    start.restore(run, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    assert sorted(hashed) == sorted(set(hashed)) and "state.pt" in hashed
    assert start.step == 7 and start.rng["stream"] == {"at": 1}
    assert torch.equal(fresh.weight, model.weight)
