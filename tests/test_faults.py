"""Surviving faults: exact resume after SIGKILL, SIGTERM preemption, non-finite steps, and
corrupted checkpoints (one process, CPU, the synthetic fixture)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import pipeline
from test_pipelines import ROOT, finetune_args, pretrain_args, rows

from ssl_vit.objectives import masked_patch
from ssl_vit.train.checkpoint import latest_valid_checkpoint
from ssl_vit.train.loop import TooManyBadStepsError

STEPS = 16
# log every step (per-step losses to compare), 2 DataLoader workers (roles rotate on resume).
RUN = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.checkpoint_every=4",
    "data.num_workers=2",
    "data.shuffle_buffer=16",
]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def reference(synthetic_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    pipeline("pretrain")(pretrain_args(synthetic_shards, out, *RUN))
    return losses(out)


def _start(shards, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "pipelines/pretrain.py"), *pretrain_args(shards, out, *RUN)]
    # The same environment (thread count) as the in-process runs: bit-identical arithmetic.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while not cond():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < end, "timed out"
        time.sleep(0.02)


@pytest.mark.system
def test_resume_after_sigkill_is_exact(synthetic_shards, tmp_path, reference):
    proc = _start(synthetic_shards, tmp_path)
    _wait_for(lambda: (tmp_path / "checkpoints/step_00000004/manifest.json").is_file(), proc)
    proc.kill()  # SIGKILL, somewhere after step 4
    proc.communicate(timeout=60)
    ckpt = latest_valid_checkpoint(tmp_path / "checkpoints")
    resumed_at = int(ckpt.name.split("_")[1])
    assert 4 <= resumed_at < STEPS
    pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path, *RUN, "--resume"))
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))  # each step logged once
    after = [s for s in got if s > resumed_at]
    print("step, uninterrupted loss, resumed loss:")
    for s in after:
        print(s, reference[s], got[s])
    assert [got[s] for s in after] == [reference[s] for s in after]  # exactly equal


@pytest.mark.system
def test_sigterm_checkpoints_and_exits_zero(synthetic_shards, tmp_path, reference):
    proc = _start(synthetic_shards, tmp_path)
    _wait_for(
        lambda: len(losses(tmp_path)) >= 4 if (tmp_path / "metrics.jsonl").is_file() else False,
        proc,
    )
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    stopped = results["step"]
    assert results["preempted"] and 4 <= stopped < STEPS
    assert latest_valid_checkpoint(tmp_path / "checkpoints").name == f"step_{stopped:08d}"
    assert "SIGTERM received" in err.decode()
    # Mid-stream (not at a checkpoint_every step, with 2 workers), the resumed run is exact too.
    pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path, *RUN, "--resume"))
    got = losses(tmp_path)
    assert got == reference, (stopped, got, reference)


def _poison(monkeypatch, calls: set[int]) -> None:
    """Make the loss NaN on the given forward calls (1-based)."""
    forward, count = masked_patch.MaskedPatchPrediction.forward, [0]

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        count[0] += 1
        if count[0] in calls:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(masked_patch.MaskedPatchPrediction, "forward", poisoned)


def test_non_finite_steps_are_skipped(synthetic_shards, tmp_path, monkeypatch):
    _poison(monkeypatch, {3, 4})
    args = ["train.steps=10", "train.log_every=1", "train.max_bad_steps=3"]
    results = pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path, *args))
    assert results["skipped_steps"] == 2
    log = rows(tmp_path)
    assert [r["skipped_steps"] for r in log] == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    assert all(r["loss"] == r["loss"] for r in log if r["step"] not in (3, 4))  # not NaN
    # The gradient norm: a mean over applied steps, none in the rows of steps 3 and 4 (NaN,
    # written as null).
    good = [r for r in log if r["step"] not in (3, 4)]
    assert all(r["grad_norm"] > 0 and r["clipped"] in (0.0, 1.0) for r in good)
    assert all(r["grad_norm"] is None for r in log if r["step"] in (3, 4))
    state = torch.load(tmp_path / "checkpoints/step_00000010/state.pt", weights_only=True)
    adam_steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {8.0}  # 10 steps, 2 not applied


def test_too_many_bad_steps_stop_with_last_good_checkpoint(synthetic_shards, tmp_path, monkeypatch):
    _poison(monkeypatch, set(range(5, 100)))
    args = ["train.steps=20", "train.checkpoint_every=2", "train.max_bad_steps=3"]
    with pytest.raises(TooManyBadStepsError, match="3 steps in a row with a non-finite.*_00000004"):
        pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path, *args))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000004"]  # none written during the bad run


def test_corrupted_checkpoint_falls_back(synthetic_shards, tmp_path, capfd):
    main = pipeline("pretrain")
    main(pretrain_args(synthetic_shards, tmp_path, "train.steps=6", "train.checkpoint_every=2"))
    state = tmp_path / "checkpoints/step_00000006/state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    (tmp_path / "checkpoints/step_00000004/manifest.json").unlink()  # half-written
    capfd.readouterr()
    results = main(
        pretrain_args(
            synthetic_shards, tmp_path, "train.steps=6", "train.checkpoint_every=2", "--resume"
        )
    )
    err = capfd.readouterr().err
    assert "state.pt is truncated or corrupted" in err and "incomplete checkpoint" in err
    assert "resumed from" in err and "step_00000002 at step 2" in err
    assert results["step"] == 6


def stop_after_step(monkeypatch, step: int) -> None:
    """The job's stop request is agreed at its `step`-th check (after that step), as a SIGTERM
    then would."""
    from ssl_vit.train.runtime import StopRequest

    calls = [0]

    def agreed(self):
        calls[0] += 1
        return calls[0] == step

    monkeypatch.setattr(StopRequest, "agreed", agreed)


def test_a_finetune_resumes_when_its_init_checkpoint_is_gone(
    synthetic_shards, tmp_path, monkeypatch, capfd
):
    """The pretraining run cleaned up (or not mounted where the run moved): --resume reads the
    encoder's shape and normalisation from the run's own checkpoint and continues exactly; it
    stopped with "init.checkpoint=...: no such file or directory"."""
    pipeline("pretrain")(pretrain_args(synthetic_shards, tmp_path / "pre", "train.steps=2"))
    init = tmp_path / "pre/checkpoints/step_00000002"

    def args(out, *extra):
        every = ["train.log_every=1", "train.checkpoint_every=0", f"init.checkpoint={init}"]
        return finetune_args(synthetic_shards, out, "train.steps=6", *every, *extra)

    main = pipeline("finetune")
    main(args(tmp_path / "ref"))
    stop_after_step(monkeypatch, 3)
    assert main(args(tmp_path / "run")) == {"step": 3, "preempted": True}
    monkeypatch.undo()
    (tmp_path / "pre").rename(tmp_path / "cleaned-up")
    capfd.readouterr()
    results = main(args(tmp_path / "run", "--resume"))
    assert losses(tmp_path / "run") == losses(tmp_path / "ref") and len(rows(tmp_path / "run")) == 6
    assert results["init"] == str(init)  # as recorded at the start
    assert f"init.checkpoint='{init}' is gone: the encoder's shape" in capfd.readouterr().err
    with pytest.raises(SystemExit, match="init.checkpoint=.*: no such file or directory"):
        main(args(tmp_path / "new"))  # a new run needs it


@pytest.mark.system
def test_finetune_preempted_and_resumed_is_exact(synthetic_shards, tmp_path, monkeypatch):
    """Fine-tuning: a stop request after step 5 (as SIGTERM would set it), then --resume."""

    def args(out, *extra):
        every = ["train.log_every=1", "train.checkpoint_every=0", "data.num_workers=2"]
        return finetune_args(synthetic_shards, out, "train.steps=10", *every, *extra)

    main = pipeline("finetune")
    # (finetune builds a random-init encoder before start_run seeds the RNGs: seed it here)
    torch.manual_seed(0)
    main(args(tmp_path / "ref"))
    stop_after_step(monkeypatch, 5)
    torch.manual_seed(0)
    assert main(args(tmp_path / "run")) == {"step": 5, "preempted": True}
    assert latest_valid_checkpoint(tmp_path / "run/checkpoints").name == "step_00000005"
    main(args(tmp_path / "run", "--resume"))
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
