"""Checks a job runs before its first step: everything it will touch exists and fits.

A missing few-shot source must surface in the first seconds, not after a million steps: each
check raises `ConfigError` with one line naming the config key and its value.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ssl_vit.config import ConfigError, ModelConfig
from ssl_vit.config.frozen import freeze, validated
from ssl_vit.data import open_source, resolve_shards
from ssl_vit.data.sources import ShardSource

if TYPE_CHECKING:
    from ssl_vit.model.vit import ViT

__all__ = [
    "FrozenEncoder",
    "check_labelled_source",
    "check_not_a_run",
    "check_same_labels",
    "eval_label_map",
    "indices_by_name",
    "check_shards",
    "check_writable",
    "init_from_checkpoint",
    "load_frozen_encoder",
    "load_init_encoder",
    "resolve_pixel_norm",
    "warn_shared",
]

log = logging.getLogger(__name__)

_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")  # read only when the job gets there


def check_shards(key: str, spec: str) -> list[str]:
    """The shard URLs of `spec`; every local shard must exist."""
    try:
        urls = resolve_shards(spec)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None
    check_tars(key, urls)
    return urls


def check_tars(key: str, urls: list[str]) -> None:
    """Every local shard starts with a valid tar header: one 512-byte read a shard (0.3 s for
    1,000 local shards on a loaded 2-core machine). A zero-byte, empty or non-tar file is named
    here, before compute; a tar cut short further in is a counted skip while reading."""
    for url in urls:
        if _REMOTE.match(url) or not os.path.isfile(url):
            continue
        try:
            why = _tar_head_problem(url)
        except (tarfile.TarError, OSError, EOFError) as e:  # tarfile's may span lines
            why = f"not a readable tar ({type(e).__name__}: {str(e).splitlines()[0]})"
        if why:
            raise ConfigError(f"{key}: shard {url} is {why}")


def _tar_head_problem(url: str) -> str | None:
    """What is wrong with the start of the tar `url`, or None."""
    with open(url, "rb") as f:
        head = f.read(512)
    if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):  # compressed: tarfile reads it
        try:
            tar = tarfile.open(url, mode="r:*")
        except tarfile.ReadError:
            return "not a readable tar (compressed, but no tar inside)"
        with tar:
            return None if tar.next() is not None else "an empty tar (no samples)"
    if len(head) < 512:
        return f"not a readable tar ({len(head)} bytes: shorter than one tar header)"
    if not head.strip(b"\0"):
        return "an empty tar (no samples)"
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.HeaderError as e:
        return f"not a readable tar ({e})"
    return None


def check_same_labels(train: tuple[str, list[str]], eval: tuple[str, list[str]]) -> None:
    """The eval source's class names are the train source's, in the same order (label i means
    the same class on both sides); `train` / `eval`: (config key, label names). A source without
    names (remote shards without an index) is not compared."""
    (train_key, train_names), (eval_key, eval_names) = train, eval
    if not train_names or not eval_names or train_names == eval_names:
        return
    only_train = [n for n in train_names if n not in eval_names]
    only_eval = [n for n in eval_names if n not in train_names]
    if only_train or only_eval:
        diff = f"only in {train_key}: {only_train}, only in {eval_key}: {only_eval}"
    else:
        diff = f"same names in another order: {train_names} vs {eval_names}"
    raise ConfigError(f"{eval_key}: label names differ from {train_key}'s ({diff})")


def eval_label_map(train_names: list[str], eval_names: list[str]) -> tuple[int, ...] | None:
    """How data.eval's labels index the classifier's classes (data.train's) when the two
    sources name them differently, matched by name: for each eval class its train index, -1
    for a class data.train has no images of (a few picked labels missed it; its test images
    are left out, logged); None where the names are the same, in the same order. Names on both
    sides that the other lacks are a naming mismatch: `check_same_labels`' error."""
    if not train_names or not eval_names or train_names == eval_names:
        return None
    if set(train_names) - set(eval_names) and set(eval_names) - set(train_names):
        check_same_labels(("data.train", train_names), ("data.eval", eval_names))
    return indices_by_name(eval_names, train_names)


def indices_by_name(names: list[str], classes: list[str]) -> tuple[int, ...]:
    """Each of a source's class `names` as its index in a classifier's `classes` (-1: none)."""
    index = {name: i for i, name in enumerate(classes)}
    return tuple(index.get(name, -1) for name in names)


def check_not_a_run(key: str, spec: str) -> None:
    """A run directory of ours given as a source of images (a select run's folder for its
    `to-label/`): one line saying what it is, where its sub-folders ('to-label', 'checkpoints')
    would have been read as classes, or its picks as a class of their own."""
    from ssl_vit import jobs
    from ssl_vit.runs.occupancy import saved_job

    folder = Path(os.path.expanduser(spec))
    job = saved_job(folder) if folder.is_dir() else None
    if job is not None:
        where = f": the images it picked are in {folder / 'to-label'}" if job is jobs.SELECT else ""
        named = f"{key} {spec}" if key.startswith("--") else f"{key}={spec!r}"  # a flag or key
        raise ConfigError(f"{named}: a {job.title} run directory, not images{where}")


def warn_shared(reads: tuple[str, str], scores: tuple[str, str], what: str) -> None:
    """A warning (not a refusal: a check of memorisation is a use) when the source a job
    scores on, `scores` (key, spec), is the one it `reads` to train, or holds it or is held
    in it (a folder and a shard of it): its figure is then not a held-out one, and `what`
    says why."""
    from ssl_vit.runs.occupancy import local_path  # the one reading of a source spec's path

    rspec, sspec = reads[1], scores[1]
    a, b = local_path(rspec), local_path(sspec)
    if a is None or b is None:  # remote, or not here: the same spec
        shared = rspec.strip() == sspec.strip()
    else:
        shared = a.is_relative_to(b) or b.is_relative_to(a)
    if shared:
        named = (f"{k} {v}" if k.startswith("--") else f"{k}={v}" for k, v in (scores, reads))
        log.warning("%s is %s or shares its images: %s", *named, what)


def check_labelled_source(key: str, spec: str) -> list[str]:
    """Label names of the labelled source `spec` (shards, image folder, HF dataset).

    Remote shards (pipe:, URLs) without an index are only read when the job gets to them."""
    check_not_a_run(key, spec)
    try:
        source = open_source(spec)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r}: {e}") from None
    except ConnectionError as e:  # datasets' own, raised offline or without a network
        where = "the Hugging Face Hub (offline?)" if spec.startswith("hf://") else "it"
        raise ConfigError(f"{key}={spec!r}: cannot reach {where}: {e}") from None
    if isinstance(source, ShardSource):
        check_tars(key, source.urls)
    if not source.label_names and not _REMOTE.match(spec):
        raise ConfigError(f"{key}={spec!r}: has no labels ({source.unlabelled_why})")
    return list(source.label_names)


def check_writable(key: str, path: str | Path) -> None:
    """`path` accepts new files, or can be made where it is missing: its nearest existing
    folder accepts them (nothing is created: the run directory's claim makes it, once every
    check has passed)."""
    if not str(path).strip():  # Path("") is the current directory
        raise ConfigError(f"{key}: empty; name a directory")
    path = Path(path).expanduser()
    folder = next(p for p in (path, *path.parents) if p.exists())  # "." at the latest
    try:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{folder} is not a directory")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test_"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}={str(path)!r}: not writable ({e.strerror or e})") from None


def load_init_encoder(
    key: str, path: str, model_cfg: Any, pos_interp: str, fmt: str
) -> tuple[str, Any]:
    """(the checkpoint used, `encoder_from_checkpoint`'s `LoadedEncoder`): a run directory
    stands for its newest valid checkpoint; failures (missing, invalid) are a one-line error
    naming `key`, a shape key of `model_cfg` that disagrees one naming `model.<key>`."""
    from ssl_vit.train.checkpoint import CheckpointError, resolve_checkpoint
    from ssl_vit.train.encoder_init import ArchitectureError, encoder_from_checkpoint

    if not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{key}={path!r}: no such file or directory")
    if (classifier := _finetuned_classifier(Path(os.path.expanduser(path)))) is not None:
        raise ConfigError(
            f"{key}={path!r}: {classifier} is a fine-tuned classifier (model.safetensors), not "
            "an encoder checkpoint: pass the checkpoint it was fine-tuned from"
        )
    try:
        path = str(resolve_checkpoint(path))
        return path, encoder_from_checkpoint(path, model_cfg, pos_interp, fmt)
    except ArchitectureError as e:
        raise ConfigError(str(e)) from None
    except (CheckpointError, FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None


class FrozenEncoder(NamedTuple):
    """An encoder to read features with: the checkpoint it came from (a run directory resolved
    to its newest valid checkpoint), its input side and pixel normalisation."""

    encoder: ViT
    checkpoint: str
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def load_frozen_encoder(key: str, path: str, image_size: int = 0) -> FrozenEncoder:
    """The encoder of a pretraining run or checkpoint at `path` (or imported weights), at
    `image_size` (0: the resolution it was trained at), as fine-tuning and few-shot read it
    (`load_init_encoder`: one-line errors naming `key`; a fine-tuned classifier is
    refused), with the pixel normalisation it stores (else the default)."""
    from ssl_vit.config.pixels import PIXEL_NORM
    from ssl_vit.train.checkpoint import CheckpointError, read_pixel_norm
    from ssl_vit.train.encoder_init import encoder_from_checkpoint

    path, trained = _trained_size(path)
    model = ModelConfig(image_size=image_size or trained or 224, mlp_ratio=None, norm_eps=None)
    path, loaded = load_init_encoder(key, path, model, "bicubic", "auto")
    if not image_size and loaded.saved["image_size"] != model.image_size:  # imported weights
        model = dataclasses.replace(model, image_size=loaded.saved["image_size"])
        loaded = encoder_from_checkpoint(path, model)
    try:
        stored = read_pixel_norm(path)
    except CheckpointError as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
    mean, std = stored if stored is not None else (PIXEL_NORM, PIXEL_NORM)
    return FrozenEncoder(loaded.encoder, path, model.image_size, tuple(mean), tuple(std))


def _trained_size(path: str) -> tuple[str, int | None]:
    """(the checkpoint a run directory stands for, the image size its metadata records); (path,
    None) when it is no ssl-vit checkpoint: `load_init_encoder` then says what it is."""
    from ssl_vit.jsonfile import parse_json
    from ssl_vit.train.checkpoint import ENCODER_FILE, resolve_checkpoint
    from ssl_vit.train.weights_file import read_header

    try:
        ckpt = resolve_checkpoint(path)
        file = ckpt / ENCODER_FILE if ckpt.is_dir() else ckpt
        saved = parse_json(read_header(file)[0]["model_config"], f"{file}: model_config")
        return str(ckpt), int(saved["image_size"])
    except Exception:  # noqa: BLE001 - missing, damaged or foreign: named by the loader
        return path, None


def init_from_checkpoint(
    key: str, cfg: Any, path: str, recorded: str | None = None
) -> tuple[Any, Any, str]:
    """A job's config resolved for the encoder at `path` (named by `key`; `load_init_encoder`)
    -> (the config, checked again and frozen, with init.checkpoint the checkpoint used (or
    `recorded`), recorded as such in config.yaml, and the checkpoint's shape and pixel
    normalisation; the `LoadedEncoder`; the line to log about it)."""
    i = cfg.init
    path, loaded = load_init_encoder(key, path, cfg.model, i.pos_interp, i.format)
    data, pixels_from = resolve_pixel_norm(cfg.data, path)  # null mean / std: the checkpoint's
    init = dataclasses.replace(i, checkpoint=recorded or path)
    # The checkpoint's shape (at this image size) and pixel normalisation: a resolved copy,
    # checked as the loader checks a config.
    resolved = dataclasses.replace(cfg, init=init, model=loaded.model_config, data=data)
    cfg = freeze(validated(resolved))
    return cfg, loaded, checkpoint_note(key, cfg, pixels_from)


def resumed_encoder(run_dir: str, init: str) -> tuple[str, str] | None:
    """`--resume` of a fine-tune whose init checkpoint is gone (cleaned up, or not mounted on
    the machine the run moved to): (the run's own newest valid checkpoint, which holds the
    encoder's shape and pixel normalisation at the run's resolution, and the init checkpoint
    config.yaml records); None while `init` exists or the run has no checkpoint yet."""
    from ssl_vit.runs.occupancy import saved_config
    from ssl_vit.train.checkpoint import latest_valid_checkpoint

    own = latest_valid_checkpoint(Path(run_dir) / "checkpoints")
    if os.path.exists(os.path.expanduser(init)) or own is None:
        return None
    recorded = ((saved_config(Path(run_dir)) or {}).get("init") or {}).get("checkpoint")
    return str(own), recorded or init


def resolve_pixel_norm(data: Any, checkpoint: str | None) -> tuple[Any, str]:
    """(a copy of `data`, a job's data config, with `mean` / `std` for the encoder of
    `checkpoint` (None: a new encoder), where they came from, for the log): null ones become
    the pixel normalisation the checkpoint stores (its pretraining's), else the default 0.5; a
    given one that disagrees with the stored one is a one-line ConfigError naming both."""
    from ssl_vit.config.pixels import completed_pixel_norm
    from ssl_vit.train.checkpoint import CheckpointError, read_pixel_norm

    try:
        stored = read_pixel_norm(checkpoint) if checkpoint is not None else None
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if stored is None:
        where = "the checkpoint stores none: the config's" if checkpoint else "the config's"
        return completed_pixel_norm(data), where
    for key, value in zip(("mean", "std"), stored, strict=True):
        given = getattr(data, key)
        if given is not None and not all(map(math.isclose, given, value)):
            raise ConfigError(
                f"data.{key}={list(given)} disagrees with the checkpoint {checkpoint} "
                f"({key} {list(value)})"
            )
    mean, std = (tuple(value) for value in stored)
    return dataclasses.replace(data, mean=mean, std=std), "the checkpoint's"


def checkpoint_note(key: str, cfg: Any, pixels_from: str) -> str:
    """The line a job logs about the encoder it took from a checkpoint (`cfg` resolved)."""
    from ssl_vit.config.schema import SHAPE_KEYS

    m, d = cfg.model, cfg.data
    shape = ", ".join(f"{k} {getattr(m, k)}" for k in SHAPE_KEYS)
    return (
        f"{key}={cfg.init.checkpoint}: its encoder ({shape}) at image_size {m.image_size}, "
        f"data.mean {list(d.mean)}, data.std {list(d.std)} ({pixels_from}); a config file's "
        "model shape and data.mean / data.std serve from-scratch runs only"
    )


def _finetuned_classifier(path: Path) -> Path | None:
    """The fine-tuned classifier file at `path` (a file, or a directory holding
    model.safetensors and no encoder): its metadata names the labels, an encoder's does not."""
    from ssl_vit.train.classifier_file import CLASSIFIER_FILE, file_kind

    if path.is_dir() and (path / "encoder.safetensors").exists():
        return None
    file = path / CLASSIFIER_FILE if path.is_dir() else path
    return file if file_kind(file) == "classifier" else None
