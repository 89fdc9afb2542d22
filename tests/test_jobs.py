"""The job registry (ssl_vit/jobs.py): one table that every other module reads, so no code
tells jobs apart by comparing a name to a string; each row's config and pipeline exist."""

import re
from pathlib import Path

import pytest

from ssl_vit import jobs
from ssl_vit.config import ConfigError, load_config, to_dict
from ssl_vit.train.rundir import claim_run_dir, run_files

ROOT = Path(__file__).resolve().parents[1]
_NAMES = {n for job in jobs.ALL for n in (job.name, job.module, job.title) if n}
_NAME = "|".join(sorted(map(re.escape, _NAMES)))
_LIT = rf"""["']({_NAME})["']"""
# A job named by a string: compared (==, !=, in a literal tuple/list/set), the first key of a
# dict literal (a table of jobs), a path joined with it (a study's stage folder), a study Job.
_BY_NAME = [
    rf"[=!]=\s*{_LIT}",
    rf"{_LIT}\s*[=!]=",
    rf"\bin\s*[(\[{{][^)\]}}]*?{_LIT}[^)\]}}]*[)\]}}]",
    rf"\{{\s*{_LIT}\s*:",
    rf"/\s*{_LIT}",
    rf"\bJob\(\s*{_LIT}",
]
_SKIP = "# not a job"  # a line comparing another thing of the same name (a bench suite)


def _by_name(text: str) -> list[str]:
    hits = []
    for pattern in _BY_NAME:
        for m in re.finditer(pattern, text):
            line = text[text.rfind("\n", 0, m.start()) + 1 : text.find("\n", m.end())]
            if _SKIP not in line:
                hits.append(line.strip())
    return hits


def test_no_code_outside_the_registry_compares_a_job_name_to_a_string():
    files = [p for d in ("ssl_vit", "pipelines", "scripts") for p in (ROOT / d).rglob("*.py")]
    found = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if p != ROOT / "ssl_vit/jobs.py" and (hits := _by_name(p.read_text()))
    }
    assert found == {}, "compare jobs through ssl_vit.jobs (`run.job is jobs.FINETUNE`)"


def test_the_grep_finds_what_it_is_for():
    for code in (
        'if r.kind == "finetune":',
        'if "fewshot" != stage:',
        'if kind not in (None, "predict"):',
        'JOBS = {\n    "pretrain": "masked patch ...",',
        'run_dir = out / "fewshot" / name',
        'Job("finetune", job, run_dir)',
        'if run_kind(saved) == "fine-tuning":',
    ):
        assert _by_name(code), code
    for code in ('log = logging.getLogger("predict")', 'results["fewshot"] = table',
                 'row = {"variant": v, "fewshot": t}', 'desc="select"'):  # fmt: skip
        assert not _by_name(code), code


@pytest.mark.parametrize("job", jobs.ALL, ids=lambda j: j.name)
def test_each_job_has_its_config_and_pipeline(job):
    """A job's config class loads every shipped config of its folder (configs/<name>/) and is
    recognised by its marker; its pipeline module is a file of pipelines/ with a `main`."""
    if job.module:
        source = (ROOT / "pipelines" / f"{job.module}.py").read_text()
        assert "\ndef main(" in source
        assert jobs.PIPELINES[job.name] is job
    if not job.config:
        assert job is jobs.EXPORT  # a command of its own, no config, no run directory
        return
    shipped = sorted((ROOT / "configs" / job.name).glob("*.yaml"))
    assert shipped or job in (jobs.PREDICT, jobs.SELECT)  # configured by their flags
    for path in shipped:
        cfg = load_config(job.config_class, path)
        assert jobs.by_config(to_dict(cfg)) is (job if job.marker else None), path


def test_run_files_are_what_the_run_directory_jobs_write():
    assert set(jobs.RUN_FILES) == {
        *("config.yaml", "metrics.jsonl", "results.json", "checkpoints"),
        *("model.safetensors", "labels.json", "keys_rank*.txt", "events.out.tfevents.*"),
        *("mlruns", "wandb", "labelled", "labelled.json", "predictions.jsonl", "predictions.csv"),
        "teacher.json",
    }
    # select's output is its own: to-label/ may hold the user's labels.
    own = set(jobs.SELECT.writes) - {"config.yaml", "metrics.jsonl", "results.json"}
    assert own == {"selection.jsonl", "features.npy", "features.index.npz", "to-label"}
    assert not own & {*jobs.RUN_FILES}


def test_a_predict_overwrite_never_removes_the_classifier_it_reads(tmp_path):
    """The run directory's own guard knows what predict reads (`jobs.PREDICT.reads`): an
    --overwrite whose output is the fine-tuning run of its --checkpoint is refused there, not
    only by predict's earlier check, and removes nothing (it removed the classifier)."""
    ft = tmp_path / "ft"
    ft.mkdir()
    for name in ("config.yaml", "results.json", "model.safetensors", "labels.json"):
        (ft / name).write_text("{}\n")
    cfg = load_config(
        jobs.PREDICT.config_class, None, [f"checkpoint={ft}", "source=/x", f"output_dir={ft}"]
    )
    with pytest.raises(ConfigError, match=r"output_dir=.*: is checkpoint=.*which this job reads"):
        claim_run_dir(ft, cfg, overwrite=True)
    assert [p.name for p in run_files(ft)] == [
        "config.yaml", "labels.json", "model.safetensors", "results.json"
    ]  # fmt: skip
