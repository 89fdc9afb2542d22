"""scripts/study.py end to end on the synthetic fixture: every job runs, the summary table is
written, and a second invocation skips every finished job."""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ssl_vit import jobs
from ssl_vit.config import ConfigError, StudyConfig, from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


def load_study():
    spec = importlib.util.spec_from_file_location("study", REPO / "scripts/study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["study"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def in_process(argv, log, threads=0):
    """The study's job starter, in this process: the pipeline's main(argv) run to its end, no
    process started; what it returns is the ended job's process for the study."""
    script = Path(argv[1])
    spec = importlib.util.spec_from_file_location(f"pipeline_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv[2:])
    return SimpleNamespace(poll=lambda: 0, wait=lambda timeout=None: 0)


@pytest.mark.system
def test_study_runs_summarizes_and_skips(synthetic_shards, tmp_path, capsys, monkeypatch):
    out = tmp_path / "study"
    small = ["data.num_workers=0"]
    cfg = {
        "data": {"train": str(synthetic_shards), "eval": str(synthetic_shards)},
        "pretrain_config": str(REPO / "configs/pretrain/smoke.yaml"),
        "fewshot_config": str(REPO / "configs/fewshot/smoke.yaml"),
        "finetune_config": str(REPO / "configs/finetune/smoke.yaml"),
        "variants": [{"name": "l2", "objective": {"target": "pixels_l2", "mask_ratio": 0.25}}],
        "quick": {
            "output_dir": str(out),
            "model": {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "heads": 2},
            "finetune_image_size": 24,
            "pretrain": ["train.steps=3", "train.log_every=1", "train.checkpoint_every=0"],
            "fewshot": [
                *("fewshot.shots=[1]", "fewshot.seeds=[0]", "fewshot.l2_reg=[1.0]"),
                "fewshot.num_workers=0",
            ],
            "finetune": ["train.steps=2", "train.log_every=1", "train.batch_size=8", *small],
        },
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    study = load_study()
    monkeypatch.setattr(study, "start", in_process)
    # The report over the runs is `ssl-vit report`'s (its own tests): here, that the study asks
    # for it over every run, without the seconds of a report process.
    reported = []
    monkeypatch.setattr(study, "report", lambda dirs, where: reported.append((dirs, where)))
    summary = study.main(["--config", str(path), "--quick"])
    assert len(reported) == 1 and reported[0][1] == out
    assert sorted(d.relative_to(out).as_posix() for d in reported[0][0]) == [
        "fewshot/l2", "fewshot/random", "finetune/l2", "finetune/scratch", "pretrain/l2"
    ]  # fmt: skip

    rows = {r["variant"]: r for r in summary["rows"]}
    assert set(rows) == {"random init", "l2"}
    assert rows["l2"]["pretrain_steps"] == 3 and rows["random init"]["pretrain_steps"] == 0
    assert rows["l2"]["objective"]["target"] == "pixels_l2"
    pre = yaml.safe_load((out / "pretrain/l2/config.yaml").read_text())
    assert pre["objective"]["mask_ratio"] == 0.25 and pre["model"]["depth"] == 1
    ft = yaml.safe_load((out / "finetune/l2/config.yaml").read_text())
    assert ft["model"]["image_size"] == 24 and ft["init"]["checkpoint"].endswith("step_00000003")
    for r in rows.values():
        assert 0.0 <= r["fewshot"]["1"]["mean"] <= 1.0 and 0.0 <= r["finetune_top1"] <= 1.0
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| random init | 0 | - |")

    capsys.readouterr()
    study.main(["--config", str(path), "--quick"])  # everything exists: nothing runs again
    second = capsys.readouterr().out
    assert second.count("[skip]") == 5 and "[run]" not in second
    # Another budget in the same directory is refused, not mistaken for this one's results.
    with pytest.raises(SystemExit, match="another command"):
        study.main(["--config", str(path), "--quick", "quick.model.depth=2"])


def test_study_config_rejects_bad_variants():
    data = {"data": {"train": "a", "eval": "b"}}
    with pytest.raises(ConfigError, match="unique"):
        from_dict(StudyConfig, {**data, "variants": [{"name": "x"}, {"name": "x"}]})
    with pytest.raises(ConfigError, match="objective.target"):
        from_dict(StudyConfig, {**data, "variants": [{"name": "x", "objective": {"target": "y"}}]})
    with pytest.raises(ConfigError, match="unknown config key 'quick.steps'"):
        from_dict(StudyConfig, {**data, "variants": [{"name": "x"}], "quick": {"steps": 1}})


def test_only_plans_one_chain_of_the_gpu_preset(tmp_path, capsys):
    """`--only NAME` plans exactly that variant's pretrain -> few-shot -> fine-tune (or the two
    baselines), in the `gpu` budget of the shipped config; an unknown name is refused."""
    study = load_study()
    cfg = [f"gpu.output_dir={tmp_path / 'gpu'}"]
    base = ["--config", str(REPO / "configs/study/cifar10.yaml"), "--preset", "gpu", "--dry-run"]
    study.main([*base, "--only", "color_4x4", *cfg])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    assert [line.split(":")[0] for line in plan] == [
        "[plan] pretrain/color_4x4",
        "[plan] fewshot/color_4x4",
        "[plan] finetune/color_4x4",
    ]
    assert "fewshot.knn_k=20" in plan[0] and "model.width=384" in plan[0]
    assert "fewshot.layers=all" in plan[1] and "fewshot.pool=cls+gap" in plan[1]
    assert "model.image_size=48" in plan[2]
    study.main([*base, "--only", "baseline", *cfg])
    out = capsys.readouterr().out
    assert "[plan] fewshot/random:" in out and "[plan] finetune/scratch:" in out
    assert out.count("[plan]") == 2
    with pytest.raises(SystemExit, match="no such variant"):
        study.main([*base, "--only", "nope", *cfg])
    assert not (tmp_path / "gpu").exists()  # a dry run writes nothing


def test_an_override_of_a_budget_the_run_does_not_use_is_refused(tmp_path, capsys):
    """quick.output_dir=... without --quick would change nothing: one line, naming the key and
    the budget in use; with --quick the same override plans into that directory."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run"]
    out = f"quick.output_dir={tmp_path / 'q'}"
    with pytest.raises(
        SystemExit, match="^error: quick.output_dir: this run uses the `full` budget"
    ):
        study.main([*base, out])
    with pytest.raises(SystemExit, match="^error: full.pretrain: this run uses the `gpu` budget"):
        study.main([*base, "--preset", "gpu", "full.pretrain=[]"])
    study.main([*base, "--quick", out])
    assert str(tmp_path / "q") in capsys.readouterr().out
    assert not (tmp_path / "q").exists()  # a dry run writes nothing


def test_copy_small_leaves_the_checkpoints_out(tmp_path):
    out = tmp_path / "study"
    (out / "pretrain/x/checkpoints/step_00000001").mkdir(parents=True)
    (out / "pretrain/x/checkpoints/step_00000001/model.safetensors").write_bytes(b"big")
    (out / "pretrain/x/results.json").write_text("{}")
    (out / "summary.md").write_text("| table |")
    load_study().copy_small(out, tmp_path / "small")
    assert (tmp_path / "small/pretrain/x/results.json").is_file()
    assert (tmp_path / "small/summary.md").is_file()
    assert not (tmp_path / "small/pretrain/x/checkpoints").exists()


def test_recipes_fine_tune_each_variant_and_scratch_once_per_recipe(tmp_path, capsys):
    """`recipes:` plans finetune/<variant>-<recipe> for every variant and the scratch baseline,
    each recipe's overrides after the budget's, and the summary has one column per recipe."""
    study = load_study()
    recipes = "recipes=[{name: paper}, {name: modern, finetune: [recipe=modern, train.lr=1e-4]}]"
    out = tmp_path / "quick"
    base = ["--config", str(REPO / "configs/study/cifar10.yaml"), "--quick", "--dry-run"]
    over = [f"quick.output_dir={out}", recipes]
    study.main([*base, "--only", "mean_color_15", *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    assert [line.split(":")[0] for line in plan] == [
        "[plan] pretrain/mean_color_15",
        "[plan] fewshot/mean_color_15",
        "[plan] finetune/mean_color_15-paper",
        "[plan] finetune/mean_color_15-modern",
    ]
    assert f"output_dir={out}/finetune/mean_color_15-modern" in plan[3]
    assert plan[3].endswith("data.max_eval=5000 recipe=modern train.lr=1e-4")  # after budget
    assert "recipe=" not in plan[2] and plan[2].endswith("data.max_eval=5000")
    study.main([*base, "--only", "baseline", *over])
    lines = capsys.readouterr().out
    assert "[plan] finetune/scratch-paper:" in lines and "[plan] finetune/scratch-modern:" in lines
    assert lines.count("[plan]") == 3 and not out.exists()  # a dry run writes nothing

    cfg = study.load_config(StudyConfig, REPO / "configs/study/cifar10.yaml", over)
    for name, top1 in [("scratch-paper", 0.5), ("scratch-modern", 0.625)]:
        (out / "finetune" / name).mkdir(parents=True)
        (out / "finetune" / name / "results.json").write_text(json.dumps({"top1": top1}))
    # Few-shot at 10 shots and `all` (the full linear probe): columns in that order.
    few = {k: {"l2_reg": {"1024": {"mean": m, "std": 0.0}}} for k, m in [("all", 0.4), ("10", 0.2)]}
    (out / "fewshot/random").mkdir(parents=True)
    (out / "fewshot/random/results.json").write_text(json.dumps({"shots": few}))
    summary = study.summarize(cfg, cfg.quick, out, "quick")
    assert summary["rows"][0]["finetune_by_recipe"] == {"paper": 0.5, "modern": 0.625}
    assert summary["rows"][1]["finetune_by_recipe"] == {"paper": None, "modern": None}
    head, _, scratch, *_ = (out / "summary.md").read_text().splitlines()
    assert "| 10-shot (%) | all-shot (%) |" in head
    assert "| fine-tune top-1 (paper) (%) | fine-tune top-1 (modern) (%) |" in head
    assert "| 20.0 ± 0.0 | 40.0 ± 0.0 | 50.0 | 62.5 |" in scratch

    with pytest.raises(SystemExit, match="recipes: need unique names that are simple"):
        study.main([*base, f"quick.output_dir={out}", "recipes=[{name: a-b}]"])


def test_one_recipe_keeps_its_fine_tune_wall_time(tmp_path):
    """With one recipe the fine-tune runs as finetune/<name>-<recipe>: the summary's fine-tune
    wall time is that run's (it read finetune/<name>, which does not exist, before)."""
    study, out = load_study(), tmp_path / "quick"
    over = [f"quick.output_dir={out}", "recipes=[{name: paper}]"]
    cfg = study.load_config(StudyConfig, REPO / "configs/study/cifar10.yaml", over)
    (out / "finetune/scratch-paper").mkdir(parents=True)
    (out / "finetune/scratch-paper/results.json").write_text('{"top1": 0.5, "wall_time_s": 60}')
    (out / "fewshot/random").mkdir(parents=True)
    (out / "fewshot/random/results.json").write_text(json.dumps({"shots": {}}))
    scratch = study.summarize(cfg, cfg.quick, out, "quick")["rows"][0]
    assert scratch["finetune_by_recipe"] == {"paper": 0.5}
    assert scratch["wall_time_s"]["finetune"] == 60


@pytest.mark.system
@pytest.mark.parametrize("stage", [jobs.FEWSHOT, jobs.PRETRAIN], ids=["fewshot", "pretrain"])
def test_a_stop_during_a_job_is_a_stop_not_a_failure(tmp_path, capsys, stage):
    """SIGTERM to the study mid-job: forwarded once to the real child process. A few-shot job
    ends on the signal (exit -15), which is a stop (exit 0, '[stop]'); a pretraining job
    that ends on it instead of checkpointing has failed."""
    import os
    import signal
    import threading
    import time

    study = load_study()
    ready = tmp_path / "ready"
    script = tmp_path / "job.py"
    script.write_text(f"import pathlib, time\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)")
    job = study.Job(stage, "x", tmp_path / "run", lambda: [sys.executable, str(script)])
    original = signal.getsignal(signal.SIGTERM)

    def stop_once_forwarding() -> None:
        # Deterministic: the study's forwarding handler is installed and the child is running.
        while not ready.exists() or signal.getsignal(signal.SIGTERM) is original:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_forwarding, daemon=True).start()
    with pytest.raises(SystemExit) as stop:
        study.run_jobs([job], 1, tmp_path, study.StudyProgress([job], enabled=True))
    assert signal.getsignal(signal.SIGTERM) is original  # restored
    assert study.STOPPED == ["SIGTERM"]
    if stage is jobs.FEWSHOT:
        assert stop.value.code == 0
        assert "[stop] fewshot/x: SIGTERM" in capsys.readouterr().out
    else:
        assert "error: pretrain/x failed (exit -15)" in str(stop.value.code)


def test_seed_reaches_every_job_after_the_budget(tmp_path, capsys):
    """`seed=N`: every job of the study gets `seed=N` right after its budget's overrides (a
    recipe's come after it); without it, no job is given a seed."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/classifier.yaml"), "--quick", "--dry-run"]
    study.main([*base, f"quick.output_dir={tmp_path}", "seed=3"])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    assert len(plan) == 15 and all(" seed=3" in line for line in plan)
    finetunes = [line for line in plan if line.startswith("[plan] finetune/")]
    assert all(
        line.endswith(
            ("data.max_eval=5000 seed=3 train.lr=0.03", "data.max_eval=5000 seed=3 recipe=modern")
        )
        for line in finetunes
    )
    assert all(line.endswith("seed=3") for line in plan if "finetune/" not in line)
    study.main([*base, f"quick.output_dir={tmp_path}"])
    assert "seed=" not in capsys.readouterr().out.replace("seeds=", "")


def test_a_study_stopped_during_pretraining_plans_again(tmp_path, capsys):
    """The quick start stopped (Ctrl-C) during pretraining, then run again: the pretraining's
    results.json of a stop names no checkpoint, and planning its fine-tunes raised KeyError;
    they take the placeholder until it has finished, then its final checkpoint."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run"]
    argv = [*base, f"full.output_dir={tmp_path}"]
    pre = tmp_path / "pretrain" / "mean_color_50"
    pre.mkdir(parents=True)
    final = {"step": 900, "checkpoint": "x/checkpoints/step_00000900"}
    for results, ckpt in [
        ({"step": 588, "preempted": True}, f"<final checkpoint of {pre}>"),
        (final, f"{pre}/checkpoints/step_00000900"),
    ]:
        (pre / "results.json").write_text(json.dumps(results))
        study.main(argv)
        plan = [x for x in capsys.readouterr().out.splitlines() if "finetune/mean_color_50" in x]
        assert plan and all(f"init.checkpoint={ckpt}" in x for x in plan), plan[:2]


def test_label_budgets_and_seeds_give_one_fine_tune_each(tmp_path, capsys):
    """`labels:` x `finetune_seeds:` plans finetune/<encoder>-l<K>-s<seed> for every encoder,
    each with its budget's and seed's overrides last; the summary has one column per budget,
    the seeds' mean then each seed's top-1."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/labels.yaml"), "--quick", "--dry-run"]
    over = [f"quick.output_dir={tmp_path}"]
    study.main([*base, "--only", "baseline", *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    names = [line.split(":")[0].removeprefix("[plan] ") for line in plan]
    assert names == ["fewshot/random"] + [
        f"finetune/scratch-l{k}-s{s}" for k in (50, 500) for s in (0, 1)
    ]
    assert plan[4].endswith("data.num_workers=1 data.labels_per_class=500 seed=1")
    assert "init.checkpoint=none" in plan[4] and "fewshot.shots=[50, 500]" in plan[0]

    cfg = study.load_config(StudyConfig, REPO / "configs/study/labels.yaml", over)
    for name, top1 in [("l50-s0", 0.25), ("l50-s1", 0.35), ("l500-s0", 0.5)]:
        run = tmp_path / "finetune" / f"scratch-{name}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"top1": top1, "num_labelled": 500}))
    summary = study.summarize(cfg, cfg.quick, tmp_path, "quick")
    columns = summary["rows"][0]["finetune_by_labels"]
    assert {c: v["top1"] for c, v in columns.items()} == {
        "50/class": [0.25, 0.35],
        "500/class": [0.5],
    }
    assert columns["50/class"]["labels_per_class"] == 50
    head, _, scratch, *_ = (tmp_path / "summary.md").read_text().splitlines()
    assert "| fine-tune 50/class (%) | fine-tune 500/class (%) |" in head
    assert "| 30.0 (25.0 / 35.0) | 50.0 |" in scratch
    with pytest.raises(SystemExit, match="finetune_seeds: need distinct values >= 0"):
        study.main([*base, *over, "finetune_seeds=[1, 1]"])


def test_job_status_reads_the_running_jobs_metrics(tmp_path):
    study = load_study()
    assert study.job_status(tmp_path) is None  # not started
    (tmp_path / "config.yaml").write_text("train: {steps: 1200, batch_size: 64}\n")
    rows = [{"step": 300, "img_per_s": 100.0}, {"step": 350, "img_per_s": 400.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # (1200 - 350) steps x 64 images / 400 img/s = 136 s
    assert study.job_status(tmp_path) == "step 350/1200, 400 img/s, eta 2m16s"
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40')  # a row being written: no status this time, no error
    assert study.job_status(tmp_path) is None


FAKE_JOB = """import json, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / "config.yaml").write_text("train: {steps: 4, batch_size: 8}\\n")
for step in range(1, 5):
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "img_per_s": 8.0}) + "\\n")
    t0 = time.time()
    while not (out / f"seen{step}").exists():  # until the study has shown this step
        time.sleep(0.02)
        if time.time() - t0 > 60:
            sys.exit(f"step {step} was never shown")
"""


@pytest.mark.system
def test_the_running_job_shows_its_own_progress(tmp_path, monkeypatch):
    """While a (real) job runs, the study prints its step, img/s and ETA from its metrics."""
    study = load_study()
    monkeypatch.setattr(study, "POLL_S", 0.05)
    monkeypatch.setattr(study, "STATUS_EVERY_S", 0.0)
    script, out = tmp_path / "job.py", tmp_path / "run"
    script.write_text(FAKE_JOB)
    out.mkdir()
    said = []

    def say(line):
        said.append(line)
        if "step " in line:  # let the job go on to its next step
            (out / f"seen{line.split('step ')[1].split('/')[0]}").touch()

    job = study.Job(jobs.PRETRAIN, "x", out, lambda: [sys.executable, str(script), str(out)])
    bar = study.StudyProgress([job], enabled=False)
    bar.bar.write = say
    study.run_jobs([job], 1, tmp_path, bar)
    assert said[-1].startswith("[done] pretrain/x")
    shown = [line.strip() for line in said if "step " in line]
    assert shown == [f"pretrain/x: step {s}/4, 8 img/s, eta {4 - s}s" for s in range(1, 5)]


def test_self_training_follows_its_teacher_and_gets_a_row(tmp_path, capsys):
    """`self_train:` on a budget plans, after each pretrained encoder's fine-tunes, one
    fine-tune per seed with that seed's fine-tune as distill.teacher and data.train as
    distill.unlabelled. The quick start's self-training changes only distill.* keys, so its
    equal-compute control is that fine-tune itself (the same command): no run of its own. The
    summary's rows "<encoder> + control of self-trained" (those fine-tunes) and "+ self-trained"
    fill that budget only, and the method's row names its control (the online stage has a
    schedule and a control of its own: the test after the next)."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run"]
    over = [f"full.output_dir={tmp_path}"]
    study.main([*base, *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    names = [line.split(":")[0].removeprefix("[plan] ") for line in plan]
    v = "mean_color_50"
    # (then the online stage's four runs and their controls: tests of their own below)
    assert names[-6:-4] == [f"finetune/{v}-l10-st-s{s}" for s in (0, 1)]
    assert not any("-st-ctl" in n or "scratch-l10-st" in n for n in names)
    assert names.index(f"finetune/{v}-l10-s1") < names.index(f"finetune/{v}-l10-st-s0")
    last, teacher = plan[-5], plan[names.index(f"finetune/{v}-l10-s1")]
    assert f"distill.teacher={tmp_path}/finetune/{v}-l10-s1" in last
    assert "distill.unlabelled=data/shapes" in last and "init.checkpoint=" in last
    assert last.endswith("data.labels_per_class=10 train.steps=60 seed=1 distill.temperature=2")
    # The control (the teacher): the same job line without the teacher and its unlabelled
    # images (the same overrides, the encoder's and the seed's in another order).
    job = lambda line: sorted(line.split(" --resume ")[1].replace("-st-", "-").split())  # noqa: E731
    assert [o for o in job(last) if not o.startswith("distill.")] == job(teacher)

    cfg = study.load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", over)
    made = [("l10-s0", 0.25), ("l10-s1", 0.27), ("l10-st-s0", 0.3), ("l10-st-s1", 0.32)]
    for name, top1 in made:
        run = tmp_path / "finetune" / f"{v}-{name}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"top1": top1, "num_labelled": 100}))
    rows = study.summarize(cfg, cfg.full, tmp_path, "full")["rows"]
    # (the quick start's 100 labels picked by typiclust and at random: rows of their own)
    picked = [f"{v} + 100 labels chosen by typiclust", f"{v} + 100 random labels"]
    semi = [f"{v} + control of semi-supervised", f"{v} + semi-supervised"]
    control = f"{v} + control of self-trained"
    names = ["random init", v, *picked, control, f"{v} + self-trained", *semi]
    assert [r["variant"] for r in rows] == names
    rows = [r for r in rows if r["variant"] not in semi]
    rows = [r for r in rows if r["variant"] not in picked]
    assert rows[1]["finetune_by_labels"]["10/class"]["top1"] == [0.25, 0.27]
    assert rows[2]["finetune_by_labels"]["10/class"]["top1"] == [0.25, 0.27]  # the same runs
    assert rows[3]["finetune_by_labels"]["10/class"]["top1"] == [0.3, 0.32]
    assert rows[3]["finetune_by_labels"]["50/class"]["top1"] == []
    assert rows[3]["control"] == control and "control" not in rows[1]
    table = (tmp_path / "summary.md").read_text().splitlines()
    assert table[-1].startswith(f"| {v} + semi-supervised |")  # its runs not made here
    assert table[-3].startswith(f"| {v} + self-trained |") and "| 31.0 (30.0 / 32.0) |" in table[-3]
    assert table[-4].startswith(f"| {control} |") and "| 26.0 (25.0 / 27.0) |" in table[-4]


def test_every_method_row_stands_beside_a_control_that_exists():
    """A row of a method beyond the paper that names no existing control is refused: the
    study never reports a gain without its equal-compute control (issue 49)."""
    from ssl_vit.study.summary import check_controls

    method = {"variant": "v + st", "control": "v + control"}
    rows = [{"variant": "v"}, {"variant": "v + control"}, method]
    check_controls(rows)
    with pytest.raises(ConfigError, match="'v \\+ st' names control 'v \\+ ctl'"):
        check_controls([*rows[:2], {"variant": "v + st", "control": "v + ctl"}])
    with pytest.raises(ConfigError, match="control"):
        check_controls([rows[0], rows[2]])  # the control row left out


def test_labels_picked_by_typiclust_stand_beside_their_random_control(tmp_path, capsys):
    """`{budget: N, select: typiclust}` plans finetune/<encoder>-lN-typiclust[-s<seed>] for
    each pretrained encoder (none from scratch), its random control -lN-random the same way,
    each seed drawing its own pick (`data.labels_seed` = the seed);
    the summary shows them as rows "<encoder> + N labels chosen by typiclust" (naming its
    control) and "+ N random labels", in an "N labels" column. A typiclust entry without the
    random one of its budget and fine-tuning overrides is refused in one line."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run"]
    over = [f"full.output_dir={tmp_path}"]
    study.main([*base, *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    names = [line.split(":")[0].removeprefix("[plan] ") for line in plan]
    v = "mean_color_50"
    picked = [f"finetune/{v}-l100-{m}-s{s}" for m in ("typiclust", "random") for s in (0, 1)]
    assert [n for n in names if "l100" in n] == picked
    for name in picked:
        line = plan[names.index(name)]
        method = name.split("-")[-2]
        # Each seed is its own pick and its own fine-tune (a pick's luck is part of a method's
        # spread); the balanced rows keep one subset for every seed and encoder.
        seed = name[-1]
        assert line.endswith(f"data.labels_select={method} data.labels_budget=100 "
                             f"train.steps=60 seed={seed} data.labels_seed={seed}")  # fmt: skip
        assert "init.checkpoint=<final checkpoint" in line
    for line in (line for n, line in zip(names, plan, strict=True) if "-l10-s" in n):
        assert "data.labels_seed" not in line
    cfg = study.load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", over)
    made = [("l100-typiclust-s0", 0.5), ("l100-typiclust-s1", 0.6), ("l100-random-s0", 0.4)]
    for name, top1 in made:
        run = tmp_path / "finetune" / f"{v}-{name}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({"top1": top1, "num_labelled": 100}))
    rows = {r["variant"]: r for r in study.summarize(cfg, cfg.full, tmp_path, "full")["rows"]}
    typiclust, random = (
        rows[f"{v} + 100 labels chosen by typiclust"],
        rows[f"{v} + 100 random labels"],
    )
    assert typiclust["control"] == f"{v} + 100 random labels" and "control" not in random
    assert typiclust["finetune_by_labels"]["100 labels"]["top1"] == [0.5, 0.6]
    assert random["finetune_by_labels"]["100 labels"]["top1"] == [0.4]
    assert random["finetune_by_labels"]["100 labels"]["labels_budget"] == 100
    assert rows[v]["finetune_by_labels"]["100 labels"]["top1"] == []
    assert typiclust["finetune_by_labels"]["10/class"]["top1"] == []
    table = (tmp_path / "summary.md").read_text()
    assert "| fine-tune 100 labels (%) |" in table.splitlines()[0]
    assert (
        f"| {v} + 100 labels chosen by typiclust |" in table and "| 55.0 (50.0 / 60.0) |" in table
    )
    refused = [
        "labels=[{budget: 100, select: typiclust}]",
        "labels=[{budget: 100, select: typiclust}, {budget: 50, select: random}]",
        "labels=[{budget: 100, select: typiclust, finetune: [train.steps=9]}, "
        "{budget: 100, select: random}]",
    ]
    for labels in refused:
        with pytest.raises(SystemExit) as e:
            study.main([*base, *over, labels])
        assert "needs its equal-compute control {budget: 100, select: random}" in str(e.value)
        assert "\n" not in str(e.value)
    for labels, key in [
        ("labels=[{budget: 100}]", "budget needs select: random or typiclust"),
        ("labels=[{select: random}]", "needs a budget >= 1"),
        ("labels=[{budget: 5, select: random, per_class: 2}]", "needs a budget >= 1, and no"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", [*over, labels])


def test_a_variant_fine_tunes_its_own_way_and_only_the_chosen_one_self_trains(tmp_path, capsys):
    """A variant's `finetune:` overrides follow the label budget's in its fine-tunes and its
    self-trainings (before `self_train`'s); `self_train: false` plans none for that encoder and
    gives it no self-trained row (configs/study/labels.yaml: the visible arm gently, the
    paper's objective with the paper's recipe)."""
    study = load_study()
    config = str(REPO / "configs/study/labels.yaml")
    over = [f"quick.output_dir={tmp_path}"]
    study.main(["--config", config, "--quick", "--dry-run", *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    by_name = {line.split(":")[0].removeprefix("[plan] "): line for line in plan}
    own = "pool=gap init.head=probe parts.layer_decay=0.7"
    assert by_name["finetune/visible_75-l500-s1"].endswith(f"per_class=500 seed=1 {own}")
    st = f"per_class=500 {own} seed=1 distill.temperature=2"
    assert by_name["finetune/visible_75-l500-st-s1"].endswith(st)
    assert by_name["finetune/paper_mpp-l500-s1"].endswith("data.labels_per_class=500 seed=1")
    assert not any("paper_mpp-l" in n and "-st-" in n for n in by_name)
    assert not any("scratch" in n and "layer_decay" in line for n, line in by_name.items())

    cfg = study.load_config(StudyConfig, config, over)
    rows = study.summarize(cfg, cfg.quick, tmp_path, "quick")["rows"]
    names = ["random init", "visible_75", "visible_75 + control", "visible_75 + self-trained",
             "paper_mpp"]  # fmt: skip
    assert [r["variant"] for r in rows] == names
    with pytest.raises(ConfigError, match="variants: v: finetune: .*'train.lr'"):
        from_dict(StudyConfig, {"data": {"train": "a", "eval": "b"},
                                "variants": [{"name": "v", "finetune": ["train.lr"]}]})  # fmt: skip


def test_jobs_weigh_the_images_they_train_on():
    """The study's progress counts each job by train.steps x train.batch_size (x 2 when
    self-training with one unlabelled image per labelled one), so its ETA does not grow while
    the long pretraining job runs."""
    from ssl_vit.study.jobs import FEWSHOT_WEIGHT, images_trained, plan

    cfg = load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", [])
    weights = {f"{j.stage.name}/{j.name}": j.weight for j in plan(cfg, cfg.full, Path("x"))}
    assert weights["pretrain/mean_color_50"] == 900 * 64
    assert weights["finetune/scratch-l10-s0"] == 60 * 32
    assert weights["finetune/mean_color_50-lall-s1"] == 150 * 32
    assert weights["finetune/mean_color_50-l10-st-s0"] == 60 * 32 * 2
    assert weights["fewshot/random"] == FEWSHOT_WEIGHT
    smoke = (jobs.FINETUNE, "configs/finetune/smoke.yaml")
    assert images_trained(*smoke, ["distill.ratio=3"]) == 20 * 32
    st = ["distill.teacher=t", "distill.unlabelled=u", "distill.ratio=3"]
    assert images_trained(*smoke, st) == 20 * 32 * 4


def test_a_jobs_weight_is_the_batch_its_loaded_config_trains_with(tmp_path):
    """A fine-tune config that leaves train.batch_size to the schema (512) weighs steps x 512,
    the batch the job trains with, not steps x 1 (a read of the raw YAML without the key)."""
    from ssl_vit.study.jobs import plan

    ft = tmp_path / "ft.yaml"
    ft.write_text(
        (REPO / "configs/finetune/smoke.yaml").read_text().replace("batch_size: 32, ", "")
    )
    overrides = [f"finetune_config={ft}", "full.finetune=[train.steps=500]"]
    cfg = load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", overrides)
    weights = {f"{j.stage.name}/{j.name}": j.weight for j in plan(cfg, cfg.full, Path("x"))}
    assert weights["finetune/scratch-l10-s0"] == 60 * 512
    assert weights["finetune/mean_color_50-l10-st-s0"] == 60 * 512 * 2


def test_the_study_bar_moves_while_a_job_runs_and_skips_leave_the_total(tmp_path):
    study = load_study()
    planned = [study.Job(jobs.PRETRAIN, "a", tmp_path, list, weight=w) for w in (100, 900, 300)]
    bar = study.StudyProgress(planned, enabled=False)
    assert bar.bar.total == 1300
    bar.ended(planned[0], skipped=True)  # done before: no work this time
    assert (bar.bar.total, bar.bar.n) == (1200, 0)
    bar.running(planned[1], 0.5)
    bar.running(planned[1], 0.25)  # never backwards
    assert bar.bar.n == 450
    bar.ended(planned[1], skipped=False)
    bar.running(planned[2], 1 / 3)
    assert bar.bar.n == 900 + 100
    # The job's own fraction, from its config.yaml and last metrics row.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {steps: 200, batch_size: 8}\n")
    assert study.job_fraction(run) is None
    (run / "metrics.jsonl").write_text('{"step": 50, "img_per_s": 10}\n')
    assert study.job_fraction(run) == 0.25


def test_the_semi_supervised_stage_shares_the_self_trainings_control(tmp_path, capsys):
    """`semi:` on a budget plans, per pretrained encoder and seed, a fine-tune with
    distill.mode=online and data.train as distill.unlabelled (no teacher file), beside the
    same equal-compute control as `self_train` (planned once); the summary's row "<encoder> +
    semi-supervised" names that control. Schedules that differ get a control each."""
    study = load_study()
    base = ["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run"]
    labels = (
        "labels=[{per_class: 10, finetune: [train.steps=60], self_train: [train.steps=150, "
        "distill.temperature=2], semi: [train.steps=150, distill.threshold=0.7]}]"
    )
    over = [f"full.output_dir={tmp_path}", labels]
    study.main([*base, *over])
    plan = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[plan]")]
    names = [line.split(":")[0].removeprefix("[plan] ") for line in plan]
    v = "mean_color_50"
    runs = [f"{v}-l10-{m}-s{s}" for s in (0, 1) for m in ("ctl", "st")]
    runs += [f"{v}-l10-semi-s{s}" for s in (0, 1)]
    assert names[-6:] == [f"finetune/{r}" for r in runs]  # each control once
    semi, control = plan[-1], plan[names.index(f"finetune/{v}-l10-ctl-s1")]
    assert "distill.mode=online distill.unlabelled=data/shapes" in semi
    assert "distill.teacher" not in semi
    assert semi.endswith("seed=1 train.steps=150 distill.threshold=0.7")
    assert control.endswith("seed=1 train.steps=150 tag=control")

    cfg = study.load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", over)
    # The online row and its control averaged their weights (`ema`): top1_ema beside top1.
    results = [("l10-ctl-s0", 0.3, 0.32), ("l10-st-s0", 0.31, None), ("l10-semi-s0", 0.4, 0.43)]
    for name, top1, top1_ema in results:
        run = tmp_path / "finetune" / f"{v}-{name}"
        run.mkdir(parents=True)
        got = {"top1": top1, "top1_ema": top1_ema, "num_labelled": 100}
        (run / "results.json").write_text(json.dumps(got))
    rows = {r["variant"]: r for r in study.summarize(cfg, cfg.full, tmp_path, "full")["rows"]}
    semi_row = rows[f"{v} + semi-supervised"]
    assert semi_row["control"] == f"{v} + control"
    assert rows[f"{v} + self-trained"]["control"] == f"{v} + control"
    assert semi_row["finetune_by_labels"]["10/class"]["top1"] == [0.4]
    assert semi_row["finetune_by_labels"]["10/class"]["top1_ema"] == [0.43]
    assert rows[f"{v} + control"]["finetune_by_labels"]["10/class"]["top1"] == [0.3]
    assert rows[f"{v} + self-trained"]["finetune_by_labels"]["10/class"]["top1_ema"] == []
    table = {line.split(" | ")[0].removeprefix("| "): line
             for line in (tmp_path / "summary.md").read_text().splitlines()}  # fmt: skip
    head = "| fine-tune 10/class (%) | fine-tune 10/class, averaged weights (%) |"
    assert head in table["variant"]
    assert "| 40.0 | 43.0 |" in table[f"{v} + semi-supervised"]
    assert "| 30.0 | 32.0 |" in table[f"{v} + control"]
    assert "| 31.0 | - |" in table[f"{v} + self-trained"]


SLOT_JOB = """import json, os, pathlib, signal, sys, time
run, events, name, mode, after = pathlib.Path(sys.argv[1]), *sys.argv[2:6]
torch = sys.modules.get("torch")  # forked from the study: torch imported, its threads set
threads = torch.get_num_threads() if torch else None
def say(what):
    with open(events, "a") as f:
        f.write(f"{what} {name} {os.environ.get('OMP_NUM_THREADS')} {threads}\\n")
signal.signal(signal.SIGTERM, lambda *_: (say("term"), sys.exit(0)))
say("start")
end = time.monotonic() + 60
while after and f"start {after} " not in open(events).read():  # both running: no race
    assert time.monotonic() < end, f"{after} never started beside {name}"
    time.sleep(0.01)
if mode == "fail":
    say("fail")
    sys.exit(3)
while mode == "long" and time.monotonic() < end:
    time.sleep(0.02)
run.mkdir(parents=True, exist_ok=True)
(run / "results.json").write_text(json.dumps({"top1": 1.0}))
say("end")
"""


def slot_jobs(study, tmp_path, spec):
    """Jobs running SLOT_JOB: (name, mode, the jobs it needs, a job it waits to see started
    before it ends), in the plan's order."""
    script, events = tmp_path / "job.py", tmp_path / "events"
    script.write_text(SLOT_JOB)
    events.touch()
    (tmp_path / "logs").mkdir()
    run = {name: tmp_path / name for name, *_ in spec}
    return events, [
        study.Job(jobs.FINETUNE, name, run[name],
                  lambda name=name, mode=mode, seen=seen: [
                      sys.executable, str(script), str(run[name]), str(events), name, mode, seen
                  ],
                  after=tuple(run[a] for a in after))
        for name, mode, after, seen in spec
    ]  # fmt: skip


def test_ready_jobs_start_those_others_need_then_the_heaviest(tmp_path):
    """`ready_jobs`: of the jobs whose needs have ended, those that others wait on first, then
    the heaviest (`Job.weight`, images trained), ties in the plan's order; a job whose need is
    pending or running waits."""
    study = load_study()

    def job(name, weight, after=()):
        made = study.Job(jobs.FINETUNE, name, tmp_path / name, lambda: [],
                         after=tuple(tmp_path / a for a in after))  # fmt: skip
        made.weight = weight
        return made

    light, heavy, pre, tie = job("light", 10), job("heavy", 500), job("pre", 100), job("tie", 10)
    waits = job("waits", 900, ["pre"])
    needed = {pre.run_dir}

    def order(pending, running=()):
        busy = {j.run_dir for j in [*pending, *running]}
        return [j.name for j in study.ready_jobs(pending, busy, needed)]

    assert order([light, heavy, pre, tie, waits]) == ["pre", "heavy", "light", "tie"]
    assert order([light, tie, waits], running=[pre]) == ["light", "tie"]
    assert order([light, tie, waits]) == ["waits", "light", "tie"]  # pre has ended


@pytest.mark.system
def test_jobs_run_side_by_side_after_the_jobs_they_need(tmp_path, capsys):
    """`--jobs 2` (`run_jobs`): never more than two jobs at once, each with half the cores'
    threads (OMP_NUM_THREADS, and torch's in a forked job); a job starts only once the jobs it
    needs have ended, and one that others need starts first (the pretraining before the
    baselines that can run beside it); every job runs once."""
    study = load_study()
    spec = [
        ("b", "ok", [], "a"), ("e", "ok", [], ""), ("a", "ok", [], "b"), ("c", "ok", ["a"], ""),
        ("d", "ok", ["a"], ""), ("f", "ok", ["c", "d"], ""),
    ]  # fmt: skip
    events, planned = slot_jobs(study, tmp_path, spec)
    bar = study.StudyProgress(planned, enabled=True)
    threads = study.torch.get_num_threads()
    study.torch.set_num_threads(4)  # the study's cores
    try:
        study.run_jobs(planned, 2, tmp_path / "logs", bar)
    finally:
        study.torch.set_num_threads(threads)
    lines = [line.split() for line in events.read_text().splitlines()]
    order = [(what, name) for what, name, *_ in lines]
    assert set(order[:2]) == {("start", "a"), ("start", "b")}
    begun = [line.split()[1] for line in capsys.readouterr().out.splitlines() if "[run]" in line]
    assert begun[:2] == ["finetune/a", "finetune/b"]  # a is needed: it goes first
    running, most = set(), 0
    for what, name in order:
        if what == "start":
            running.add(name)
            most = max(most, len(running))
        else:
            running.discard(name)
    assert most == 2
    ended = [name for what, name in order if what == "end"]
    for name, _, after, _ in spec:
        assert order.count(("start", name)) == 1 and name in ended
        started = order.index(("start", name))
        assert all(order.index(("end", a)) < started for a in after)
    for _, _, env, torch_threads in lines:
        assert env == "2" and torch_threads in ("2", "None")  # None: started by exec
    assert bar.bar.n == bar.bar.total == sum(j.weight for j in planned)


@pytest.mark.system
def test_a_failed_job_stops_the_others_side_by_side_and_the_study(tmp_path, capsys):
    """A job that fails while another runs: the other gets SIGTERM (a training job
    checkpoints on it) and has ended when the study exits with the failure's log and exit
    status; no job after them starts."""
    study = load_study()
    spec = [("long", "long", [], ""), ("bad", "fail", [], "long"), ("later", "ok", [], "")]
    events, planned = slot_jobs(study, tmp_path, spec)
    bar = study.StudyProgress(planned, enabled=False)
    with pytest.raises(SystemExit) as failed:
        study.run_jobs(planned, 2, tmp_path / "logs", bar)
    assert "error: finetune/bad failed (exit 3)" in str(failed.value.code)
    order = [tuple(line.split()[:2]) for line in events.read_text().splitlines()]
    assert ("term", "long") in order and ("start", "later") not in order
    assert study.RUNNING == []


HANG_UP_STUDY = """import sys, pathlib
sys.path.insert(0, sys.argv[2])
from test_study import load_study, slot_jobs
study, tmp = load_study(), pathlib.Path(sys.argv[1])
_, planned = slot_jobs(study, tmp, [("a", "long", [], "b"), ("b", "long", [], "a")])
try:
    study.run_jobs(planned, 2, tmp / "logs", study.StudyProgress(planned, enabled=True))
except BaseException as e:  # its terminal gone: what ended it, for the test to show
    import traceback
    (tmp / "ended").write_text(f"{e!r} " + traceback.format_exc())
    raise
"""


@pytest.mark.system
def test_a_closed_terminal_stops_the_jobs_as_sigterm_does(tmp_path):
    """The study in a real terminal (a pty) that closes while two jobs run: the kernel's SIGHUP
    reaches the study only (the jobs have sessions of their own). Each job gets SIGTERM (a
    training job checkpoints on it) and the study exits 0, its output gone to /dev/null
    rather than failing on the closed terminal. Before, the study died of the SIGHUP and the
    kernel SIGKILLed the jobs: their steps since the last checkpoint were lost."""
    import os
    import pty
    import select
    import signal
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the study, the pty its controlling terminal, as from a shell there (the
        # suite may itself run under nohup, whose ignored SIGHUP a child inherits)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.execv(
            sys.executable,
            [sys.executable, "-c", HANG_UP_STUDY, str(tmp_path), str(REPO / "tests")],
        )
    events, end = tmp_path / "events", time.monotonic() + 120
    try:
        while not (events.exists() and {"start a", "start b"} <= {
            " ".join(line.split()[:2]) for line in events.read_text().splitlines()
        }):  # fmt: skip
            assert time.monotonic() < end, "the jobs never started"
            if select.select([fd], [], [], 0.05)[0]:
                os.read(fd, 65536)  # the study's output: read, so that it never blocks
        os.close(fd)  # the terminal closes
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < end, "the study did not end"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    ended = (tmp_path / "ended").read_text() if (tmp_path / "ended").exists() else "no error"
    assert os.waitstatus_to_exitcode(done[1]) == 0, ended
    said = [line.split()[:2] for line in events.read_text().splitlines()]
    assert sorted(said) == [["start", "a"], ["start", "b"], ["term", "a"], ["term", "b"]]


def test_under_nohup_a_closed_terminal_stays_ignored():
    """`nohup python scripts/study.py ...` ignores SIGHUP: the study keeps that (its jobs run
    on); otherwise SIGHUP is `hang_up` while jobs run, and the handler before it after."""
    import signal

    study = load_study()
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with study.relaying():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with study.relaying():
            assert signal.getsignal(signal.SIGHUP) is study.hang_up
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_jobs_needs_one_slot_or_more(capsys):
    study = load_study()
    with pytest.raises(SystemExit):
        study.main(["--config", str(REPO / "configs/study/quickstart.yaml"), "--jobs", "0"])
    assert "--jobs: 0: needs 1 or more" in capsys.readouterr().err


def test_the_report_runs_in_the_study_and_its_failure_is_not_the_studys(
    tmp_path, capsys, monkeypatch
):
    """The study builds its report in its own process (torch imported already): a report that
    cannot be made (a user error: one line; a bug: its traceback) is said, and the study goes
    on to return its summary."""
    import ssl_vit.cli

    study = load_study()
    study.report([tmp_path / "missing"], tmp_path / "out")
    out, err = capsys.readouterr()
    assert "report: failed (exit 1)" in out and "ssl-vit report: error:" in err
    assert "missing" in err and "Traceback" not in err

    def bug(argv):
        raise RuntimeError("a bug in the report")

    monkeypatch.setattr(ssl_vit.cli, "main", bug)
    study.report([tmp_path], tmp_path / "out")
    out, err = capsys.readouterr()
    assert "report: failed (exit 1)" in out
    assert "Traceback" in err and "RuntimeError: a bug in the report" in err


def test_a_picked_budget_and_as_many_per_class_fill_their_own_columns(tmp_path):
    """configs/study/select.yaml picks 10 labels and also draws 1 and 10 per class: the
    encoder's 10-per-class runs fill its "10/class" column only, the 10 picked ones their
    rows' "10 labels" column only (they shared a key, -l10, and each showed in the other's)."""
    study = load_study()
    over = [f"quick.output_dir={tmp_path}"]
    cfg = study.load_config(StudyConfig, REPO / "configs/study/select.yaml", over)
    v, made = "visible_75", {"l10": 0.29, "l10-typiclust": 0.17, "l10-random": 0.15}
    for name, top1 in made.items():
        for seed in (0, 1):
            run = tmp_path / "finetune" / f"{v}-{name}-s{seed}"
            run.mkdir(parents=True)
            (run / "results.json").write_text(json.dumps({"top1": top1, "num_labelled": 10}))
    rows = {r["variant"]: r for r in study.summarize(cfg, cfg.quick, tmp_path, "quick")["rows"]}
    cells = {
        name: {col: c["top1"] for col, c in row["finetune_by_labels"].items() if c["top1"]}
        for name, row in rows.items()
    }
    assert cells[v] == {"10/class": [0.29, 0.29]}
    assert cells[f"{v} + 10 labels chosen by typiclust"] == {"10 labels": [0.17, 0.17]}
    assert cells[f"{v} + 10 random labels"] == {"10 labels": [0.15, 0.15]}


@pytest.mark.parametrize(
    "self_train, controls",
    [
        # the quick start's: the offline row on the budget's own schedule, the online on its own
        ("[distill.temperature=2]", {"st": "", "semi": "-ctl"}),
        ("[train.steps=150, distill.temperature=2]", {"st": "-st-ctl", "semi": "-semi-ctl"}),
    ],
)
def test_methods_of_different_schedules_each_stand_beside_their_own_control(
    self_train, controls, tmp_path, capsys
):
    """Self-training and the online stage at one budget with schedules of their own: each is
    planned beside the same fine-tune without distill.* (the budget's own where it has none),
    and the summary names each its control row, whose figures are that control's."""
    study = load_study()
    v = "mean_color_50"
    labels = (
        f"labels=[{{per_class: 10, finetune: [train.steps=60], self_train: {self_train}, "
        "semi: [train.steps=300, distill.threshold=0.7]}]"
    )
    over = [f"full.output_dir={tmp_path}", labels]
    study.main(["--config", str(REPO / "configs/study/quickstart.yaml"), "--dry-run", *over])
    plan = {
        line.split(":")[0].removeprefix("[plan] "): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("[plan]")
    }
    for method, ctl in controls.items():
        for s in (0, 1):
            control = plan[f"finetune/{v}-l10{ctl}-s{s}"]
            assert "distill." not in control
            if ctl:  # a run of its own: the method's schedule, tagged as a control
                steps = "300" if method == "semi" else "150"
                assert control.endswith(f"seed={s} train.steps={steps} tag=control")

    cfg = study.load_config(StudyConfig, REPO / "configs/study/quickstart.yaml", over)
    top1 = {"": 0.25, "-st": 0.27, "-semi": 0.35} | {controls["semi"]: 0.3}
    top1[controls["st"]] = top1.get(controls["st"], 0.26)  # the plain fine-tune's, if it is
    for suffix, value in top1.items():
        run = tmp_path / "finetune" / f"{v}-l10{suffix}-s0"
        run.mkdir(parents=True, exist_ok=True)
        (run / "results.json").write_text(json.dumps({"top1": value, "num_labelled": 100}))
    rows = {r["variant"]: r for r in study.summarize(cfg, cfg.full, tmp_path, "full")["rows"]}

    def top1_of(variant: str) -> list:
        return rows[variant]["finetune_by_labels"]["10/class"]["top1"]

    for method, key in (("self-trained", "st"), ("semi-supervised", "semi")):
        control = rows[f"{v} + {method}"]["control"]
        assert control == f"{v} + control of {method}"
        assert top1_of(control) == [top1[controls[key]]]
        assert top1_of(f"{v} + {method}") == [top1[f"-{key}"]]
