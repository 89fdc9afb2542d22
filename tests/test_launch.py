"""Preemption through every documented launch path: a SIGTERM to the launch command (or its
process group) returns control only once the checkpoint is complete and every training
process has exited. Resuming from that checkpoint is checked through the plain script: `ssl-vit`
runs the same script, and the SLURM script is `accelerate launch` with `--resume`, whose two
processes resuming are tests/test_elastic.py's and tests/test_run_ownership.py's (a requeued
`slurm_pretrain.sh`), so the other paths stop after the checkpoint (a launch each saved).

The model is large enough (width 384, depth 6: ~130 MB of checkpoint with Adam's moments) that
writing the checkpoint takes a good part of a second, while a launcher that returns early
returns within milliseconds of the signal: the checkpoint it leaves is caught incomplete."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from test_distributed import LAUNCH
from test_guard import _alive, _free_port, _launch, _log, _wait_until
from test_pipelines import ROOT, pretrain_args

from ssl_vit.train.checkpoint import checkpoint_dirs, latest_valid_checkpoint, verify_checkpoint

pytestmark = pytest.mark.system  # every test here launches a job

BIG = [
    *("model.width=384", "model.depth=6", "model.heads=6", "train.batch_size=4"),
    *("train.steps=100000", "train.log_every=1", "train.checkpoint_every=0"),
    "data.num_workers=1",
]


RESUMED = ("python",)  # the paths whose --resume is run (module docstring)


def _accelerate(port: int, script: str = "pipelines/pretrain.py") -> list[str]:
    return [
        *LAUNCH,  # the venv's `accelerate launch`, 2 processes, no mixed precision
        *("--main_process_port", str(port), str(ROOT / script)),
    ]


def _slurm_env(tmp_path: Path, port: int) -> dict:
    """SLURM's commands as stubs: `srun` runs its command here, `scontrol` names this host."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}",
        **{"SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2"},
        **{"SLURM_NODEID": "0", "MAIN_PORT": str(port), "OMP_NUM_THREADS": "1"},
    }


def _command(path: str, shards: Path, out: Path, tmp_path: Path, *extra: str):
    """(argv, env, whom SIGTERM is sent to) of one launch path."""
    args = pretrain_args(shards, out, *BIG, *extra)
    if path == "python":
        return [sys.executable, str(ROOT / "pipelines/pretrain.py"), *args], None, "group"
    if path == "cli":  # the installed console script
        return [str(Path(sys.executable).parent / "ssl-vit"), "pretrain", *args], None, "group"
    if path == "accelerate":
        return [*_accelerate(_free_port()), *args], None, "group"
    # SLURM signals the batch shell only (--signal=B:TERM); its trap passes it on.
    config, *overrides = args[1:]
    script = [str(ROOT / "scripts/slurm_pretrain.sh"), config, *overrides]
    return ["bash", *script], _slurm_env(tmp_path, _free_port()), "shell"


@pytest.mark.parametrize("path", ["python", "cli", "accelerate", "slurm"])
def test_sigterm_returns_after_the_checkpoint(path, synthetic_shards, tmp_path):
    out = tmp_path / "run"
    argv, env, target = _command(path, synthetic_shards, out, tmp_path)
    proc = _launch(argv, out, env=env)
    metrics = out / "metrics.jsonl"
    _wait_until(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, proc, out)
    t0 = time.time()
    if target == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    returned_after = time.time() - t0
    # At the moment the launch command returns: a complete checkpoint, nobody left running.
    done = checkpoint_dirs(out / "checkpoints")
    assert len(done) == 1, _log(out)[-3000:]
    verify_checkpoint(done[0])
    assert not _alive(str(out)), "a training process outlived the launch command"
    step = int(done[0].name.split("_")[1])
    results = json.loads((out / "results.json").read_text())
    assert results == {"step": step, "preempted": True}
    # python, ssl-vit: 0; torchrun (accelerate --multi_gpu, SLURM) exits 1 after re-raising
    # the signal (its workers exited 0).
    assert rc == (0 if path in ("python", "cli") else 1), _log(out)[-3000:]
    seconds = re_seconds(_log(out))
    print(f"{path}: returned {returned_after:.1f}s after SIGTERM, exit {rc}, step {step}, "
          f"checkpoint written in {seconds}s")  # fmt: skip

    if path not in RESUMED:
        return
    # --resume (the same launch path) continues from that checkpoint.
    argv, env, _ = _command(path, synthetic_shards, out, tmp_path, f"train.steps={step + 1}")
    proc = _launch([*argv, "--resume"], out.parent / "resumed", env=env)
    assert proc.wait(timeout=300) == 0, _log(out.parent / "resumed")[-3000:]
    assert f"resumed from {done[0]} at step {step}" in _log(out.parent / "resumed")
    assert json.loads((out / "results.json").read_text())["step"] == step + 1
    assert latest_valid_checkpoint(out / "checkpoints").name == f"step_{step + 1:08d}"


def re_seconds(log: str) -> str:
    """The write time of the last checkpoint, from its log line."""
    lines = [line for line in log.splitlines() if "checkpoint step" in line and " in " in line]
    return lines[-1].rsplit(" in ", 1)[1].split("s")[0] if lines else "?"
