"""scripts/study.py refuses a bad study before its first job (issue 38): a variant named like
the baselines' chain, and a bad key or value in any job's overrides (a label budget's
`finetune` or `self_train`, a variant's `finetune`), each one line naming the job."""

from types import SimpleNamespace

import pytest
from test_study import REPO, load_study

from ssl_vit.config import ConfigError, StudyConfig, from_dict

LABELS = REPO / "configs/study/labels.yaml"


@pytest.mark.parametrize("name", ["baseline", "random", "scratch"])
def test_a_variant_cannot_take_a_baseline_name(name):
    """`--only baseline` runs the random-init rows: a variant of that name could never run
    alone, so the name is refused with the config."""
    data = {"data": {"train": "a", "eval": "b"}, "variants": [{"name": name}]}
    with pytest.raises(ConfigError, match="'baseline' name the random-init baselines"):
        from_dict(StudyConfig, data)


@pytest.mark.parametrize(
    ("override", "job", "key"),
    [
        ("labels=[{per_class: 50, finetune: [train.stepz=2]}]", "finetune/scratch-l50-s0", "stepz"),
        (
            "labels=[{per_class: 50, self_train: [distill.temperature=hot]}]",
            "finetune/visible_75-l50-st-s0",
            "distill.temperature",
        ),
        (
            "variants=[{name: v, finetune: [parts.layer_decai=0.7]}]",
            "finetune/v-l50-s0",
            "parts.layer_decai",
        ),
    ],
)
def test_bad_job_overrides_stop_the_study_before_its_first_job(
    override, job, key, tmp_path, monkeypatch
):
    study = load_study()
    ran = []
    ended = SimpleNamespace(poll=lambda: 0, wait=lambda timeout=None: 0)  # a job's process
    monkeypatch.setattr(study, "start", lambda argv, *_: ran.append(argv) or ended)
    argv = ["--config", str(LABELS), "--quick", f"quick.output_dir={tmp_path / 'q'}", override]
    for only in ([], ["--only", "scratch"], ["--dry-run"]):  # every job checked, any run
        with pytest.raises(SystemExit) as stop:
            study.main([*argv, *only])
        assert str(stop.value.code).startswith(f"error: {job}: "), stop.value.code
        assert key in str(stop.value.code)
    assert not ran and not (tmp_path / "q" / "logs").exists()  # nothing ran, nothing written


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_a_missing_source_stops_the_study_before_its_first_job(
    synthetic_shards, tmp_path, monkeypatch
):
    """A typo in data.eval stopped the first fine-tune, after the pretraining had run (minutes
    on the quick start, hours on a GPU budget): every source is opened before any job."""
    study = load_study()
    ran = []
    ended = SimpleNamespace(poll=lambda: 0, wait=lambda timeout=None: 0)  # a job's process
    monkeypatch.setattr(study, "start", lambda argv, *_: ran.append(argv) or ended)
    missing = tmp_path / "shapes-tset"
    config = REPO / "configs/study/quickstart.yaml"  # every source its jobs read: data.*
    argv = ["--config", str(config), "--quick", f"quick.output_dir={tmp_path / 'q'}"]
    argv += [f"data.train={synthetic_shards}", f"data.eval={missing}"]
    with pytest.raises(SystemExit) as stop:
        study.main(argv)
    line = str(stop.value.code)
    assert line.startswith("error: ") and f".eval='{missing}': image source not found" in line
    assert not ran and not (tmp_path / "q").exists()  # nothing ran, nothing written
    there = [f"data.train={synthetic_shards}", f"data.eval={synthetic_shards}"]
    cfg = study.load_config(StudyConfig, config, there)
    study.check_sources(study.plan(cfg, cfg.quick, tmp_path / "q"))  # no job reads data/


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_the_shipped_studies_pass_the_check(tmp_path):
    """Every job of every shipped study config loads against its schema (`check_jobs`)."""
    study = load_study()
    for config in sorted((REPO / "configs/study").glob("*.yaml")):
        cfg = study.load_config(StudyConfig, config, [])
        for preset in study.BUDGETS:
            budget = getattr(cfg, preset)
            if budget.output_dir:
                study.check_jobs(study.plan(cfg, budget, tmp_path / preset))
