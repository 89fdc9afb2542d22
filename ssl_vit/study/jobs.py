"""The study's jobs (`scripts/study.py`): per variant a pretraining, a few-shot evaluation and
fine-tunes (recipe x label budget x seed, then the self-trained ones), after the random-init
baselines; each a command line built when it starts (it may need a checkpoint) and a weight,
the images it trains on, for the study's progress."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ssl_vit.jobs
from ssl_vit.config import ConfigError, load_config, to_dict
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
from ssl_vit.config.study import StudyBudget, StudyConfig, StudyLabels, schedule
from ssl_vit.jobs import FEWSHOT, FINETUNE, PRETRAIN
from ssl_vit.report.runs import read_results

__all__ = [
    "CONTROL",
    "FEWSHOT_WEIGHT",
    "SELF_TRAINED",
    "SEMI",
    "Job",
    "SelfTraining",
    "budget_of",
    "checkpoint_of",
    "control_of",
    "finetunes",
    "images_trained",
    "job_config",
    "labels_tag",
    "plan",
    "self_trainings",
]

REPO = Path(__file__).resolve().parents[2]  # the checkout: its pipelines/ run the jobs
FEWSHOT_WEIGHT = 2000  # a few-shot job's weight, as many training images (its feature pass)


@dataclass
class Job:
    stage: ssl_vit.jobs.Job  # PRETRAIN / FEWSHOT / FINETUNE (`ssl_vit.jobs.STAGES`)
    name: str  # variant name, or random / scratch for the random-init baselines
    run_dir: Path
    argv: Callable[[], list[str]]  # built when the job starts (it may need a checkpoint)
    chain: str = ""  # the variant (or baseline) whose chain it belongs to: `name` if empty
    weight: int = FEWSHOT_WEIGHT  # its share of the study's work: the images its steps train on
    after: tuple[Path, ...] = ()  # the run directories of the jobs it needs (checkpoint, teacher)

    def __post_init__(self) -> None:
        self.chain = self.chain or self.name


def model_overrides(model: ModelConfig, image_size: int | None = None) -> list[str]:
    m = to_dict(model)
    m["image_size"] = image_size or m["image_size"]
    keys = ("image_size", "patch_size", "width", "depth", "heads", "mlp_ratio")
    return [f"model.{k}={m[k]}" for k in keys if m[k] is not None]


def objective_overrides(obj: ObjectiveConfig) -> list[str]:
    return [f"objective.{k}={json.dumps(v)}" for k, v in to_dict(obj).items()]


def checkpoint_of(pretrain_dir: Path) -> str:
    """The final checkpoint of a finished pretraining run (its results.json names it); before
    it has finished (not started, a --dry-run, or stopped: a preempted run's results.json
    names none), a placeholder: the jobs after it build their command again when they start."""
    results = read_results(pretrain_dir)
    if "checkpoint" not in results:
        return f"<final checkpoint of {pretrain_dir}>"
    return str(pretrain_dir / "checkpoints" / Path(results["checkpoint"]).name)


def plan(cfg: StudyConfig, budget: StudyBudget, out: Path) -> list[Job]:
    """Baselines first, then per variant: pretrain, few-shot, fine-tune."""
    d, py = cfg.data, [sys.executable]
    seed = [] if cfg.seed is None else [f"seed={cfg.seed}"]  # after each budget's overrides
    pre_every = budget.pretrain_fewshot_every
    pre_fewshot = (
        [f"fewshot.train={d.train}", f"fewshot.eval={d.eval}", f"fewshot.every={pre_every}"]
        if pre_every
        else ["fewshot.train="]
    )

    def fewshot(name: str, ckpt: Callable[[], str], after: tuple[Path, ...] = ()) -> Job:
        run_dir = out / FEWSHOT.name / name
        return Job(FEWSHOT, name, run_dir, after=after, argv=lambda: py + [
            script(FEWSHOT), "--checkpoint", ckpt(),
            "--config", cfg.fewshot_config, f"output_dir={run_dir}",
            f"fewshot.train={d.train}", f"fewshot.eval={d.eval}",
            *model_overrides(budget.model), *budget.fewshot, *seed,
        ])  # fmt: skip

    def finetune_one(
        name: str, ckpt: Callable[[], str], job: str, extra: list[str], after: tuple[Path, ...]
    ) -> Job:
        run_dir = out / FINETUNE.name / job
        return Job(FINETUNE, job, run_dir, after=after, argv=lambda: py + [
            script(FINETUNE), "--resume", "--config", cfg.finetune_config,
            f"output_dir={run_dir}", f"init.checkpoint={ckpt()}",
            f"data.train={d.train}", f"data.eval={d.eval}",
            *model_overrides(budget.model, budget.finetune_image_size), *budget.finetune,
            *seed, *extra,
        ], chain=name)  # fmt: skip

    scratch = [finetune_one("scratch", lambda: "none", "scratch" + tag, extra, ())
               for tag, extra in finetunes(cfg, pretrained=False)]  # fmt: skip
    jobs = [fewshot("random", lambda: "random"), *scratch]
    for v in cfg.variants:
        pre_dir = out / PRETRAIN.name / v.name
        jobs.append(Job(PRETRAIN, v.name, pre_dir, lambda v=v, pre_dir=pre_dir: py + [
            script(PRETRAIN), "--resume", "--config", cfg.pretrain_config,
            f"output_dir={pre_dir}", f"data.train_shards={d.train}", *pre_fewshot,
            *model_overrides(budget.model), *objective_overrides(v.objective), *budget.pretrain,
            *seed,
        ]))  # fmt: skip
        ckpt = lambda pre_dir=pre_dir: checkpoint_of(pre_dir)  # noqa: E731
        after = (pre_dir,)
        jobs.append(fewshot(v.name, ckpt, after))
        # One fine-tune per recipe x label budget x seed (their overrides after the budget's,
        # the variant's own `finetune` after theirs).
        jobs += [finetune_one(v.name, ckpt, v.name + tag, [*extra, *v.finetune], after)
                 for tag, extra in finetunes(cfg)]  # fmt: skip
        controls = set()  # self-training and the semi-supervised stage share theirs
        for st in self_trainings(cfg, v.finetune) if v.self_train else []:
            if st.online:
                distill, needs = ["distill.mode=online", f"distill.unlabelled={d.train}"], after
            else:
                teacher = out / FINETUNE.name / (v.name + st.teacher)  # after the teachers' ones
                distill = [f"distill.teacher={teacher}", f"distill.unlabelled={d.train}"]
                needs = (pre_dir, teacher)
            if st.control not in controls and st.control != st.teacher:
                controls.add(st.control)
                control = control_of(st.overrides)
                jobs.append(finetune_one(v.name, ckpt, v.name + st.control, control, after))
            overrides = [*distill, *st.overrides]
            jobs.append(finetune_one(v.name, ckpt, v.name + st.name, overrides, needs))
    for job in jobs:
        if job.stage.resumes:  # a training job: the images its steps train on
            job.weight = images_trained(job.stage, *job_config(job.argv()))
    return jobs


def script(stage: ssl_vit.jobs.Job) -> str:
    """The pipeline that runs a study job (pipelines/ of the checkout)."""
    return str(REPO / "pipelines" / f"{stage.module}.py")


def images_trained(stage: ssl_vit.jobs.Job, config: str | None, overrides: list[str]) -> int:
    """train.steps x train.batch_size (x 1 + distill.ratio when self-training) of a training
    job, as the job will load them (`load_config`: its config file, its overrides, the schema's
    defaults); 1 when they do not load (`check_jobs` names the error before any job runs)."""
    try:
        cfg = load_config(stage.config_class, config, overrides)
    except (OSError, ConfigError):
        return 1
    distill = getattr(cfg, "distill", None)
    unlabelled = distill.ratio if distill is not None and distill.enabled else 0
    return cfg.train.steps * cfg.train.batch_size * (1 + unlabelled)


def labels_tag(k: int) -> str:
    return "all" if k == 0 else str(k)


def budget_of(b: StudyLabels) -> tuple[str, list[str]]:
    """(run-name suffix, the fine-tune's overrides, its `finetune` last) of a label entry:
    `-l50` for 50 per class,
    `-l100-typiclust` for 100 images picked by typiclust (`-l100-random`: at random)."""
    if b.select == "balanced":
        return f"-l{labels_tag(b.per_class)}", [f"data.labels_per_class={b.per_class}", *b.finetune]
    picked = [f"data.labels_select={b.select}", f"data.labels_budget={b.budget}", *b.finetune]
    return f"-l{b.budget}-{b.select}", picked


def finetunes(cfg: StudyConfig, pretrained: bool = True) -> list[tuple[str, list[str]]]:
    """(run-name suffix, overrides) of each fine-tune of one encoder: recipe x label budget x
    seed, an axis the study does not vary left out of the name (`-paper`, `-l50`, `-s1`). The
    entries that pick their images without labels (`select`) are a `pretrained` encoder's."""
    recipes = [(f"-{r.name}", r.finetune) for r in cfg.recipes] or [("", [])]
    budgets = [(b, *budget_of(b)) for b in cfg.labels if pretrained or b.select == "balanced"]
    budgets = budgets or [(None, "", [])]
    seeds = cfg.finetune_seeds or [None]
    return [
        (r + b + ("" if s is None else f"-s{s}"), [*ro, *bo, *seed_overrides(label, s)])
        for r, ro in recipes
        for label, b, bo in budgets
        for s in seeds
    ]


def seed_overrides(b: StudyLabels | None, seed: int | None) -> list[str]:
    """A fine-tune's seed; for images picked without labels, the pick's seed too: a seed of a
    picking method is a pick and a fine-tune (one pick fine-tuned twice measured the pick's
    luck, not the method's). Balanced subsets stay those of `data.labels_seed` 0: the same
    subset for every encoder and seed, as the paper's few-label rows."""
    if seed is None:
        return []
    picked = b is not None and b.select != "balanced"
    return [f"seed={seed}", *([f"data.labels_seed={seed}"] if picked else [])]


SELF_TRAINED = "-st"  # a self-training run's name: its teacher's with this after the budget
SEMI = "-semi"  # the online semi-supervised stage's (distill.mode=online)
CONTROL = "-ctl"  # their equal-compute control's: the same fine-tune without unlabelled images


@dataclass(frozen=True)
class SelfTraining:
    """One fine-tune of an encoder on the unlabelled images too, by run-name suffix: its
    teacher's (offline; online, the fine-tune of the same budget and seed, for the summary's
    columns), its own and its control's, its overrides (without distill.teacher /
    distill.unlabelled / distill.mode, which the study adds) and whether it is online."""

    teacher: str
    name: str
    control: str
    overrides: list[str]
    online: bool = False


def self_trainings(cfg: StudyConfig, own: list[str] = ()) -> list[SelfTraining]:
    """The fine-tunes of one pretrained encoder on the unlabelled images too: per label budget
    with `self_train` (offline) or `semi` (online) and per seed, with the first recipe; the
    overrides are its teacher's (the encoder's `own` among them), then the budget's. Each has
    its equal-compute control (`control_of`), per budget and seed: the budget's own fine-tune
    of that seed (`teacher`) when the method changes nothing but distill.* keys, else a run
    shared by the methods of the same schedule."""
    r, recipe = (f"-{cfg.recipes[0].name}", cfg.recipes[0].finetune) if cfg.recipes else ("", [])
    seeds = [(f"-s{s}", [f"seed={s}"]) for s in cfg.finetune_seeds] or [("", [])]
    out = []
    for b in cfg.labels:
        budget = f"-l{labels_tag(b.per_class)}"
        base = [*recipe, f"data.labels_per_class={b.per_class}", *b.finetune]
        methods = [(SELF_TRAINED, b.self_train, False), (SEMI, b.semi, True)]
        methods = [m for m in methods if m[1] is not None]
        schedules = {tuple(schedule(overrides)) for _, overrides, _ in methods} - {()}
        for suffix, overrides, online in methods:
            if not schedule(overrides):
                ctl = ""  # no schedule of its own: the plain fine-tune is its control
            else:  # a run of its own: "-ctl", or with two schedules "-st-ctl" and "-semi-ctl"
                ctl = CONTROL if len(schedules) == 1 else suffix + CONTROL
            for tag, seed in seeds:
                out.append(SelfTraining(
                    teacher=r + budget + tag,
                    name=r + budget + suffix + tag,
                    control=r + budget + ctl + tag,
                    overrides=[*base, *own, *seed, *overrides],
                    online=online,
                ))  # fmt: skip
    return out


def control_of(overrides: list[str]) -> list[str]:
    """The equal-compute control of a self-training: the same fine-tune (steps, lr, labelled
    images and batch, seed) with no teacher and no unlabelled images, tagged `control` so the
    report keeps it apart from the encoder's plain fine-tunes. A gain is the method's only
    when it beats this row: a longer schedule alone can explain it (issue 49)."""
    return [o for o in overrides if not o.startswith("distill.")] + ["tag=control"]


def job_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config, overrides) of a job's command line, as its pipeline reads them (few-shot's
    `--checkpoint C` is its `init.checkpoint`); other `--flags` are switches."""
    config, overrides, args = None, [], iter(argv[2:])
    for arg in args:
        if arg == "--config":
            config = next(args)
        elif arg == "--checkpoint":
            ckpt = next(args)
            overrides.append(f"init.checkpoint={json.dumps('none' if ckpt == 'random' else ckpt)}")
        elif not arg.startswith("--"):
            overrides.append(arg)
    return config, overrides
