"""scripts/bench.py: the timm baseline computes our loss, and a tiny run writes every figure.
No timings are asserted (they belong to the benchmark, not to tests)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ssl_vit.bench.timing import time_interleaved
from ssl_vit.bench.timm_baseline import TimmMaskedPatch, copy_weights
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
from ssl_vit.model import build_vit
from ssl_vit.objectives import MaskedPatchPrediction

# timm imported by the tests that use it, not at collection (~0.8 s of every xdist worker's
# start, also of a worker that ran none of these tests).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="needs timm")

ROOT = Path(__file__).resolve().parents[1]
# A time budget no machine runs out of (11 days; not inf: the pipeline row's subprocess timeout
# is derived from it and must fit a poll() timeout), so that no row depends on machine speed.
NO_BUDGET_S = 1e6


def bench(argv: list[str]) -> dict:
    """scripts/bench.py's main(argv) in this process (a launch would spend seconds importing
    torch again), with the process-wide settings it makes (threads, flush-denormal) restored."""
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts/bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        return module.main(argv)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


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

    def draws(model, seed):
        return model.draw_noise(len(images), torch.Generator().manual_seed(seed))

    # The same seed: the same draws, hence the same corrupted patches and the same loss.
    assert torch.equal(draws(theirs, 1), draws(ours, 1))
    same = theirs(images, draws(theirs, 1))
    torch.testing.assert_close(same, ours(images, draws(ours, 1)).loss, rtol=1e-5, atol=1e-5)
    # Another seed: other draws, other masks, hence (almost surely) another loss.
    assert not torch.equal(draws(theirs, 1), draws(ours, 2))
    assert not torch.allclose(same, ours(images, draws(ours, 2)).loss)


def test_time_interleaved_alternates_rounds():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    times = time_interleaved(fns, torch.device("cpu"), rounds=2, steps=1, warmup=1)
    assert calls == list("abc") + list("abc") + list("cba")
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2, "c": 2}


@pytest.mark.system
def test_bench_quick_tiny_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    cmd = ["--model", "tiny", "--quick"]
    cmd += ["--synthetic", "--warmup", "1", "--rounds", "1", "--threads", "1", "--json", str(out)]
    bench(cmd)
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
    assert "ratio ours/timm same precision" in capsys.readouterr().out


@pytest.mark.system
def test_loader_suite_tiny_writes_every_figure(tmp_path):
    """`--suite loader` on a few photos at 32 px: both make-shards runs wrote the same bytes,
    every loader answered (the figures themselves are the lead's measurement, not a test)."""
    pytest.importorskip("skimage")
    out = tmp_path / "loader.json"
    cmd = ["--suite", "loader", "--quick"]
    cmd += ["--num-images", "24", "--rounds", "1", "--batch-size", "4", "--image-size", "32"]
    bench([*cmd, "--pipeline-steps", "4", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["images"] == 24 and res["make_shards_identical_output"] is True
    rates = res["loader_images_per_s_1_worker"]
    assert set(rates) == {"ours", "imagefolder", "ours_max_size", "imagefolder_max_size"}
    assert all(v > 0 for v in rates.values()) and res["ours_vs_imagefolder"] > 0
    runs = res["pipeline_tiny_model_1_worker"]
    assert len(runs) == 2 and all(r["img_per_s"] > 0 for r in runs.values())


@pytest.mark.system
def test_gpu_suite_tiny_on_cpu_writes_every_row(tmp_path, capsys):
    """`--suite gpu --tiny` on the CPU: every section answers, CUDA-only rows say so. The time
    budget is unlimited: how fast this machine is decides no row (the budget's own test is
    test_gpu_suite_guards_sections_and_budget); the pipeline row's own timeout bounds a hang."""
    out = tmp_path / "gpu.json"
    cmd = ["--suite", "gpu", "--tiny", "--device", "cpu", "--threads", "1", "--out", str(out)]
    bench([*cmd, "--markdown", "--budget-s", str(NO_BUDGET_S)])
    res = json.loads(out.read_text())
    rows = {r["name"]: r for r in res["rows"]}
    r0 = rows["ours tiny_w32_p4_16 eager"]
    assert res["device"] == "cpu" and res["size"] == "tiny"
    assert rows["matmul peak"]["status"] == "ok" and rows["matmul peak"]["flops_per_s"] > 0
    for who in ("ours", "timm"):
        r = rows[f"{who} tiny_w32_p4_16 eager"]
        assert r["status"] == "ok" and r["img_per_s"] > 0 and r["pct_of_peak"] > 0, r
        assert r["step_gflop"] == rows["ours tiny_w32_p4_16 eager"]["step_gflop"]  # same model
        for mode in ("compiled", "reduce-overhead"):
            assert rows[f"{who} tiny_w32_p4_16 {mode}"]["status"] == "skipped: no CUDA"
    assert rows["ours/timm tiny_w32_p4_16 eager"]["ratio"] > 0
    assert rows["set_sync_debug_mode(error)"]["status"] == "skipped: no CUDA"
    assert rows["host syncs per step (counted)"]["host_syncs_per_step"] >= 0
    loader = rows["loader img/s at the GPU batch"]
    assert loader["status"] == "ok", loader
    assert loader["img_per_s_device_augment"] > 0 and loader["img_per_s_workers_augment"] > 0
    assert loader["augment_ms_per_batch"] > 0
    pipe = rows["pipelines/pretrain.py eager"]
    assert pipe["status"] == "ok" and pipe["img_per_s"] > 0 and len(pipe["img_per_s_laps"]) == 2
    assert rows["pipelines/pretrain.py compiled"]["status"] == "skipped: no CUDA"
    assert rows["pipelines/pretrain.py compiled, every GPU (DDP)"]["status"] == "skipped: no CUDA"
    assert "| models | ours tiny_w32_p4_16 eager | ok |" in capsys.readouterr().out
    # The objectives of configs/study/classifier.yaml, each with its speed-up over the paper's.
    for name in ("paper_mpp", "mpp_decoder", "visible_75"):
        r = rows[f"{name} tiny_w32_p4_16 eager"]
        assert r["status"] == "ok" and r["img_per_s"] > 0, r
        assert rows[f"{name} tiny_w32_p4_16 compiled"]["status"] == "skipped: no CUDA"
    assert rows["paper_mpp tiny_w32_p4_16 eager"]["step_gflop"] == r0["step_gflop"]
    for name in ("mpp_decoder", "visible_75"):
        ratio = rows[f"{name}/paper_mpp tiny_w32_p4_16 eager"]
        assert ratio["speedup"] > 0 and ratio["flop_ratio"] > 0
    # A decoder of 2 blocks on a 2-block encoder, on every token: exactly twice the step's
    # block FLOPs, plus the same patch projection and head.
    assert 1.5 < rows["mpp_decoder/paper_mpp tiny_w32_p4_16 eager"]["flop_ratio"] < 2.0


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_gpu_suite_guards_sections_and_budget():
    from ssl_vit.bench.gpu_suite import Suite, markdown_table, run_suite

    suite = Suite(torch.device("cpu"), size="tiny", budget_s=NO_BUDGET_S)  # 0 s rows: in

    def boom():
        raise RuntimeError("first line\nsecond line")

    suite.row("x", "fails", 0, boom)
    suite.row("x", "runs after", 0, lambda: {"v": 1.0})
    suite.row("x", "too long", 1e7, lambda: {"v": 2.0})
    fails, after, too_long = suite.rows
    assert fails["status"] == "error: RuntimeError: first line" and "traceback" in fails
    assert after["status"] == "ok" and after["v"] == 1.0
    assert too_long["status"].startswith("skipped: time budget") and "v" not in too_long
    # Out of budget: every row is skipped, the document is still complete.
    res = run_suite(Suite(torch.device("cpu"), size="tiny", budget_s=0))
    assert res["rows"] and all(r["status"].startswith("skipped") for r in res["rows"])
    assert "| peak | matmul peak | skipped: time budget" in markdown_table(res)


@pytest.mark.system
def test_gpu_suite_sections_and_batch(capsys):
    """--sections runs only the sections named; --batch-size replaces every shape's batch."""
    from ssl_vit.bench.gpu_suite import Suite, run_suite
    from ssl_vit.config.schema import ObjectiveConfig

    visible = ObjectiveConfig(encoder="visible", decoder_depth=1)
    objectives = {"paper": ObjectiveConfig(), "visible": visible}
    suite = Suite(torch.device("cpu"), size="tiny", objectives=objectives,
                  sections=frozenset({"objectives"}), batch=4, budget_s=NO_BUDGET_S)  # fmt: skip
    rows = run_suite(suite)["rows"]
    assert [r["name"] for r in rows] == [
        "paper tiny_w32_p4_16 eager", "visible tiny_w32_p4_16 eager",
        "visible/paper tiny_w32_p4_16 eager",
        "paper tiny_w32_p4_16 compiled", "visible tiny_w32_p4_16 compiled",
    ]  # fmt: skip
    assert rows[0]["batch"] == 4 and rows[2]["speedup"] > 0
    with pytest.raises(SystemExit) as e:
        bench(["--suite", "gpu", "--sections", "x"])
    assert e.value.code == 2 and "unknown section(s) ['x']" in capsys.readouterr().err
