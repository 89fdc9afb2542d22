"""The paper's pretraining study in one command (Dosovitskiy et al. 2021, section 4.6).

    python scripts/study.py --config configs/study/cifar10.yaml [--quick] [--dry-run] [k=v ...]

For every variant of the config (objective target, corruption ratio): pretrain -> few-shot
evaluation of the checkpoint -> fine-tuning from it (at `finetune_image_size`, position
embeddings interpolated); plus the same few-shot evaluation of a random-init encoder and the
same fine-tuning from scratch. Each job is the ordinary pipeline (pipelines/*.py) in its own
process, its output in `<output_dir>/<stage>/<name>/` and its log in `<output_dir>/logs/`.
A finished job (results.json) is skipped and an interrupted pretraining or fine-tuning resumes
from its newest checkpoint, so the study can be stopped (SIGTERM, Ctrl-C: the running job
checkpoints, then the study exits 0) and started again; a failed job stops it with exit 1.
Every job's config and overrides are checked before the first job runs, and a job dies with
the study (even a SIGKILL of the study ends it: no orphan keeps its run directory).
At the end: `summary.json` and `summary.md` (the table), then `ssl-vit report` over all runs.
`--quick` picks the `quick` budget (a CPU), `--preset NAME` any (`full`, `quick`, `gpu`),
default `full`. `--only NAME` runs one variant's chain (pretrain -> few-shot -> fine-tune;
`baseline`: random-init few-shot and fine-tuning from scratch) and writes the summary of what
has finished, without the report. With `recipes:` (name + fine-tuning overrides each), every
variant and the scratch baseline are fine-tuned once per recipe, in finetune/<name>-<recipe>,
and the summary has one fine-tune column per recipe; `--copy-small DIR` copies the study's
small artifacts (results, metrics, configs, logs, summary, report) to DIR, every
`checkpoints/` left out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from ssl_vit.children import die_with_parent, start_child, stop_child
from ssl_vit.config import (
    ConfigError,
    FewshotConfig,
    FinetuneConfig,
    PretrainConfig,
    load_config,
    save_config,
    to_dict,
)
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
from ssl_vit.config.shipped import find_config
from ssl_vit.config.study import StudyBudget, StudyConfig
from ssl_vit.eval.fewshot import shot_order
from ssl_vit.progress import format_eta, progress_bar
from ssl_vit.report.runs import fewshot_table, read_results

REPO = Path(__file__).resolve().parents[1]
BASELINE = "random init"
BUDGETS = ("full", "quick", "gpu")  # the study config's budget sections
FEWSHOT_WEIGHT = 2000  # a few-shot job's weight, as many training images (its feature pass)


@dataclass
class Job:
    stage: str  # pretrain / fewshot / finetune
    name: str  # variant name, or random / scratch for the random-init baselines
    run_dir: Path
    argv: Callable[[], list[str]]  # built when the job starts (it may need a checkpoint)
    chain: str = ""  # the variant (or baseline) whose chain it belongs to: `name` if empty
    weight: int = FEWSHOT_WEIGHT  # its share of the study's work: the images its steps train on

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
    """The final checkpoint of a finished pretraining run (its results.json names it)."""
    results = read_results(pretrain_dir)
    if not results:
        return f"<final checkpoint of {pretrain_dir}>"  # --dry-run before pretraining
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

    def fewshot(name: str, ckpt: Callable[[], str]) -> Job:
        run_dir = out / "fewshot" / name
        return Job("fewshot", name, run_dir, lambda: py + [
            str(REPO / "pipelines/fewshot.py"), "--checkpoint", ckpt(),
            "--config", cfg.fewshot_config, f"output_dir={run_dir}",
            f"fewshot.train={d.train}", f"fewshot.eval={d.eval}",
            *model_overrides(budget.model), *budget.fewshot, *seed,
        ])  # fmt: skip

    def finetune_one(name: str, ckpt: Callable[[], str], job: str, extra: list[str]) -> Job:
        run_dir = out / "finetune" / job
        return Job("finetune", job, run_dir, lambda: py + [
            str(REPO / "pipelines/finetune.py"), "--resume", "--config", cfg.finetune_config,
            f"output_dir={run_dir}", f"init.checkpoint={ckpt()}",
            f"data.train={d.train}", f"data.eval={d.eval}",
            *model_overrides(budget.model, budget.finetune_image_size), *budget.finetune,
            *seed, *extra,
        ], chain=name, weight=images_trained(cfg.finetune_config, [*budget.finetune, *extra]),
        )  # fmt: skip

    def finetune(name: str, ckpt: Callable[[], str], own: list[str] = ()) -> list[Job]:
        """One fine-tune per recipe x label budget x seed (their overrides after the budget's,
        the encoder's `own` after theirs)."""
        return [
            finetune_one(name, ckpt, name + tag, [*extra, *own]) for tag, extra in finetunes(cfg)
        ]

    jobs = [fewshot("random", lambda: "random"), *finetune("scratch", lambda: "none")]
    for v in cfg.variants:
        pre_dir = out / "pretrain" / v.name
        jobs.append(Job("pretrain", v.name, pre_dir, lambda v=v, pre_dir=pre_dir: py + [
            str(REPO / "pipelines/pretrain.py"), "--resume", "--config", cfg.pretrain_config,
            f"output_dir={pre_dir}", f"data.train_shards={d.train}", *pre_fewshot,
            *model_overrides(budget.model), *objective_overrides(v.objective), *budget.pretrain,
            *seed,
        ], weight=images_trained(cfg.pretrain_config, budget.pretrain)))  # fmt: skip
        ckpt = lambda pre_dir=pre_dir: checkpoint_of(pre_dir)  # noqa: E731
        jobs += [fewshot(v.name, ckpt), *finetune(v.name, ckpt, v.finetune)]
        for tag, st_tag, extra in self_trainings(cfg, v.finetune) if v.self_train else []:
            teacher = out / "finetune" / (v.name + tag)  # after their teachers, the fine-tunes
            distill = [f"distill.teacher={teacher}", f"distill.unlabelled={d.train}"]
            jobs.append(finetune_one(v.name, ckpt, v.name + st_tag, [*distill, *extra]))
    return jobs


def images_trained(config: str, overrides: list[str]) -> int:
    """train.steps x train.batch_size (x 1 + distill.ratio when self-training) of a job: its
    config file's values, then its overrides (the last one of a key wins)."""
    try:
        data = yaml.safe_load(find_config(config).read_text()) or {}
    except (OSError, yaml.YAMLError, ConfigError):
        data = {}
    train = data.get("train") or {}
    value = {"train.steps": train.get("steps", 1), "train.batch_size": train.get("batch_size", 1)}
    value |= {"distill.ratio": 1, "distill.teacher": ""}
    for item in overrides:
        key, _, raw = item.partition("=")
        if key in value:
            value[key] = int(raw) if raw.strip().isdigit() else raw.strip()
    unlabelled = value["distill.ratio"] if value["distill.teacher"] else 0
    return max(1, int(value["train.steps"]) * int(value["train.batch_size"]) * (1 + unlabelled))


def labels_tag(k: int) -> str:
    return "all" if k == 0 else str(k)


def finetunes(cfg: StudyConfig) -> list[tuple[str, list[str]]]:
    """(run-name suffix, overrides) of each fine-tune of one encoder: recipe x label budget x
    seed, an axis the study does not vary left out of the name (`-paper`, `-l50`, `-s1`)."""
    recipes = [(f"-{r.name}", r.finetune) for r in cfg.recipes] or [("", [])]
    budgets = [
        (f"-l{labels_tag(b.per_class)}", [f"data.labels_per_class={b.per_class}", *b.finetune])
        for b in cfg.labels
    ] or [("", [])]
    seeds = [(f"-s{s}", [f"seed={s}"]) for s in cfg.finetune_seeds] or [("", [])]
    return [
        (r + b + s, [*ro, *bo, *so]) for r, ro in recipes for b, bo in budgets for s, so in seeds
    ]


SELF_TRAINED = "-st"  # a self-training run's name: its teacher's with this after the budget


def self_trainings(cfg: StudyConfig, own: list[str] = ()) -> list[tuple[str, str, list[str]]]:
    """(its teacher's run-name suffix, its own, overrides) of each self-training fine-tune of
    one pretrained encoder: per label budget with `self_train` and per seed, with the first
    recipe; the overrides are its teacher's (the encoder's `own` among them), then the
    budget's `self_train`."""
    recipe = [(f"-{r.name}", r.finetune) for r in cfg.recipes[:1]] or [("", [])]
    seeds = [(f"-s{s}", [f"seed={s}"]) for s in cfg.finetune_seeds] or [("", [])]
    out = []
    for b in (b for b in cfg.labels if b.self_train is not None):
        r, budget = recipe[0][0], f"-l{labels_tag(b.per_class)}"
        base = [*recipe[0][1], f"data.labels_per_class={b.per_class}", *b.finetune]
        for tag, seed in seeds:
            teacher, name = r + budget + tag, r + budget + SELF_TRAINED + tag
            out.append((teacher, name, [*base, *own, *seed, *b.self_train]))
    return out


SCHEMAS = {"pretrain": PretrainConfig, "fewshot": FewshotConfig, "finetune": FinetuneConfig}


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


def check_jobs(jobs: list[Job]) -> None:
    """Every job's config file and overrides (the budget's, a recipe's, a label budget's, a
    variant's) loaded against the job's schema before the first job runs: a bad key or value
    is one line naming the job, not a failure hours later when that job starts."""
    for job in jobs:
        config, overrides = job_config(job.argv())
        try:
            load_config(SCHEMAS[job.stage], config, overrides)
        except ConfigError as e:
            sys.exit(f"error: {job.stage}/{job.name}: {e}")


BASELINES = ("random", "scratch")  # the random-init rows' job names


def only(jobs: list[Job], name: str) -> list[Job]:
    """The jobs of one chain: a variant's, or the baselines' (`baseline`, `random`, `scratch`)."""
    names = BASELINES if name in ("baseline", *BASELINES) else (name,)
    chosen = [j for j in jobs if j.chain in names]
    if not chosen:
        known = sorted({j.chain for j in jobs} - set(BASELINES)) + ["baseline"]
        sys.exit(f"error: --only {name}: no such variant (known: {', '.join(known)})")
    return chosen


def copy_small(out: Path, dest: Path) -> None:
    """The study's tree without its checkpoints (the large part): results, metrics, configs,
    logs, summary and report, to move or archive apart from the weights."""
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("checkpoints"), dirs_exist_ok=True)
    print(f"small artifacts of {out} copied to {dest} (checkpoints/ left out)")


STOPPED: list[str] = []  # the stop signal the study received while a job ran, if any
POLL_S, STATUS_EVERY_S = 2.0, 15.0  # how often a running job's progress is read, and shown


def job_status(run_dir: Path) -> str | None:
    """'step 350/1200, 412 img/s, eta 2m05s': a running job's progress from the last row of its
    metrics.jsonl and its config.yaml (None before its first logged step)."""
    try:
        rows = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        row = json.loads(rows[-1])  # a torn last line (being written): next time
        step, rate = int(row["step"]), float(row["img_per_s"])
    except (OSError, IndexError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    left = (train["steps"] - step) * train["batch_size"] / rate if rate > 0 else float("nan")
    return f"step {step}/{train['steps']}, {rate:.0f} img/s, eta {format_eta(left)}"


def job_fraction(run_dir: Path) -> float | None:
    """The share of its steps a running job has logged (None before its first row)."""
    try:
        rows = (run_dir / "metrics.jsonl").read_bytes().splitlines()
        steps = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"]
        return min(1.0, int(json.loads(rows[-1])["step"]) / int(steps))
    except (OSError, IndexError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


class StudyProgress:
    """The study's bar in images trained (`Job.weight`): a running job moves it as its steps are
    logged, so the ETA counts down during a long job too; a skipped job leaves the total."""

    def __init__(self, jobs: list[Job], enabled: bool) -> None:
        total = sum(job.weight for job in jobs)
        self.bar = progress_bar(total, enabled=enabled, desc="study", unit="img")
        self.done = 0  # the weight of the jobs that ended

    def running(self, job: Job, fraction: float) -> None:
        target = self.done + int(fraction * job.weight)
        if target > self.bar.n:
            self.bar.update(target - self.bar.n)

    def ended(self, job: Job, skipped: bool) -> None:
        if skipped:  # no time spent: it must not make the rate look faster
            self.bar.total -= job.weight
        else:
            self.done += job.weight
            self.bar.update(max(0, self.done - self.bar.n))


def execute(argv: list[str], log, tick: Callable[[], None] = lambda: None) -> int:
    """Run one job in its own process (isolated memory, a crash stays in its log), calling
    `tick` every few seconds while it runs.

    The job runs in its own session, so a signal sent to the study's process group reaches the
    job exactly once: forwarded here, and noted in `STOPPED` so that the study stops after it;
    a later Ctrl-C is forwarded too (the job's second Ctrl-C: it exits without checkpoint).
    The job dies with the study: killed by the kernel when the study dies (SIGKILL included,
    `ssl_vit.children`), and here on any other way out of this function (an exception)."""
    proc = start_child(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def forward(signum: int, _frame) -> None:
        if not STOPPED:
            STOPPED.append(signal.Signals(signum).name)
        elif signum != signal.SIGINT:  # the stop under way
            return
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:  # bounded: every job ends on its own after a signal (guard.py)
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                tick()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_child(proc)  # still running only when leaving on an exception


def finished(run_dir: Path) -> bool:
    """A job ran to its end (a preempted one writes results.json with `preempted`)."""
    results = read_results(run_dir)
    return bool(results) and not results.get("preempted", False)


def run_study_job(
    job: Job,
    log_dir: Path,
    dry_run: bool,
    say: Callable[[str], None] = print,
    progress: Callable[[float], None] = lambda _: None,
) -> str:
    """Run `job` unless its results exist; `say` prints a line (the progress bar's `write`),
    `progress(fraction)` is told how far the running job is. Returns the line that says how
    it ended."""
    label = f"{job.stage}/{job.name}"
    argv = job.argv()
    recorded, command = job.run_dir / "study_job.json", [Path(argv[1]).name, *argv[2:]]
    # The command is recorded next to the run: a run of another budget or other data in the
    # same directory (finished, or interrupted and about to be resumed) must not be mixed in.
    if recorded.is_file() and json.loads(recorded.read_text())["command"] != command:
        sys.exit(
            f"error: {label}: {job.run_dir} holds a run of another command (budget, model "
            "or data changed); use another output_dir or delete that run"
        )
    if finished(job.run_dir):
        return f"[skip] {label}: {job.run_dir}/results.json exists"
    if dry_run:
        return f"[plan] {label}: {shlex.join(argv)}"
    log = log_dir / f"{job.stage}-{job.name}.log"
    say(f"[run]  {label} (log: {log}) ...")
    t0 = time.time()
    job.run_dir.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps({"command": command}, indent=1) + "\n")
    shown = {"line": None, "at": time.monotonic()}

    def tick() -> None:  # the running job's own step, img/s and ETA, every STATUS_EVERY_S
        fraction = job_fraction(job.run_dir)
        if fraction is not None:
            progress(fraction)
        line = job_status(job.run_dir)
        if line and line != shown["line"] and time.monotonic() - shown["at"] >= STATUS_EVERY_S:
            say(f"       {label}: {line}")
            shown.update(line=line, at=time.monotonic())

    with open(log, "a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
        f.flush()
        # A few-shot job has nothing to resume: an interrupted one (this same command, as
        # checked above) is replaced rather than refused by the run-directory rule.
        rc = execute([*argv, "--overwrite"] if job.stage == "fewshot" else argv, f, tick)
    # Stopped: pretraining and fine-tuning checkpoint and exit 0, and the same command resumes
    # them; a few-shot job has nothing to save and ends on the signal, and is run again.
    if STOPPED and (rc == 0 or job.stage == "fewshot"):
        say(f"[stop] {label}: {STOPPED[0]}; run the same command again to resume")
        sys.exit(0)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        sys.exit(f"{tail}\nerror: {label} failed (exit {rc}); full log: {log}")
    return f"[done] {label} in {(time.time() - t0) / 60:.1f} min"


def summarize(cfg: StudyConfig, budget: StudyBudget, out: Path, preset: str) -> dict:
    """Collect the jobs' results.json into summary.json and a markdown table summary.md."""
    rows, jobs = [], finetunes(cfg)
    labelled = bool(cfg.labels or cfg.finetune_seeds)
    for v in [None, *cfg.variants]:
        name = v.name if v else BASELINE
        pre = read_results(out / "pretrain" / name) if v else {}
        few = read_results(out / "fewshot" / (name if v else "random"))
        ft_name = name if v else "scratch"
        ft = read_results(out / "finetune" / ft_name)
        # One fine-tune per recipe: top-1 and wall time by recipe name.
        by_recipe = {r.name: read_results(out / "finetune" / f"{ft_name}-{r.name}")
                     for r in cfg.recipes} if not labelled else {}  # fmt: skip
        # Label budgets and seeds: one column per recipe x budget, its seeds' top-1 values.
        runs = {tag: read_results(out / "finetune" / (ft_name + tag)) for tag, _ in jobs}
        by_labels = labels_columns(cfg, runs) if labelled else {}
        rows.append({
            "variant": name,
            "objective": to_dict(v.objective) if v else None,
            "pretrain_steps": pre.get("step", 0) if v else 0,
            "pretrain_loss": pre.get("loss"),
            "color_acc": pre.get("color_acc"),
            "color_acc_majority": pre.get("color_acc_majority"),
            # string keys, as they read back from summary.json
            "fewshot": {str(k): t for k, t in fewshot_table(few).items()},
            "finetune_top1": ft.get("top1"),
            "finetune_steps": ft.get("step"),
            "finetune_image_size": ft.get("image_size"),
            "finetune_by_recipe": {k: r.get("top1") for k, r in by_recipe.items()},
            "finetune_by_labels": by_labels,
            "wall_time_s": {
                "pretrain": pre.get("wall_time_s"),
                "fewshot": few.get("wall_time_s"),
                "finetune": _total([r.get("wall_time_s") for r in runs.values()])
                if len(runs) > 1 else ft.get("wall_time_s"),
            },
        })  # fmt: skip
        if v is not None and v.self_train and self_trainings(cfg):
            rows.append(self_trained_row(cfg, rows[-1], out / "finetune", ft_name))
    walls = [w for r in rows for w in r["wall_time_s"].values() if w is not None]
    summary = {
        "preset": preset,
        "output_dir": str(out),
        "jobs_wall_time_s": sum(walls),
        "rows": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown_table(rows) + "\n")
    return summary


def self_trained_row(cfg: StudyConfig, encoder_row: dict, finetunes_dir: Path, name: str):
    """The row of an encoder's self-trained fine-tunes: the encoder's pretraining and few-shot
    figures, its label-budget columns (those with self-training filled)."""
    runs = {teacher: read_results(finetunes_dir / (name + own))
            for teacher, own, _ in self_trainings(cfg)}  # fmt: skip
    return {
        **encoder_row,
        "variant": f"{encoder_row['variant']} + self-trained",
        "finetune_by_labels": labels_columns(cfg, runs),
        "wall_time_s": {"pretrain": None, "fewshot": None,
                        "finetune": _total([r.get("wall_time_s") for r in runs.values()])},
    }  # fmt: skip


def labels_columns(cfg: StudyConfig, runs: dict[str, dict]) -> dict[str, dict]:
    """{column: {"recipe", "labels_per_class", "num_labelled", "top1": [per seed]}} from one
    encoder's fine-tunes by run-name suffix; a column is a recipe x label budget."""
    columns: dict[str, dict] = {}
    for recipe in [r.name for r in cfg.recipes] or [""]:
        for k in [b.per_class for b in cfg.labels] or [None]:
            budget = "" if k is None else ("all labels" if k == 0 else f"{k}/class")
            col = " ".join(x for x in (recipe, budget) if x)
            tag = (f"-{recipe}" if recipe else "") + ("" if k is None else f"-l{labels_tag(k)}")
            found = [runs.get(tag + (f"-s{s}" if cfg.finetune_seeds else ""), {})
                     for s in cfg.finetune_seeds or [None]]  # fmt: skip
            done = [r for r in found if r.get("top1") is not None]
            columns[col or "fine-tune"] = {
                "recipe": recipe or None,
                "labels_per_class": k,
                "num_labelled": done[0].get("num_labelled") if done else None,
                "top1": [r["top1"] for r in done],
            }
    return columns


def _total(values: list[float | None]) -> float | None:
    """The sum of the values known (None if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def markdown_table(rows: list[dict]) -> str:
    shots = sorted({k for r in rows for k in r["fewshot"]}, key=shot_order)  # 1, 5, ..., all
    recipes = list(rows[0]["finetune_by_recipe"]) if rows else []
    labels = list(rows[0].get("finetune_by_labels") or {}) if rows else []
    head = ["variant", "pretraining steps", "colour acc"] + [f"{k}-shot (%)" for k in shots]
    if labels:  # mean over the fine-tuning seeds, then each seed's value
        head += [f"fine-tune {c} (%)" for c in labels]
    else:
        head += [f"fine-tune top-1 ({r}) (%)" for r in recipes] or ["fine-tune top-1 (%)"]
    head += ["wall: pretrain / few-shot / fine-tune (min)"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        few = [r["fewshot"].get(str(k)) for k in shots]
        cells = [
            r["variant"],
            str(r["pretrain_steps"]),
            "-" if r["color_acc"] is None else f"{r['color_acc']:.3f}",
        ]
        cells += [f"{pct(f['mean'])} ± {pct(f['std'])}" if f else "-" for f in few]
        if labels:
            cells += [seeds_cell(c["top1"]) for c in r["finetune_by_labels"].values()]
        else:
            by_recipe = [pct(t) for t in r["finetune_by_recipe"].values()]
            cells += by_recipe or [pct(r["finetune_top1"])]
        cells.append(
            " / ".join("-" if w is None else f"{w / 60:.1f}" for w in r["wall_time_s"].values())
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_cell(top1: list[float]) -> str:
    """'36.3 (35.1 / 37.5)': the mean over seeds in %, then each seed's; '-' if none ran."""
    if not top1:
        return "-"
    mean = f"{100 * sum(top1) / len(top1):.1f}"
    return mean if len(top1) == 1 else f"{mean} ({' / '.join(f'{100 * t:.1f}' for t in top1)})"


def report(run_dirs: list[Path], out: Path) -> None:
    """`ssl-vit report` over all runs (its figures need the `report` extra, matplotlib)."""
    cmd = ["report", *map(str, run_dirs), "--output", str(out)]
    argv = [sys.executable, "-m", "ssl_vit.cli", *cmd]
    rc = subprocess.run(argv, preexec_fn=die_with_parent()).returncode  # it dies with the study
    print(f"report: {out / 'report.html' if rc == 0 else f'failed (exit {rc})'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="study YAML (see configs/study/)")
    p.add_argument("--quick", action="store_true", help="the `quick` budget (a CPU machine)")
    p.add_argument("--preset", choices=BUDGETS, help="the budget (default full)")
    p.add_argument("--only", metavar="NAME", help="one variant's chain, or `baseline`")
    p.add_argument("--copy-small", metavar="DIR", help="copy the small artifacts to DIR, then exit")
    p.add_argument("--dry-run", action="store_true", help="print the jobs' commands only")
    p.add_argument(
        "--summary", action="store_true", help="only tabulate the finished jobs (summary.*)"
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the study config")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    try:
        cfg = load_config(StudyConfig, args.config, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    preset = args.preset or ("quick" if args.quick else "full")
    others = set(BUDGETS) - {preset}  # e.g. quick.output_dir=... without --quick: no effect
    for key in (o.split("=")[0] for o in args.overrides if o.split(".")[0] in others):
        sys.exit(f"error: {key}: this run uses the `{preset}` budget, not that one")
    budget = getattr(cfg, preset)
    if not budget.output_dir:
        sys.exit(f"error: {preset}.output_dir: required")
    out = Path(budget.output_dir)
    jobs = plan(cfg, budget, out)
    if args.copy_small:
        return copy_small(out, Path(args.copy_small))
    planned = jobs
    if args.only:
        jobs = only(jobs, args.only)
    if args.summary:  # e.g. while a long study runs, or after it was stopped
        summarize(cfg, budget, out, preset)
        print((out / "summary.md").read_text())
        return None
    check_jobs(planned)  # all of them, whichever run now
    if not args.dry_run:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "study.yaml")
    t0 = time.time()
    print(f"study: {len(jobs)} jobs, {preset} budget, in {out}", flush=True)
    # Job by job, with the share done and an ETA from the work done so far (a bar on a
    # terminal): each job weighs the images it trains on (StudyProgress).
    bar = StudyProgress(jobs, enabled=not args.dry_run)
    say = print if args.dry_run else bar.bar.write
    for job in jobs:
        line = run_study_job(
            job, out / "logs", args.dry_run, say, lambda f, job=job: bar.running(job, f)
        )
        bar.ended(job, skipped=line.startswith("[skip]"))
        say(line)
    bar.bar.close()
    if args.dry_run:
        return None
    summary = summarize(cfg, budget, out, preset)
    print(f"study: done in {(time.time() - t0) / 60:.1f} min this time "
          f"({summary['jobs_wall_time_s'] / 60:.1f} min of jobs in all)\n")  # fmt: skip
    print((out / "summary.md").read_text())
    if args.only:  # the report is of the whole study: the run without --only writes it
        return summary
    report([job.run_dir for job in jobs], out)
    return summary


if __name__ == "__main__":
    main()
