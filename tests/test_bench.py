"""scripts/bench.py: the timm baseline computes our loss, and a tiny run writes every figure.
No timings are asserted (they belong to the benchmark, not to tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
from ssl_vit.model import build_vit
from ssl_vit.objectives import MaskedPatchPrediction

pytest.importorskip("timm")
from ssl_vit.bench.timing import time_interleaved  # noqa: E402
from ssl_vit.bench.timm_baseline import TimmMaskedPatch, copy_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(image_size=16, patch_size=4, width=32, depth=2, heads=2)
    ours = MaskedPatchPrediction(build_vit(cfg), ObjectiveConfig())
    torch.nn.init.normal_(ours.head.weight, std=0.5)  # non-zero head: a loss that tests more
    theirs = TimmMaskedPatch(16, 4, 32, 2, 2)
    copy_weights(ours, theirs)
    return ours, theirs


def test_timm_baseline_computes_our_loss_and_gradients():
    ours, theirs = _pair()
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    loss_ours = ours(images, ours.draw_noise(len(images), torch.Generator().manual_seed(7))).loss
    loss_theirs = theirs(images, theirs.draw_noise(len(images), torch.Generator().manual_seed(7)))
    torch.testing.assert_close(loss_theirs, loss_ours, rtol=1e-5, atol=1e-5)
    assert abs(loss_ours.item() - torch.log(torch.tensor(512.0)).item()) > 0.1
    loss_ours.backward()
    loss_theirs.backward()
    torch.testing.assert_close(
        theirs.vit.blocks[0].attn.qkv.weight.grad, ours.encoder.blocks[0].attn.qkv.weight.grad
    )
    torch.testing.assert_close(theirs.mask_embedding.grad, ours.mask_embedding.grad)


def test_timm_baseline_uses_the_same_corruption_draws():
    ours, theirs = _pair(1)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    # Different generator seeds give different masks, hence (almost surely) different losses.
    a = theirs(images, theirs.draw_noise(len(images), torch.Generator().manual_seed(1)))
    b = ours(images, ours.draw_noise(len(images), torch.Generator().manual_seed(2))).loss
    assert not torch.allclose(a, b)


def test_time_interleaved_alternates_rounds():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    times = time_interleaved(fns, torch.device("cpu"), rounds=2, steps=1, warmup=1)
    assert calls == list("abc") + list("abc") + list("cba")
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 2}


def test_bench_quick_tiny_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "scripts/bench.py"), "--model", "tiny", "--quick"]
    cmd += ["--synthetic", "--warmup", "1", "--rounds", "1", "--threads", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    keys = [
        "device",
        "ratio_vs_timm_same_precision",
        "ratio_vs_timm_defaults",
        "utilization",
        "loader_vs_imagefolder",
        "loader_vs_training",
        "overhead_fraction",
        "rss_mb_1x",
        "rss_mb_4x",
    ]
    assert all(k in res for k in keys) and res["device"] == "cpu"
    (shape,) = res["shapes"]
    for k in keys[1:]:
        assert shape[k] == res[k] and res[k] > 0, k
    assert 0 < res["utilization"] < 1.5 and 0 < res["overhead_fraction"] < 1.5
    assert "ratio ours/timm same precision" in proc.stdout
