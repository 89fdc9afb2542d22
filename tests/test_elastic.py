"""Elastic exact resume: the run depends on the seed, never on the cluster shape.

The number of loader workers changes nothing (bit-identical losses); a run stopped by SIGTERM
with 2 workers and resumed with 1 continues bit-identically; a 2-process run (gloo) sees the
same samples per step as a 1-process run of the same global batch, with losses equal within
the all-reduce's float error, and resumed on 1 process it goes on as the 1-process run.
(One process, CPU, the synthetic fixture; real subprocesses, SIGTERM, --resume.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import pipeline
from test_distributed import LAUNCH, _free_port
from test_pipelines import ROOT, finetune_args, pretrain_args, rows

STEPS = 16
BATCH = 16  # global; auto lanes: 16
RUN = [
    f"train.steps={STEPS}",
    f"train.batch_size={BATCH}",
    "train.log_every=1",
    "train.checkpoint_every=0",  # the only checkpoints: the stop's and the last step's
    "data.shuffle_buffer=8",
    "data.record_keys=true",
]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def keys_per_step(run_dir: Path, processes: int, steps: int) -> list[list[str]]:
    """The samples of each of the first `steps` steps, ranks' slices in rank order."""
    per_rank = [(run_dir / f"keys_rank{r}.txt").read_text().split() for r in range(processes)]
    b = BATCH // processes
    return [sum((k[t * b : (t + 1) * b] for k in per_rank), []) for t in range(steps)]


def _run(shards, out: Path, *extra: str) -> None:
    pipeline("pretrain")(pretrain_args(shards, out, *RUN, *extra))


@pytest.fixture(scope="module")
def reference(synthetic_shards, tmp_path_factory):
    """The uninterrupted 1-process run with 2 loader workers: losses, samples of each step."""
    out = tmp_path_factory.mktemp("reference")
    _run(synthetic_shards, out, "data.num_workers=2")
    return losses(out), keys_per_step(out, 1, STEPS)


def _logged(out: Path) -> int:
    """Steps logged so far (0 while the file is missing or its last line is being written)."""
    try:
        return len(losses(out))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def _stop_after(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> int:
    """SIGTERM once `step` steps are logged; wait for the preempted exit; the stop's step."""
    end = time.time() + timeout
    while _logged(out) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < end, "timed out"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    results = json.loads((out / "results.json").read_text())
    assert results.get("preempted"), err[-3000:]
    assert step <= results["step"] < STEPS, results
    return results["step"]


@pytest.mark.system
def test_worker_count_changes_nothing(synthetic_shards, tmp_path, reference):
    _run(synthetic_shards, tmp_path, "data.num_workers=1")
    assert losses(tmp_path) == reference[0]  # bit-identical at every step
    assert keys_per_step(tmp_path, 1, STEPS) == reference[1]


@pytest.mark.system
def test_stopped_with_two_workers_resumed_with_one(synthetic_shards, tmp_path, reference):
    cmd = [
        *(sys.executable, str(ROOT / "pipelines/pretrain.py")),
        *pretrain_args(synthetic_shards, tmp_path, *RUN, "data.num_workers=2"),
    ]
    # The same environment (thread count) as the in-process runs: bit-identical arithmetic.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = _stop_after(proc, tmp_path, 3)
    _run(synthetic_shards, tmp_path, "data.num_workers=1", "--resume")
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1)), stopped
    assert got == reference[0], stopped  # exactly, before and after the stop
    assert keys_per_step(tmp_path, 1, STEPS) == reference[1]


@pytest.mark.system
def test_two_processes_match_one_and_resume_on_one(synthetic_shards, tmp_path, reference):
    """2 processes x 1 worker, stopped by SIGTERM, resumed as 1 process x 2 workers."""
    cmd = [
        *(*LAUNCH, "--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(synthetic_shards, tmp_path, *RUN, "data.num_workers=1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stopped = _stop_after(proc, tmp_path, 3)
    ref_losses, ref_keys = reference
    two = losses(tmp_path)
    assert sorted(two) == list(range(1, stopped + 1))
    # The same samples, crops and corruption: only the all-reduce's float error differs.
    assert keys_per_step(tmp_path, 2, stopped) == ref_keys[:stopped]
    for s in range(1, 4):
        assert two[s] == pytest.approx(ref_losses[s], rel=1e-5, abs=0), (s, two[s], ref_losses[s])

    _run(synthetic_shards, tmp_path, "data.num_workers=2", "--resume")
    got = losses(tmp_path)
    print(f"stopped after step {stopped}; step, 1-process loss, 2 then 1 process(es), rel. diff:")
    for s in sorted(got):
        print(s, ref_losses[s], got[s], abs(got[s] - ref_losses[s]) / abs(ref_losses[s]))
    assert sorted(got) == list(range(1, STEPS + 1))
    resumed = (tmp_path / "keys_rank0.txt").read_text().split()[(BATCH // 2) * stopped :]
    assert [resumed[t * BATCH : (t + 1) * BATCH] for t in range(STEPS - stopped)] == ref_keys[
        stopped:
    ]
    for s in range(stopped + 1, STEPS + 1):  # continues as the 1-process run, within float error
        assert got[s] == pytest.approx(ref_losses[s], rel=1e-4, abs=0), (s, got[s], ref_losses[s])


@pytest.mark.system
def test_a_mixup_fine_tune_on_two_processes_matches_one(synthetic_shards, tmp_path):
    """Mixup / cutmix pair images within a lane's share of the micro-batch, and a process
    holds whole lanes: 2 processes (gloo) mix the images 1 process mixes, so the fine-tune's
    losses agree within the all-reduce's float error (pairing within each process's batch,
    as timm does, mixed other images: 3.5e-4 apart at step 1 here)."""
    run = ["train.steps=4", "train.batch_size=16", "train.log_every=1", "data.lanes=4"]
    run += ["data.num_workers=1", "parts.mixup=0.8", "parts.cutmix=1.0", "train.lr=0.1"]
    pipeline("finetune")(finetune_args(synthetic_shards, tmp_path / "one", *run))
    cmd = [
        *(*LAUNCH, "--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/finetune.py"),
        *finetune_args(synthetic_shards, tmp_path / "two", *run),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-5, abs=0), (s, one[s], two[s])


def test_a_stream_that_cannot_continue_is_refused(synthetic_shards, tmp_path):
    """--resume with another seed (or shuffle) is refused before config.yaml is touched; with
    other shards (the same file names) by the loader, before step 1; both one line."""
    from ssl_vit.datasets.synthetic import make_synthetic_shards

    out = tmp_path / "run"
    short = ["train.steps=2", "train.log_every=1", "train.checkpoint_every=0"]
    pipeline("pretrain")(pretrain_args(synthetic_shards, out, *short))
    config = (out / "config.yaml").read_text()
    for change, key in (("seed=1", "seed 0 -> 1"), ("data.shuffle_buffer=3", "shuffle_buffer")):
        with pytest.raises(SystemExit, match=f"^error: --resume: .*{key}") as e:
            pipeline("pretrain")(pretrain_args(synthetic_shards, out, *short, change, "--resume"))
        assert "\n" not in str(e.value)
        assert (out / "config.yaml").read_text() == config
    other = tmp_path / "other"
    make_synthetic_shards(other, n=64, image_size=32, seed=1, shard_size=32)
    with pytest.raises(ValueError, match="data.train_shards 2 shards/") as e:
        pipeline("pretrain")(pretrain_args(other, out, "train.steps=4", "--resume"))
    assert "\n" not in str(e.value)
    assert losses(out) == {1: losses(out)[1], 2: losses(out)[2]}  # nothing trained


def test_stream_benchmark_runs(synthetic_shards, capsys, monkeypatch):
    """scripts/bench_stream.py at a tiny size: one JSON line with both rates and both starts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_stream", ROOT / "scripts/bench_stream.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["x", "--shards", str(synthetic_shards), "--workers", "0", "--batch-size", "8"]
    monkeypatch.setattr(
        sys, "argv", [*argv, "--images", "16", "--rounds", "1", "--resume-after", "2"]
    )
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["images_per_s"]) == {"seeded per sample", "not seeded", "one lane per worker"}
    assert all(v > 0 for v in out["images_per_s"].values())
    assert len(out["first_batch_s"]) == 2 and out["lanes"] == 2
