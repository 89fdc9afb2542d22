"""What a command must not write into, replace or remove: another job's run, a checkpoint, a
shard dataset, a source the job itself reads.

`check_not_source` refuses an `--overwrite` whose target is, contains or is inside a source of
the job (a checkpoint stands for its whole run directory); `occupant` names a run directory,
checkpoint or shard dataset that an export or import must not replace or write into.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ssl_vit import jobs
from ssl_vit.config import to_dict
from ssl_vit.config.loader import read_yaml_file
from ssl_vit.data.format import INDEX_NAME
from ssl_vit.errors import ConfigError
from ssl_vit.runs.lock import lock_held

__all__ = [
    "MANIFEST",
    "STATE_FILE",
    "check_not_source",
    "holds_data",
    "is_checkpoint",
    "is_run_dir",
    "local_path",
    "occupant",
    "read_paths",
    "saved_job",
    "source_root",
]

# A training checkpoint's files (`train.checkpoint` writes them): either one makes a folder one.
STATE_FILE, MANIFEST = "state.pt", "manifest.json"
_NOT_PATHS = ("", "none", "random")  # init.checkpoint / --checkpoint values that name no path
_WALK_LIMIT = 10_000  # directories looked at below a target before giving up (a huge tree)


def is_checkpoint(folder: Path) -> bool:
    """`folder` holds a manifest or a training state: a training checkpoint."""
    return (folder / MANIFEST).is_file() or (folder / STATE_FILE).is_file()


def is_run_dir(folder: str | Path) -> bool:
    """`folder` is a job's run directory: config.yaml with checkpoints/ or a job's results,
    or a lock a live job holds."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    outputs = ("checkpoints", "results.json", "metrics.jsonl")
    has_run = (folder / "config.yaml").is_file() and any((folder / n).exists() for n in outputs)
    return has_run or lock_held(folder)


def saved_config(folder: Path) -> dict | None:
    """The mapping `folder`'s config.yaml holds (read bounded: any folder's file); None
    without one, or for a file holding no mapping. ConfigError: an unreadable one."""
    config = Path(folder) / "config.yaml"
    saved = read_yaml_file(config) if config.is_file() else None
    return saved if isinstance(saved, dict) else None


def saved_job(folder: Path) -> jobs.Job | None:
    """The job whose run `folder`'s config.yaml records; None without one, or for a config no
    job writes. ConfigError: an unreadable one."""
    saved = saved_config(folder)
    return jobs.by_config(saved) if saved is not None else None


def holds_data(folder: Path) -> str | None:
    """What `folder` holds that no job's files may be written beside: a training checkpoint
    or a shard dataset (None: neither)."""
    if is_checkpoint(folder):
        return "a training checkpoint"
    if (folder / INDEX_NAME).is_file() or any(folder.glob("shard-*.tar")):
        return "a shard dataset"
    return None


def _holds(folder: Path) -> str | None:
    return "a run directory" if is_run_dir(folder) else holds_data(folder)


def occupant(target: str | Path) -> str | None:
    """What makes `target` a directory no export or import may replace or write into: it is,
    or holds, a run directory, a training checkpoint or a shard dataset, or it lies in a
    checkpoint or a run's checkpoints/ folder. None when it is free."""
    target = Path(target).expanduser().resolve()
    what = _holds(target) if target.is_dir() else None
    if what is not None:
        return f"is {what}"
    for d in (target, *target.parents):
        if d != target and is_checkpoint(d):
            return f"is inside the checkpoint {d}"
        if d.name == "checkpoints" and is_run_dir(d.parent):
            return f"{'is' if d == target else 'is inside'} {d}, the checkpoints of a run"
    for seen, (root, _, _) in enumerate(os.walk(target)):
        if seen >= _WALK_LIMIT:
            return f"holds more than {_WALK_LIMIT} folders (not looked through)"
        what = _holds(Path(root)) if seen else None
        if what is not None:
            return f"holds {what} ({root})"
    return None


def source_root(path: str | Path) -> Path:
    """The directory a read of `path` depends on: the run directory holding it (a checkpoint
    in runs/x/checkpoints/ -> runs/x), else the path itself (absolute)."""
    path = Path(path).expanduser().resolve()
    for d in (path, *path.parents):
        if is_run_dir(d):
            return d
    return path


def read_paths(cfg: Any) -> dict[str, str]:
    """{key: path} of the local sources a job's config names (its job's `reads`: data, the
    checkpoint it starts from or labels with)."""
    job = jobs.by_config(to_dict(cfg))
    found: dict[str, str] = {}
    for key in job.reads if job else ():
        value = cfg
        for name in key.split("."):
            value = getattr(value, name, None)
        if isinstance(value, str) and value.strip().lower() not in _NOT_PATHS:
            found[key] = value
    return found


def local_path(spec: str) -> Path | None:
    """The local file or folder a source spec names (a brace pattern or glob: the folder it
    starts in); None when there is none here (a remote source: pipe:, a URL)."""
    head = re.split(r"[{*?\[]", spec, maxsplit=1)[0]
    if not head.strip():
        return None
    path = Path(head).expanduser()
    if path.exists():
        return path.resolve()
    return path.parent.resolve() if head != spec and path.parent.is_dir() else None


def check_not_source(
    key: str, target: str | Path, sources: dict[str, str], *, replace: bool = True
) -> None:
    """ConfigError unless `target` is apart from every source {key: path}.

    replace (an --overwrite: `target` is emptied first): not one of them, not holding one, not
    inside one; a checkpoint counts as its whole run directory. Otherwise (a job's files are
    added to `target`): not a data source nor inside one, whose readers would take the files
    for its own (a folder of images: a new class); a run directory a source lies in is left
    to the run rules (`train.rundir`)."""
    t = Path(target).expanduser().resolve()
    for name, spec in sources.items():
        local = local_path(str(spec)) if spec else None
        if local is None:
            continue
        root = source_root(local)
        if t == root:
            how = "is"
        elif root.is_relative_to(t):
            how = "contains"
        elif t.is_relative_to(root):
            how = "is inside"
        else:
            continue
        if not replace and (how == "contains" or is_run_dir(root)):
            continue
        what = f"{name}={str(spec)!r}" + (f" (its run {root})" if root != local else "")
        harm = "--overwrite would destroy it" if replace else "the run's files would mix with it"
        raise ConfigError(
            f"{key}={str(target)!r}: {how} {what}, which this job reads; {harm}: pick another "
            "directory"
        )
