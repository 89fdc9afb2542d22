"""Reading run directories: what kind of job made them, their config, metrics and results,
and which pretraining run a few-shot or fine-tuning run started from.

A run directory holds `config.yaml`, `metrics.jsonl` and `results.json` (pipelines/*.py).
Its kind comes from the config's sections: `objective` (pretrain), `init` (fine-tune),
`shots` (few-shot), `top_k` (predict). A `results.json` with `"job": "predict"` (`ssl-vit
predict`) makes a predict output directory, with or without a config.yaml.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ssl_vit.atomic import read_jsonl
from ssl_vit.errors import InputError
from ssl_vit.eval.shots import shot_key, shot_order
from ssl_vit.jobs import FEWSHOT, FINETUNE, PREDICT, PRETRAIN, Job, by_config
from ssl_vit.report.checks import (
    DamagedRunError,
    json_type,
    predictions_problem,
    results_problem,
    rows_problem,
)

__all__ = [
    "DamagedRunError",
    "Run",
    "fewshot_pool",
    "fewshot_table",
    "link_runs",
    "load_runs",
    "read_config",
    "read_results",
    "run_dir_of",
    "source_checkpoint",
    "step_of",
]

log = logging.getLogger(__name__)


@dataclass
class Run:
    """One job's outputs. `rows`: metrics.jsonl lines; `results`: results.json ({} if absent)."""

    path: Path
    job: Job  # pretrain, finetune, fewshot or predict
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def finished(self) -> bool:
        return bool(self.results)

    def checkpoints(self) -> list[Path]:
        """Finished checkpoint directories, oldest first (pretraining and fine-tuning)."""
        root = self.path / "checkpoints"
        if not root.is_dir():
            return []
        return sorted(p for p in root.iterdir() if (p / "manifest.json").is_file())


def fewshot_pool(config: dict[str, Any]) -> str:
    """The pooling of a run's summarized readout, from its config.yaml: a few-shot run's
    `fewshot.pool` (`pool` at the top level before that section), a fine-tune's `pool`."""
    return (config.get("fewshot") or {}).get("pool") or config.get("pool", "cls")


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config (config.yaml) of a run directory; {} if it has none."""
    cfg_file = Path(run_dir) / "config.yaml"
    return (yaml.safe_load(cfg_file.read_text()) or {}) if cfg_file.is_file() else {}


def read_results(run_dir: str | Path) -> dict[str, Any]:
    """The final results (results.json) of a run directory; {} while it has none (or an
    unreadable one, or one that is no JSON object, logged: the run counts as unfinished rather
    than stopping the reader). The report reads them strictly (`load_runs`)."""
    res_file = Path(run_dir) / "results.json"
    try:
        results = json.loads(res_file.read_text()) if res_file.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s), taken as no results yet", res_file, e)
        return {}
    if not isinstance(results, dict):
        log.warning("%s: a JSON %s, not an object, taken as no results yet", res_file,
                    json_type(results))  # fmt: skip
        return {}
    return results


# A results.json read once: its object, what is wrong with it, or None where there is none.
Results = dict[str, Any] | DamagedRunError | None


def _read_results(path: Path) -> Results:
    """A run directory's results.json, read once: its object, a DamagedRunError (unreadable,
    or no file a job writes: `checks.results_problem`), or None when there is none."""
    res_file = path / "results.json"
    if not res_file.is_file():
        return None
    try:
        results = json.loads(res_file.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested 10^5 deep
        return DamagedRunError(f"{res_file}: unreadable ({str(e) or type(e).__name__})")
    problem = results_problem(results)
    return DamagedRunError(f"{res_file}: {problem}") if problem else results


def _is_run_dir(path: Path, results: Results) -> bool:
    """A job's run directory, a finished predict output directory (results.json says so), or
    a damaged one (a results.json no job writes: named by the reader, not walked into)."""
    if (path / "config.yaml").is_file() or isinstance(results, DamagedRunError):
        return True
    return results is not None and results.get("job") == PREDICT.name


class _NotReportedError(InputError):
    """A run of a job the report has no figures for (a selection); the message names it."""


def _load(path: Path, results: Results) -> Run:
    """The run in `path` given its results.json (`_read_results`); DamagedRunError when a file
    the report reads is no file a job writes, ValueError when `path` is no ssl-vit run."""
    if isinstance(results, DamagedRunError):
        raise results
    results = results or {}
    if results.get("job") == PREDICT.name:  # its config.yaml (if any) is no training job's
        found = predictions_problem(path, results.get("images"))
        if found is not None:
            raise DamagedRunError(f"{found[0]}: {found[1]}")
        return Run(path, PREDICT, _config(path), _rows(path), results)
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise InputError(f"{path}: no config.yaml, not an ssl-vit run directory")
    config = _config(path)
    job = by_config(config)  # a predict job's config.yaml (`top_k`) too, before results
    if job is not None and not job.rundir:  # a selection: no figures of a trained model
        raise _NotReportedError(f"{path}: a {job.title} run (picks, no trained model's figures)")
    if job is None:
        raise InputError(f"{cfg_file}: not a pretrain, fine-tune, few-shot or predict config")
    return Run(path, job, config, _rows(path), results)


def _config(path: Path) -> dict[str, Any]:
    """config.yaml of a run directory ({} if none); DamagedRunError if unreadable or not a
    mapping."""
    try:
        config = read_config(path)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise DamagedRunError(f"{path / 'config.yaml'}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise DamagedRunError(
            f"{path / 'config.yaml'}: a YAML {type(config).__name__}, not a mapping"
        )
    return config


def _rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows ([] if none). A torn last line (a job killed mid-write) is dropped
    with a warning; a corrupt line before it, or a row the report cannot plot, is damage."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return []
    try:
        rows = read_jsonl(metrics)
    except (OSError, ValueError) as e:  # ValueError: "file:line: corrupt line (...)"
        raise DamagedRunError(
            str(e) if str(e).startswith(str(metrics)) else f"{metrics}: {e}"
        ) from None
    if problem := rows_problem(rows):
        raise DamagedRunError(f"{metrics}: {problem}")
    return rows


def _run_dirs(folder: Path) -> list[tuple[Path, Results]]:
    """Run directories at any depth below `folder` (a run's own subdirectories are not
    searched), sorted by path, with their results.json: a study's `pretrain/x`, `fewshot/x`,
    ... included.

    A symlink to a directory is not followed (logged): it may lead out of the tree, back up
    into it (a loop, walked forever) or to a run found under its own path; a run it points to
    is listed when named itself."""
    found: list[tuple[Path, Results]] = []
    for q in sorted(d for d in folder.iterdir() if d.is_dir()):
        if q.is_symlink():
            log.warning("%s: symlink to a folder, not followed (name its target to include it)", q)
        elif _is_run_dir(q, results := _read_results(q)):
            found.append((q, results))
        else:
            found.extend(_run_dirs(q))
    return found


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Runs in the order given; a directory holding run directories (not a run itself) is
    expanded to the runs below it, at any depth, sorted by path (`_run_dirs`). A run reached
    twice (named twice, or inside a folder also named) is listed once, where first reached.

    A damaged run (a file no job writes: `checks`) is left out with one logged line naming the
    file and what is wrong, a selection (`ssl-vit select`: picks, no figures) with one naming
    it; ValueError when no run is left."""
    runs: list[Run] = []
    seen: set[Path] = set()
    damaged = others = 0
    for p in map(Path, paths):
        if not p.is_dir():
            raise InputError(f"{p}: no such directory")
        results = _read_results(p)
        subs = [(p, results)] if _is_run_dir(p, results) else _run_dirs(p)
        if not subs:
            raise InputError(f"{p}: neither a run directory nor a folder of runs")
        for q, res in subs:
            if q.resolve() in seen:
                continue
            seen.add(q.resolve())
            try:
                runs.append(_load(q, res))
            except DamagedRunError as e:
                log.warning("%s (left out of the report)", e)
                damaged += 1
            except _NotReportedError as e:
                log.info("%s: left out of the report", e)
                others += 1
    if not runs:
        kinds = " and ".join(
            [f"{damaged} damaged"] * bool(damaged) + [f"{others} selection(s)"] * bool(others)
        )
        raise InputError(f"no run to report: the runs found are {kinds} (logged above)")
    return runs


def source_checkpoint(run: Run) -> str | None:
    """The encoder checkpoint a fine-tune / few-shot run started from (None: random init)."""
    if run.job is FINETUNE:
        ckpt = (run.config.get("init") or {}).get("checkpoint") or ""
    elif run.job is FEWSHOT:
        ckpt = run.results.get("checkpoint") or ""
    else:
        return None
    return None if ckpt in ("", "random", "none") else str(ckpt)


def _checkpoint_dir(checkpoint: str | Path) -> Path:
    """A checkpoint directory, given it or a file in it (paths from configs may not exist)."""
    ckpt = Path(checkpoint)
    return ckpt.parent if ckpt.name == "encoder.safetensors" or ckpt.is_file() else ckpt


def step_of(checkpoint: str | Path) -> int | None:
    """The step of a checkpoint `.../step_N` (or a file in it); None if not named so."""
    name = _checkpoint_dir(checkpoint).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The run directory of a checkpoint `RUN/checkpoints/step_N` (or a file in it); None when
    it is not inside one."""
    ckpt = _checkpoint_dir(checkpoint)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None


def _belongs(checkpoint: str, pre: Run) -> bool:
    """Whether `checkpoint` (as written in a config, maybe relative to another working
    directory) lies in pretraining run `pre`: by resolved path, else by the run's output_dir."""
    run_dir = run_dir_of(checkpoint)
    if run_dir is None:
        return False
    if run_dir.exists() and run_dir.resolve() == pre.path.resolve():
        return True
    out = str(pre.config.get("output_dir", "")).rstrip("/")
    return bool(out) and Path(out).parts == run_dir.parts


def link_runs(runs: list[Run]) -> dict[str | None, list[tuple[Run, int | None]]]:
    """Few-shot and fine-tune runs grouped by the pretraining run they came from (predict runs
    are in no group): {pretraining run name, or None for random init / scratch, or the
    checkpoint path when it is in none of the runs given: [(run, checkpoint step)]}."""
    pretrains = [r for r in runs if r.job is PRETRAIN]
    groups: dict[str | None, list[tuple[Run, int | None]]] = {}
    for run in runs:
        if run.job not in (FEWSHOT, FINETUNE):
            continue
        ckpt = source_checkpoint(run)
        owner = None
        if ckpt is not None:
            owner = next((p.name for p in pretrains if _belongs(ckpt, p)), None)
            if owner is None:
                log.info("%s: its checkpoint %s is not in the runs given", run.name, ckpt)
                groups.setdefault(ckpt, []).append((run, None))  # the path names the step
                continue
        groups.setdefault(owner, []).append((run, None if ckpt is None else step_of(ckpt)))
    return groups


def fewshot_table(results: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """{shots: {"mean", "std", "per_seed", "l2_reg"}} at the first L2 regularizer (the one the
    pipelines summarize), from a few-shot results dict (fewshot_evaluate's); shots are ints
    then "all" (the full linear probe), in that order."""
    table = {}
    for k, entry in (results.get("shots") or {}).items():
        regs = entry.get("l2_reg") or {}
        if not regs:
            continue
        reg, r = next(iter(regs.items()))
        table[shot_key(k)] = {**r, "l2_reg": float(reg)}
    return dict(sorted(table.items(), key=lambda kv: shot_order(kv[0])))
