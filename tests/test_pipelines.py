"""End-to-end runs of the three jobs on the synthetic 2-shard fixture (seconds each)."""

import json
import math
import time
from pathlib import Path

import pytest
from conftest import pipeline

ROOT = Path(__file__).resolve().parents[1]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def pretrain_args(shards, out, *extra):
    return [
        "--config",
        str(ROOT / "configs/pretrain/smoke.yaml"),
        f"data.train_shards={shards}",
        f"output_dir={out}",
        *extra,
    ]


def finetune_args(shards, out, *extra):
    """The smoke fine-tune from scratch on `shards`, no evaluation set."""
    return [
        "--config",
        str(ROOT / "configs/finetune/smoke.yaml"),
        f"data.train={shards}",
        "data.eval=",
        f"output_dir={out}",
        *extra,
    ]


def init_args(ckpt, shards, out) -> list[str]:
    """The smoke fine-tune from `ckpt`, trained and evaluated on `shards`."""
    return [
        "--config",
        str(ROOT / "configs/finetune/smoke.yaml"),
        f"init.checkpoint={ckpt}",
        f"data.train={shards}",
        f"data.eval={shards}",
        f"output_dir={out}",
    ]


@pytest.fixture(scope="module")
def pretrained(synthetic_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain")
    results = pipeline("pretrain")(
        pretrain_args(
            synthetic_shards,
            out,
            "train.steps=60",
            "train.lr=3e-3",
            "train.log_every=10",
            "train.checkpoint_every=20",
            "train.keep_checkpoints=2",
        )
    )
    return out, results


def test_pretrain_outputs_and_learning(pretrained):
    out, results = pretrained
    assert (out / "config.yaml").is_file() and (out / "results.json").is_file()
    log = rows(out)
    assert [r["step"] for r in log] == [10, 20, 30, 40, 50, 60]
    for key in (
        "loss",
        "lr",
        "img_per_s",
        "color_acc",
        "frac_corrupted",
        "frac_mask",
        "frac_random",
        "frac_keep",
        "skipped_samples",
        "grad_norm",
        "clipped",
    ):
        assert key in log[0]
    assert all(r["frac_corrupted"] == 0.5 for r in log)  # exactly round(0.5 * 16) = 8 of 16
    assert all(math.isclose(r["frac_mask"] + r["frac_random"] + r["frac_keep"], 1) for r in log)
    assert log[0]["loss"] < math.log(512) + 1e-3
    assert log[-1]["loss"] < log[0]["loss"] - 0.3, [r["loss"] for r in log]
    assert results["step"] == 60 and results["skipped_samples"] == 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000040", "step_00000060"]  # keep_checkpoints=2
    assert (out / "checkpoints/step_00000060/encoder.safetensors").is_file()


def test_pretrain_resume_continues_from_checkpoint(synthetic_shards, tmp_path):
    from ssl_vit.train.checkpoint import load_checkpoint

    main = pipeline("pretrain")
    t0 = time.time()
    first = main(
        pretrain_args(synthetic_shards, tmp_path, "train.steps=10", "train.checkpoint_every=5")
    )
    t1 = time.time()
    results = main(
        pretrain_args(
            synthetic_shards, tmp_path, "train.steps=20", "train.checkpoint_every=5", "--resume"
        )
    )
    t2 = time.time()
    assert results["step"] == 20
    assert [r["step"] for r in rows(tmp_path)] == [5, 10, 15, 20]  # each step logged once
    assert json.loads((tmp_path / "results.json").read_text())["step"] == 20
    # wall_time_s is the whole run's: the first job's time up to its step-10 checkpoint (in
    # the checkpoint), then the resumed job's.
    saved = load_checkpoint(tmp_path / "checkpoints/step_00000010", rng=False)["wall_time_s"]
    assert 0 < saved <= first["wall_time_s"] <= t1 - t0
    assert 0 < results["wall_time_s"] - saved <= t2 - t1


def test_pretrain_counts_its_final_fewshot_in_wall_time_and_logs_it_once(
    synthetic_shards, tmp_path, capsys
):
    """wall_time_s ends after the final few-shot evaluation (a 2 s one here: it ended
    before it); the evaluation is one log line of percentages."""
    main = pipeline("pretrain")
    real = main.__globals__["fewshot_evaluate"]

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return real(*args, **kwargs)

    main.__globals__["fewshot_evaluate"] = slow
    few = [f"fewshot.train={synthetic_shards}", f"fewshot.eval={synthetic_shards}"]
    t0 = time.time()
    res = main(pretrain_args(synthetic_shards, tmp_path, "train.steps=2", *few))
    elapsed = time.time() - t0
    assert elapsed - 1.0 <= res["wall_time_s"] <= elapsed
    summary = res["fewshot"]["summary"]
    shown = ", ".join(f"{k[:-4]}-shot {100 * v:.1f}%" for k, v in summary.items())
    lines = [x for x in capsys.readouterr().err.splitlines() if "few-shot: " in x]
    assert len(lines) == 1 and f"few-shot: {shown} (96 test images, " in lines[0], lines


def test_bad_config_stops_before_starting(synthetic_shards, tmp_path):
    main = pipeline("pretrain")
    with pytest.raises(SystemExit, match="unknown config key 'train.stepz'"):
        main(pretrain_args(synthetic_shards, tmp_path, "train.stepz=3"))
    with pytest.raises(SystemExit, match="train.steps: expected int"):
        main(pretrain_args(synthetic_shards, tmp_path, "train.steps=many"))
    with pytest.raises(SystemExit, match="not found|no shards|does not exist"):
        main(pretrain_args(tmp_path / "nowhere", tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.system
def test_finetune_at_higher_resolution_improves(pretrained, synthetic_shards, tmp_path):
    ckpt = pretrained[0]  # a run directory: its newest valid checkpoint, recorded as such
    results = pipeline("finetune")(
        [
            *init_args(ckpt, synthetic_shards, tmp_path),
            "train.steps=60",
            "train.log_every=20",
            "eval_every=20",
            "ema=0.9",
        ]
    )
    log = rows(tmp_path)
    assert [r["step"] for r in log] == [20, 40, 60]
    # The zero head predicts class 0 for everything at step 0: 10 of 96 images (label = i % 10)
    # are class 0, so 0.104; a guess's std is ~0.03, so 0.18 is well clear of it.
    assert results["top1"] > 0.18 and "top1_ema" in log[-1]
    assert json.loads((tmp_path / "labels.json").read_text())[0] == "disc"
    assert (tmp_path / "model.safetensors").is_file()
    assert results["init"] == str(ckpt / "checkpoints" / "step_00000060")


def test_finetune_evaluates_every_eval_every_steps_between_log_steps(synthetic_shards, tmp_path):
    """eval_every is its own period: 3 with log_every 2 evaluates at 3 and 6 (a row of its own
    at 3, joined to the log row at 6), then the final evaluation at 7 completes the last row."""
    main = pipeline("finetune")
    extra = ["train.steps=7", "train.log_every=2", "eval_every=3", "train.warmup_steps=1"]
    results = main(
        [*finetune_args(synthetic_shards, tmp_path, *extra), f"data.eval={synthetic_shards}"]
    )
    log = rows(tmp_path)
    assert [r["step"] for r in log] == [2, 3, 4, 6, 7]
    assert [r["step"] for r in log if "top1" in r] == [3, 6, 7]
    assert "loss" not in log[1] and "loss" in log[2]  # step 3: the evaluation's row only
    assert results["top1"] == log[-1]["top1"]


def test_finetune_on_remote_shards_takes_the_class_names_of_its_data_eval(
    synthetic_shards, tmp_path
):
    """`pipe:` shards are read without their index.json: the head is sized by data.eval's class
    names (it was sized 0, and step 1 died on an IndexError), and without them the job stops
    in one line before anything is written."""
    remote = f"pipe:cat {synthetic_shards}/shard-{{000000..000001}}.tar"
    main = pipeline("finetune")
    with pytest.raises(SystemExit, match="class names are unknown .* data.eval names none"):
        main(finetune_args(remote, tmp_path / "a", "train.steps=2"))
    assert not (tmp_path / "a").exists()
    extra = ["train.steps=2", f"data.eval={synthetic_shards}"]
    results = main(finetune_args(remote, tmp_path / "b", *extra))
    names = json.loads((synthetic_shards / "index.json").read_text())["label_names"]
    assert results["label_names"] == names and results["num_classes"] == 10 == len(names)


def test_finetune_from_a_probe_head_starts_at_the_probe(pretrained, synthetic_shards, tmp_path):
    """init.head=probe (LP-FT): the first logged training accuracy is the probe's, far above
    the zero head's (which predicts class 0 for everything: about 3 of a batch of 32)."""
    extra = ["init.head=probe", "pool=gap", "train.steps=2", "train.log_every=1", "eval_every=0"]
    results = pipeline("finetune")([*init_args(pretrained[0], synthetic_shards, tmp_path), *extra])
    log = rows(tmp_path)
    assert log[0]["train_acc"] > 0.15 and results["top1"] > 0.15


def test_the_probe_head_is_fitted_once_per_run_at_the_evaluation_batch(
    pretrained, synthetic_shards, tmp_path, monkeypatch
):
    """LP-FT fits its head on a new run only (a resumed run's head is the checkpoint's), in
    batches of the per-process micro-batch (what the user sized to fit memory, not
    grad_accum times it), on the main process."""
    from ssl_vit.train import probe_head

    batches, fit = [], probe_head._fit
    monkeypatch.setattr(
        probe_head,
        "_fit",
        lambda m, s, i, plan, how: batches.append(plan.local_eval) or fit(m, s, i, plan, how),
    )
    extra = ["init.head=probe", "pool=gap", "train.grad_accum=2", "train.checkpoint_every=2"]
    main = pipeline("finetune")
    main([*init_args(pretrained[0], synthetic_shards, tmp_path), *extra, "train.steps=2"])
    assert batches == [16]  # train.batch_size 32 / grad_accum 2
    main(
        [*init_args(pretrained[0], synthetic_shards, tmp_path), *extra, "train.steps=3", "--resume"]
    )
    assert batches == [16]  # not fitted again over the checkpoint's head


def test_finetune_rejects_other_architecture(pretrained, synthetic_shards, tmp_path):
    ckpt = pretrained[0] / "checkpoints" / "step_00000060"
    with pytest.raises(SystemExit, match=r"model.width=64 disagrees .* \(width 32\)"):
        pipeline("finetune")([*init_args(ckpt, synthetic_shards, tmp_path), "model.width=64"])


def test_fewshot_pipeline_random_and_pretrained(pretrained, synthetic_shards, tmp_path):
    main = pipeline("fewshot")
    common = [
        "--config",
        str(ROOT / "configs/fewshot/smoke.yaml"),
        f"fewshot.train={synthetic_shards}",
        f"fewshot.eval={synthetic_shards}",
    ]
    rand = main(["--checkpoint", "random", *common, f"output_dir={tmp_path / 'r'}"])
    res = main(
        [
            "--checkpoint",
            str(pretrained[0]),  # a run directory: its newest valid checkpoint
            *common,
            f"output_dir={tmp_path / 'p'}",
        ]
    )
    for r in (rand, res):
        assert set(r["shots"]) == {1, 5} and set(r["shots"][5]["l2_reg"]) == {"1024.0", "1.0"}
        assert len(r["shots"][5]["l2_reg"]["1024.0"]["per_seed"]) == 2
        assert r["num_test"] == 96 and 0.0 <= r["5shot"] <= 1.0
    saved = json.loads((tmp_path / "p" / "results.json").read_text())
    assert saved["checkpoint"] == str(pretrained[0] / "checkpoints" / "step_00000060")
    assert saved["summary"]["5shot"] == pytest.approx(res["5shot"])
