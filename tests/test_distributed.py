"""Real multi-process runs through `accelerate launch` (gloo on CPU): 2 processes on one
machine, and 2 "machines" (two launchers) on loopback. Each checks that the ranks and workers
read disjoint samples, every sample exactly once in one epoch, and that the parameters are
identical on every rank after the steps (the checkpoint compares their checksums)."""

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import pipeline
from test_pipelines import ROOT, pretrain_args, rows

from ssl_vit.config import PretrainConfig, from_dict
from ssl_vit.data.write.writer import ShardWriter
from ssl_vit.datasets.synthetic import SYNTHETIC_LABELS, make_synthetic_shards, synthetic_shapes
from ssl_vit.model import build_vit
from ssl_vit.objectives import MaskedPatchPrediction
from ssl_vit.train.runtime import replica_checksum

# 8 shards of 12 = 96 samples; 2 ranks x 2 workers = 4 reader units of 2 shards (24 samples)
# each. Global batch 16 = 8 per rank: 6 steps consume 48 samples per rank, exactly one epoch.
RUN = [
    "train.steps=6",
    "train.log_every=3",
    "train.checkpoint_every=3",
    "data.num_workers=2",
    "data.record_keys=true",
]
LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


@pytest.fixture(scope="module")
def eight_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight_shards")
    make_synthetic_shards(out, n=96, image_size=32, seed=0, shard_size=12)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_run(out) -> None:
    results = json.loads((out / "results.json").read_text())
    assert results["num_processes"] == 2 and results["step"] == 6
    assert [r["step"] for r in rows(out)] == [3, 6]
    per_rank = [(out / f"keys_rank{r}.txt").read_text().split() for r in range(2)]
    assert [len(k) for k in per_rank] == [48, 48]
    assert not set(per_rank[0]) & set(per_rank[1])  # disjoint ranks
    counts = Counter(per_rank[0] + per_rank[1])
    assert sorted(counts) == sorted(k for k, _, _ in synthetic_shapes(96))
    assert set(counts.values()) == {1}  # every sample exactly once in the epoch
    for step in (3, 6):
        state = torch.load(out / f"checkpoints/step_{step:08d}/state.pt", weights_only=True)
        a, b = state["replica_checksums"]
        print(f"step {step}: parameter checksums per rank {a!r} {b!r}")
        # Equal by construction (replica_checksum raises otherwise: its own test below); what
        # can fail here is that they are the checksum of the parameters this step saved.
        assert a == b == pytest.approx(_checksum(state), rel=1e-12, abs=0)
    ckpt = out / "checkpoints/step_00000006"
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= {p.name for p in ckpt.iterdir()}


def _checksum(state: dict) -> float:
    """The float64 sum of the parameters saved in a checkpoint's state, as replica_checksum
    sums them (parameter order), computed here from the saved weights."""
    cfg = from_dict(PretrainConfig, state["config"])
    model = MaskedPatchPrediction(build_vit(cfg.model), cfg.objective)
    model.load_state_dict(state["model"])
    return sum(p.detach().double().sum() for p in model.parameters()).item()


class _TwoRanks:
    """The part of an Accelerator replica_checksum uses: 2 processes, the other rank's
    parameter sum `offset` away from this one's."""

    device = torch.device("cpu")
    distributed_type = DistributedType.MULTI_CPU

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t + self.offset])


def test_replica_checksum_ends_a_run_whose_replicas_differ():
    model = torch.nn.Linear(3, 2)
    total = sum(p.detach().double().sum() for p in model.parameters()).item()
    assert replica_checksum(model, _TwoRanks(0.0)) == [total, total]
    with pytest.raises(RuntimeError, match=r"parameters differ across ranks \(checksums"):
        replica_checksum(model, _TwoRanks(2.0**-20))


@pytest.mark.system
def test_two_processes(eight_shards, tmp_path):
    cmd = [
        *LAUNCH,
        "--num_machines",
        "1",
        "--main_process_port",
        str(_free_port()),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(eight_shards, tmp_path, *RUN),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(tmp_path)


@pytest.mark.system
def test_two_processes_on_one_shard(tmp_path):
    """A dataset of one shard (a small folder's make-shards) on 2 processes: auto lanes take 2
    (the shard shared, each lane its half), not 1 (which cannot split: an error before); every
    sample once in the epoch, on disjoint ranks."""
    one = tmp_path / "one_shard"
    make_synthetic_shards(one, n=96, image_size=32, seed=0, shard_size=96)
    out = tmp_path / "run"
    cmd = [
        *LAUNCH,
        *("--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(one, out, *RUN),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.lanes (auto): 2 lanes over 1 shard(s), shared, to split over 2" in proc.stderr
    _check_run(out)
    rng = torch.load(out / "checkpoints/step_00000006/rng_rank0.pt", weights_only=False)
    assert rng["stream"]["lanes"] == 2


@pytest.mark.system
def test_two_processes_count_every_ranks_skipped_samples(tmp_path):
    """A sample skipped on rank 1 is counted: the rows, checkpoints and results of 2 processes
    say what 1 process says of the same stream (8 shards: the same lanes, the same order). They
    counted rank 0's skips only: 3 of 11 in a folder of photos with broken files."""
    shards = tmp_path / "shards"
    with ShardWriter(shards, shard_size=12) as writer:
        for i, (key, data, label) in enumerate(synthetic_shapes(96)):
            writer.write(key, "png", data if i % 7 else b"\x89PNG\r\n\x1a\n broken", label)
        writer.close(label_names=SYNTHETIC_LABELS, source="test")
    run = [*RUN[:-1], "train.steps=8", "train.log_every=2"]  # over the epoch: 14 broken of 96
    one = pipeline("pretrain")(pretrain_args(shards, tmp_path / "one", *run))
    cmd = [
        *LAUNCH,
        *("--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(shards, tmp_path / "two", *run),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two/results.json").read_text())
    counts = [[r["skipped_samples"] for r in rows(tmp_path / d)] for d in ("one", "two")]
    assert counts[0] == counts[1] and counts[0][-1] == one["skipped_samples"] >= 14
    assert two["skipped_samples"] == one["skipped_samples"]
    for d in ("one", "two"):
        state = torch.load(tmp_path / d / "checkpoints/step_00000006/state.pt", weights_only=True)
        assert state["counters"]["skipped_samples"] == counts[0][2]  # the step-6 row's


@pytest.mark.system
def test_two_machines_on_loopback(eight_shards, tmp_path):
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                str(ROOT / "pipelines/pretrain.py"),
                *pretrain_args(eight_shards, tmp_path, *RUN),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    _check_run(tmp_path)
