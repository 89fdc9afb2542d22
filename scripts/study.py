"""The paper's pretraining study in one command (Dosovitskiy et al. 2021, section 4.6).

    python scripts/study.py --config configs/study/cifar10.yaml [--quick] [--dry-run] [k=v ...]

For every variant of the config (objective target, corruption ratio): pretrain -> few-shot
evaluation of the checkpoint -> fine-tuning from it (at `finetune_image_size`, position
embeddings interpolated); plus the same few-shot evaluation of a random-init encoder and the
same fine-tuning from scratch. Each job is the ordinary pipeline (pipelines/*.py) in its own
process (forked from the study, which imports the pipelines once: no job waits seconds for its
imports; `--jobs N`: N at once, each after the jobs it needs), its output in
`<output_dir>/<stage>/<name>/` and its log in `<output_dir>/logs/`.
A finished job (results.json) is skipped and an interrupted pretraining or fine-tuning resumes
from its newest checkpoint, so the study can be stopped (SIGTERM, Ctrl-C, its terminal closed:
the running job checkpoints, then the study exits 0) and started again; a failed job stops it
with exit 1.
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
import contextlib
import errno
import json
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

import ssl_vit.cli
from ssl_vit.children import fork_script, preload, stop_child
from ssl_vit.config import ConfigError, load_config, save_config
from ssl_vit.config.study import StudyConfig
from ssl_vit.progress import format_eta, progress_bar
from ssl_vit.report.runs import read_results
from ssl_vit.study.jobs import Job, job_config, plan
from ssl_vit.study.summary import summarize

BUDGETS = ("full", "quick", "gpu")  # the study config's budget sections


def check_jobs(jobs: list[Job]) -> None:
    """Every job's config file and overrides (the budget's, a recipe's, a label budget's, a
    variant's) loaded against the job's schema before the first job runs: a bad key or value
    is one line naming the job, not a failure hours later when that job starts."""
    for job in jobs:
        config, overrides = job_config(job.argv())
        try:
            load_config(job.stage.config_class, config, overrides)
        except ConfigError as e:
            sys.exit(f"error: {job.stage.name}/{job.name}: {e}")


SOURCE_KEYS = ("data.train_shards", "data.train", "data.eval", "fewshot.train", "fewshot.eval")


def check_sources(jobs: list[Job]) -> None:
    """Every data source the jobs read, opened once before the first job runs, as the job
    will open it: a missing or unreadable one is one line naming the job (a typo in data.eval
    stopped the first fine-tune, after the pretraining had run)."""
    from ssl_vit.train import preflight
    from ssl_vit.train.distill import check_unlabelled

    seen: set[tuple[str, str]] = set()
    for job in jobs:
        cfg = load_config(job.stage.config_class, *job_config(job.argv()))
        for key in (*SOURCE_KEYS, "distill.unlabelled"):
            section, _, name = key.partition(".")
            spec = str(getattr(getattr(cfg, section, None), name, None) or "")
            if not spec or (key, spec) in seen:
                continue
            seen.add((key, spec))
            try:  # the jobs' own checks: each a ConfigError naming the key
                if key == "data.train_shards":
                    preflight.check_shards(key, spec)
                elif key == "distill.unlabelled":  # (and that it holds a step's images)
                    check_unlabelled(cfg)
                else:
                    preflight.check_labelled_source(key, spec)
            except ConfigError as e:
                sys.exit(f"error: {job.stage.name}/{job.name}: {e}")


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
        self.share: dict[Path, int] = {}  # of each running job, the weight of its logged steps

    def running(self, job: Job, fraction: float) -> None:
        self.share[job.run_dir] = int(fraction * job.weight)
        target = self.done + sum(self.share.values())
        if target > self.bar.n:
            self.bar.update(target - self.bar.n)

    def ended(self, job: Job, skipped: bool) -> None:
        self.share.pop(job.run_dir, None)
        if skipped:  # no time spent: it must not make the rate look faster
            self.bar.total -= job.weight
        else:
            self.done += job.weight
            self.bar.update(max(0, self.done - self.bar.n))


RUNNING: list = []  # the jobs' processes running now: a stop signal reaches each once


def forward(signum: int, _frame, relay: int | None = None) -> None:
    """The study's SIGTERM / SIGINT while jobs run: noted in `STOPPED` (the study stops after
    them) and relayed to each job (as `relay` if given); a later Ctrl-C is relayed too (a job's
    second Ctrl-C: it exits without checkpoint)."""
    if not STOPPED:
        STOPPED.append(signal.Signals(signum).name)
    elif signum != signal.SIGINT:  # the stop under way
        return
    for proc in RUNNING:
        proc.send_signal(relay or signum)


def hang_up(signum: int, frame) -> None:
    """The study's terminal closed (SIGHUP; the jobs, in sessions of their own, get none): its
    output goes to /dev/null from here, since a write to the closed terminal would fail and end
    the study (and, with it, the jobs by SIGKILL, losing their steps since the last checkpoint),
    and the jobs stop as on SIGTERM: each checkpoints, the study exits 0; running it again
    resumes them."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)
    forward(signum, frame, relay=signal.SIGTERM)


@contextlib.contextmanager
def relaying() -> Iterator[None]:
    """Jobs started inside get the study's stop signals (`forward`, `hang_up`) and die with it:
    killed by the kernel when the study dies (SIGKILL included, `ssl_vit.children`), and here on
    any way out of the block with one still running (an exception). Under `nohup` (SIGHUP
    ignored) a closed terminal stays ignored."""
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, hang_up)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in RUNNING:
            stop_child(proc)
        RUNNING.clear()


def start(argv: list[str], log, threads: int = 0):
    """One job in its own process (isolated memory, a crash stays in its log), in its own
    session, so a signal sent to the study's process group reaches it exactly once (relayed).
    The process is forked from the study, which has imported the pipelines once (`preload`):
    a job starts in a fraction of a second instead of the seconds a new interpreter spends
    importing torch (`ssl_vit.children.fork_script`)."""
    proc = fork_script(argv, log, threads)
    RUNNING.append(proc)
    return proc


def finished(run_dir: Path) -> bool:
    """A job ran to its end (a preempted one writes results.json with `preempted`)."""
    results = read_results(run_dir)
    return bool(results) and not results.get("preempted", False)


@dataclass
class Started:
    """A job running in its process, with what its end needs."""

    job: Job
    proc: object  # subprocess.Popen or ForkedScript
    log: Path
    tick: Callable[[], None]
    t0: float = field(default_factory=time.time)


def begin(
    job: Job,
    log_dir: Path,
    dry_run: bool,
    say: Callable[[str], None] = print,
    progress: Callable[[float], None] = lambda _: None,
    threads: int = 0,
) -> Started | str:
    """Start `job` unless its results exist (then the line that says so); `say` prints a line
    (the progress bar's `write`), `progress(fraction)` is told how far the running job is."""
    label = f"{job.stage.name}/{job.name}"
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
    log = log_dir / f"{job.stage.name}-{job.name}.log"
    say(f"[run]  {label} (log: {log}) ...")
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
        proc = start(argv if job.stage.resumes else [*argv, "--overwrite"], f, threads)
    return Started(job, proc, log, tick)


def end(run: Started) -> str:
    """The line that says how a job that ended did; a failed one exits the study (1)."""
    label, rc = f"{run.job.stage.name}/{run.job.name}", run.proc.poll()
    # Stopped: pretraining and fine-tuning checkpoint and exit 0, and the same command resumes
    # them; a few-shot job has nothing to save and ends on the signal, and is run again.
    if STOPPED and (rc == 0 or not run.job.stage.resumes):
        return f"[stop] {label}: {STOPPED[0]}; run the same command again to resume"
    if rc != 0:
        tail = "".join(run.log.read_text().splitlines(keepends=True)[-15:])
        sys.exit(f"{tail}\nerror: {label} failed (exit {rc}); full log: {run.log}")
    return f"[done] {label} in {(time.time() - run.t0) / 60:.1f} min"


def ready_jobs(pending: list[Job], busy: set[Path], needed: set[Path]) -> list[Job]:
    """The pending jobs that need none of the `busy` ones (pending or running), in the order
    they start: those that others wait on first (a pretraining before the baselines, whose
    fine-tunes fill the other slots meanwhile), then the heaviest (`Job.weight`, the images
    it trains on): a long job started last runs alone at the end while the other slots idle
    (the quick start with a 1,500-step online row: its last job ran 3.8 min alone); ties in
    the plan's order."""
    ready = [j for j in pending if not busy & set(j.after)]
    return sorted(ready, key=lambda j: (j.run_dir not in needed, -j.weight))


def run_jobs(jobs: list[Job], slots: int, log_dir: Path, bar: StudyProgress) -> None:
    """Every job, up to `slots` at once, each with its share of the cores' threads: a job
    starts when the jobs it needs (`Job.after`) have ended, in `ready_jobs`' order.
    A stop relays to every running job and starts no other; a failure stops the others
    (they checkpoint) and exits 1."""
    threads = max(1, torch.get_num_threads() // slots) if slots > 1 else 0
    needed = {d for job in jobs for d in job.after}
    pending, running, ticked = list(jobs), [], time.monotonic()

    def turn() -> None:  # start what is ready, collect what ended, the running jobs' status
        nonlocal ticked
        busy = {j.run_dir for j in pending} | {r.job.run_dir for r in running}
        ready = ready_jobs(pending, busy, needed) if not STOPPED else []
        for job in ready[: slots - len(running)]:
            pending.remove(job)
            run = begin(job, log_dir, False, bar.bar.write,
                        lambda f, job=job: bar.running(job, f), threads)  # fmt: skip
            if isinstance(run, str):  # finished before
                bar.ended(job, skipped=True)
                bar.bar.write(run)
            else:
                running.append(run)
        time.sleep(0.05 if running else 0)
        for run in [r for r in running if r.proc.poll() is not None]:
            running.remove(run)
            if run.proc in RUNNING:  # ended: no signal for it any more
                RUNNING.remove(run.proc)
            line = end(run)
            bar.ended(run.job, skipped=False)
            bar.bar.write(line)
        if time.monotonic() - ticked >= POLL_S:
            ticked = time.monotonic()
            for run in running:
                run.tick()

    with relaying():
        try:
            while running or (pending and not STOPPED):
                try:
                    turn()
                except OSError as e:  # a write to the terminal closing, before its SIGHUP came
                    if e.errno != errno.EIO:
                        raise
                    hang_up(signal.SIGHUP, None)
        except SystemExit:  # a job failed, or a run directory holds another command's run
            for run in running:  # they checkpoint and end; then the study exits
                run.proc.send_signal(signal.SIGTERM)
            for run in running:
                run.proc.wait()
            raise
    if STOPPED:
        sys.exit(0)


def report(run_dirs: list[Path], out: Path) -> None:
    """`ssl-vit report` over all runs (its figures need the `report` extra, matplotlib), in
    this process: every job has ended, and torch is imported already (a new interpreter spent
    ~10 s of the quick start importing it again). A failed report does not fail the study."""
    try:
        rc = ssl_vit.cli.main(["report", *map(str, run_dirs), "--output", str(out)])
    except Exception:  # a bug in the report: its traceback, and the study's summary stands
        traceback.print_exc()
        rc = 1
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
        "--jobs", type=int, default=1, metavar="N",
        help="run N jobs at once, each with 1/N of the cores' threads (default 1); small "
        "models train faster so on a CPU (the quick start: 2)",
    )  # fmt: skip
    p.add_argument(
        "--summary", action="store_true", help="only tabulate the finished jobs (summary.*)"
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the study config")
    args = p.parse_intermixed_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs: {args.jobs}: needs 1 or more")
    return args


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
    planned = plan(cfg, budget, out)
    if args.copy_small:
        return copy_small(out, Path(args.copy_small))
    jobs = only(planned, args.only) if args.only else planned
    if args.summary:  # e.g. while a long study runs, or after it was stopped
        summarize(cfg, budget, out, preset)
        print((out / "summary.md").read_text())
        return None
    check_jobs(planned)  # all of them, whichever run now
    if not args.dry_run:
        check_sources(planned)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "study.yaml")
    t0 = time.time()
    print(f"study: {len(jobs)} jobs, {preset} budget, in {out}", flush=True)
    for script in {j.argv()[1] for j in jobs if not (args.dry_run or finished(j.run_dir))}:
        preload(script)  # once here rather than in every job's process
    if args.dry_run:
        for job in jobs:
            print(begin(job, out / "logs", dry_run=True))
        return None
    # With the share done and an ETA from the work done so far (a bar on a terminal): each
    # job weighs the images it trains on (StudyProgress).
    bar = StudyProgress(jobs, enabled=True)
    run_jobs(jobs, args.jobs, out / "logs", bar)
    bar.bar.close()
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
