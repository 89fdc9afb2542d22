"""A run directory belongs to one job at a time and holds one run.

The job holds its run directory's lock for its life (`runs.lock.lock_run_dir`). Starting over
a directory that holds a run needs `--resume` (continue it) or `--overwrite` (its run files are
removed first): two runs are never mixed in one directory. A `--resume` that would continue
another run (another kind, model shape or sample order: `check_resumed_config`) is refused in
one line, any other changed key is a warning. Once the directory is claimed (locked: no other
job is writing them), the temporary files a killed job left beside its run files are removed
(`atomic.replacing`'s, e.g. a predict's hidden predictions file with its PID). `config.yaml` is
written only once all of this passed, so a refused or failed start never changes what a later
`--resume` reads. No command writes into, replaces or removes what another job reads, nor
writes a run into a dataset or a checkpoint (`runs.occupancy.check_not_source`, `holds_data`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from ssl_vit import jobs
from ssl_vit.atomic import clean_temporary
from ssl_vit.config import ConfigError, to_dict
from ssl_vit.config.loader import flat_keys, read_yaml_file, save_config
from ssl_vit.config.schema import SHAPE_KEYS
from ssl_vit.data.stream_state import check_same_stream
from ssl_vit.jsonfile import parse_json
from ssl_vit.runs.lock import RunLock, lock_run_dir
from ssl_vit.runs.occupancy import check_not_source, holds_data, read_paths, saved_job
from ssl_vit.train.checkpoint import ENCODER_FILE, checkpoint_dirs
from ssl_vit.train.weights_file import read_header

__all__ = [
    "check_resumed_config",
    "claim_run_dir",
    "release_new_run",
    "run_files",
]

log = logging.getLogger(__name__)

# Keys whose change on --resume would load a checkpoint into another architecture.
_RESUME_SHAPE = (
    *(f"model.{k}" for k in ("variant", "image_size", *SHAPE_KEYS)),
    "objective.target",
)
# Keys of the training stream's sample order: a saved position means other samples under
# another value (the shard list is compared by the loader, by content: a moved dataset resumes).
# A label budget's K and seed choose the samples (its labelled.json is compared before this).
STREAM_KEYS = (
    *("seed", "data.shuffle_buffer", "data.resampled"),
    *("data.labels_per_class", "data.labels_seed"),
)
# The model keys a checkpoint's encoder records that --resume must keep.
_CHECKPOINT_SHAPE = ("image_size", *SHAPE_KEYS)


def run_files(run_dir: Path) -> list[Path]:
    """The files of a run that `run_dir` holds (empty `checkpoints/` excluded)."""
    found = sorted({p for pattern in jobs.RUN_FILES for p in run_dir.glob(pattern)})
    return [p for p in found if not (p.is_dir() and not any(p.iterdir()))]


def check_resumed_config(run_dir: Path, cfg: Any, *, finished: bool = False) -> None:
    """Refuse another kind of run, a changed shape or sample order on --resume; log every
    other changed key. Without config.yaml, the shape is compared with the newest checkpoint's.

    finished: the run has ended (`loop.finished_run`): `cfg` as loaded, so its keys left
    null (an init checkpoint's, never read for it) are not compared, and nothing is logged."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        _check_checkpoint_shape(run_dir, cfg)
        return
    saved_tree = read_yaml_file(saved_file) or {}  # bounded in size, depth and values
    if not isinstance(saved_tree, dict):
        raise ConfigError(f"{saved_file}: unreadable (not a mapping of config keys)")
    saved_job, job = jobs.by_config(saved_tree), jobs.by_config(to_dict(cfg))
    if None not in (saved_job, job) and saved_job is not job:
        raise ConfigError(
            f"--resume: output_dir={str(run_dir)!r} holds a {saved_job.title} run, not a "
            f"{job.title} run; start this job in another output_dir"
        )
    saved, new = flat_keys(saved_tree), flat_keys(to_dict(cfg))
    if finished:
        new = {k: v for k, v in new.items() if v is not None}
    # Keys only one side has (a config written by another version) cannot be compared.
    changed = [k for k in sorted(set(saved) & set(new) - {"output_dir"}) if saved[k] != new[k]]
    shape = [k for k in changed if k in _RESUME_SHAPE]
    if shape:
        diffs = ", ".join(f"{k} {saved[k]!r} -> {new[k]!r}" for k in shape)
        raise ConfigError(
            f"--resume: the run in {run_dir} has another model shape ({diffs}); resume with its "
            f"config, or start a new run in another output_dir"
        )
    stream = {k: k for k in changed if k in STREAM_KEYS}
    check_same_stream(saved, new, stream, f"the data stream of the run in {run_dir}", ConfigError)
    for k in () if finished else changed:
        log.warning("--resume with a changed %s: %r -> %r", k, saved[k], new[k])


def _check_checkpoint_shape(run_dir: Path, cfg: Any) -> None:
    """--resume of a run whose config.yaml is missing: the model shape asked for must be that
    of its newest checkpoint (the encoder's metadata: no weights are read)."""
    for ckpt in reversed(checkpoint_dirs(run_dir / "checkpoints")):
        try:
            saved = parse_json(read_header(ckpt / ENCODER_FILE)[0]["model_config"], "model_config")
        except Exception:  # noqa: BLE001 - an unreadable checkpoint: resume skips it too
            continue
        new = to_dict(cfg.model)
        both = [k for k in _CHECKPOINT_SHAPE if new.get(k) is not None and saved.get(k) is not None]
        shape = [k for k in both if new[k] != saved[k]]
        if shape:
            diffs = ", ".join(f"model.{k} {saved[k]!r} -> {new[k]!r}" for k in shape)
            raise ConfigError(
                f"--resume: the newest checkpoint {ckpt} has another model shape ({diffs}); "
                "resume with its shape, or start a new run in another output_dir"
            )
        return


def claim_run_dir(
    run_dir: str | Path,
    cfg: Any,
    *,
    resume: bool = False,
    overwrite: bool = False,
    reads: dict[str, str] | None = None,
) -> RunLock:
    """Lock `run_dir`, apply the resume / overwrite rule, then write `config.yaml` (main
    process only). Raises ConfigError (one line) when the directory may not be used.

    `reads`: {key: path} the job reads besides the sources its config names (`read_paths`),
    e.g. few-shot's `--checkpoint`; an `--overwrite` of one of them is refused."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: pick one (continue the run, or replace it)")
    if (what := holds_data(run_dir)) is not None:
        raise ConfigError(
            f"output_dir={str(run_dir)!r}: holds {what}; start this job in a folder of its own"
        )
    # `reads` first: a flag the user typed (--checkpoint) is named before its config key.
    check_not_source("output_dir", run_dir, {**(reads or {}), **read_paths(cfg)}, replace=overwrite)
    lock = lock_run_dir(run_dir)
    try:
        _apply_policy(run_dir, cfg, resume, overwrite)
        for p in clean_temporary(run_dir, jobs.RUN_FILES):  # locked: a killed job's, none live
            log.info("removed %s, left by a killed job", p)
        save_config(cfg, run_dir / "config.yaml")  # atomic
    except BaseException:
        lock.release()  # refused: the directory is free again at once
        raise
    return lock


def _apply_policy(run_dir: Path, cfg: Any, resume: bool, overwrite: bool) -> None:
    existing = run_files(run_dir)
    saved = _saved_job(run_dir) if existing else None
    if saved is not None and not saved.rundir:
        # A selection's folder (its picks, to-label/ with the user's labels): no run job's
        # --resume or --overwrite may write over its records.
        raise ConfigError(
            f"output_dir={str(run_dir)!r}: holds a {saved.title} run (its picks, to-label/); "
            "start this job in another output_dir"
        )
    other = saved is not None and saved is not jobs.by_config(to_dict(cfg))
    what = f"{saved.title} run" if other else "run"
    if existing and overwrite:
        kind = f"{saved.title} run" if saved is not None else "run"
        log.warning("--overwrite: removing the earlier %s's files in %s", kind, run_dir)
        for p in existing:
            _remove(p)
    elif existing and not resume:
        names = ", ".join(p.name for p in existing[:4]) + (", ..." if len(existing) > 4 else "")
        if other:  # another job's run: this one cannot continue it (check_resumed_config)
            hint = "pass --overwrite to replace it, or start this job in another output_dir"
        else:
            hint = "pass --resume to continue it or --overwrite to replace it"
        raise ConfigError(f"output_dir={str(run_dir)!r}: holds a {what} ({names}); {hint}")
    elif resume:
        check_resumed_config(run_dir, cfg)


def _saved_job(run_dir: Path) -> jobs.Job | None:
    """The job of the run `run_dir`'s config.yaml records; None without a readable one
    (--resume then refuses what it cannot read: `check_resumed_config`)."""
    try:
        return saved_job(run_dir)
    except (OSError, ConfigError):
        return None


def _remove(path: Path) -> None:
    """Remove a run file or folder; a symbolic link itself, never what it points to."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def release_new_run(run_dir: str | Path) -> None:
    """A new run (not --resume) that failed before its first step, e.g. stopped while its label
    subset was copied: remove the run files its start wrote (config.yaml, ...), all of them its
    own (`claim_run_dir` found none or removed them), so the same command starts it again."""
    for path in run_files(Path(run_dir)):
        _remove(path)
