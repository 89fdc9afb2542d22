"""Every job ssl-vit runs, in one table: its config schema, its pipeline, its `--help` line, the
files it writes in its run directory, the sources a run reads, whether it resumes, and how a
config.yaml of its runs is recognised and named.

Code outside this module tells jobs apart by these objects (`run.job is jobs.FINETUNE`) or by
their attributes (`job.resumes`), never by comparing a name to a string, so a new job is one row
here (tests/test_jobs.py greps the source for such comparisons). Torch-free and import-light:
`ssl-vit --help` reads it, and a config class is imported only when asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = [
    "ALL",
    "EXPORT",
    "FEWSHOT",
    "FINETUNE",
    "PIPELINES",
    "PREDICT",
    "PRETRAIN",
    "RUN_FILES",
    "SELECT",
    "STAGES",
    "STUDY",
    "Job",
    "by_config",
]


@dataclass(frozen=True, eq=False)  # compared by identity: `run.job is jobs.PRETRAIN`
class Job:
    """One job. `name`: its command (`ssl-vit <name>`), its configs/<name>/ folder, its
    study stage folder (<output_dir>/<name>/) and the report's kind column."""

    name: str
    help: str  # one line for `ssl-vit --help`
    config: str = ""  # its config schema, "module:Class" ("": none); see `config_class`
    module: str = ""  # its pipeline, pipelines/<module>.py ("": none, not an `ssl-vit` job)
    reads_config: str = ""  # the commands that read its config (the config reference page)
    # The files it writes in its output directory (glob patterns). A run directory's (`rundir`)
    # are what --overwrite removes there, and nothing else.
    writes: tuple[str, ...] = ()
    # Config keys of the local sources a run reads, never removed by an --overwrite.
    reads: tuple[str, ...] = ()
    rundir: bool = False  # its output is a run directory claimed by `train.rundir`
    resumes: bool = False  # --resume continues it; an interrupted run is otherwise rerun
    marker: str = ""  # the top-level key its config.yaml is recognised by ("": not recognised)
    title: str = ""  # a run of it in messages: "holds a pretraining run"

    @property
    def config_class(self) -> type:
        """The config dataclass (imported now: `ssl_vit.config` loads PyYAML)."""
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(module), cls)


# What every training job's metrics and trackers write (train/metrics.py, data.record_keys).
_TRACKED = ("config.yaml", "metrics.jsonl", "results.json", "events.out.tfevents.*")
_TRACKED += ("mlruns", "wandb")
_TRAINED = (*_TRACKED, "checkpoints", "keys_rank*.txt")

# fmt: off
PRETRAIN = Job(
    "pretrain", "masked patch prediction pretraining (pipelines/pretrain.py)",
    config="ssl_vit.config.schema:PretrainConfig", module="pretrain",
    reads_config="`pipelines/pretrain.py`, `ssl-vit pretrain`",
    writes=_TRAINED, reads=("data.train_shards", "fewshot.train", "fewshot.eval"),
    rundir=True, resumes=True, marker="objective", title="pretraining",
)
FINETUNE = Job(
    "finetune", "fine-tune an encoder as a classifier (pipelines/finetune.py)",
    config="ssl_vit.config.schema:FinetuneConfig", module="finetune",
    reads_config="`pipelines/finetune.py`, `ssl-vit finetune`",
    writes=(*_TRAINED, "model.safetensors", "labels.json", "labelled", "labelled.json",
            "teacher.json"),
    reads=("data.train", "data.eval", "distill.teacher", "distill.unlabelled", "init.checkpoint"),
    rundir=True, resumes=True, marker="init", title="fine-tuning",
)
FEWSHOT = Job(
    "fewshot", "few-shot linear evaluation of a frozen encoder (pipelines/fewshot.py)",
    config="ssl_vit.config.schema:FewshotConfig", module="fewshot",
    reads_config="`pipelines/fewshot.py`, `ssl-vit fewshot`",
    writes=_TRACKED, reads=("fewshot.train", "fewshot.eval", "init.checkpoint"),
    rundir=True, marker="fewshot", title="few-shot",
)
PREDICT = Job(
    "predict", "label a source with a fine-tuned classifier (pipelines/predict.py)",
    config="ssl_vit.config.predict:PredictConfig", module="predict",
    reads_config="`pipelines/predict.py`, `ssl-vit predict` (or its flags)",
    writes=(*_TRACKED[:3], "predictions.jsonl", "predictions.csv"), reads=("checkpoint", "source"),
    rundir=True, marker="top_k", title="predict",
)
SELECT = Job(
    "select", "pick the images to label from an encoder's features (pipelines/selection.py)",
    # pipelines/select.py would shadow the standard library's `select` in every
    # `python pipelines/<job>.py` (the script's folder leads sys.path).
    config="ssl_vit.config.select:SelectConfig", module="selection",
    reads_config="`pipelines/selection.py`, `ssl-vit select` (or its flags)",
    # Its own output folder (eval/select_output.py): to-label/ may hold the user's labels, so
    # no other job's --overwrite removes these.
    # features.index.npz: what a later round needs to reuse features.npy (select_features).
    writes=(*_TRACKED[:3], "features.index.npz", "selection.jsonl", "features.npy", "to-label"),
    reads=("checkpoint", "source"), marker="budget", title="select",
)
STUDY = Job(
    "study", "pretrain -> few-shot -> fine-tune per variant, and the random-init rows",
    config="ssl_vit.config.study:StudyConfig",
    reads_config="`scripts/study.py`, `scripts/quickstart.sh`",
)
EXPORT = Job(
    "export", "write a checkpoint's encoder or a fine-tuned classifier for timm or transformers",
)
# fmt: on

ALL = (PRETRAIN, FINETUNE, FEWSHOT, PREDICT, SELECT, STUDY, EXPORT)
PIPELINES = {job.name: job for job in ALL if job.module}  # `ssl-vit <name>`: a pipeline's main
STAGES = (PRETRAIN, FEWSHOT, FINETUNE)  # a study's jobs, in a variant's order
# What the run-directory jobs write; --overwrite removes these and nothing else, so a mistyped
# output_dir never loses unrelated files.
RUN_FILES = tuple(dict.fromkeys(p for job in ALL if job.rundir for p in job.writes))
# Checked in this order: pretraining's config has `fewshot` too, the few-shot job's `init` too.
_RECOGNISED = (PREDICT, SELECT, PRETRAIN, FEWSHOT, FINETUNE)


def by_config(config: dict) -> Job | None:
    """The job a config (a dict, e.g. a read config.yaml) is for: the first of `_RECOGNISED`
    whose `marker` key it has; None for another (a study's) or none."""
    return next((job for job in _RECOGNISED if job.marker in config), None)
