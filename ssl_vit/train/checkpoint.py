"""The one module that saves and loads state.

A checkpoint is a directory `checkpoints/step_XXXXXXXX/` holding
- `encoder.safetensors`: the encoder weights, with the model shape and the pixel normalisation
  it was trained with in the metadata, so that fine-tuning, few-shot evaluation and export
  need nothing else;
- `state.pt`: everything needed to resume (full model incl. objective head, optimizer, step,
  config, extra counters);
- `rng_rank{R}.pt`: the random state of every rank, and its data stream position;
- `manifest.json`: written last, with the size and SHA-256 of every file.
It is written under a temporary name and renamed into place (`atomic.publish_dir`), so a killed job
never leaves a half-written checkpoint under a real name; a truncated or altered file is caught
by the manifest on load and resume falls back to the newest valid checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ssl_vit.atomic import file_sha256, publish_dir, write_json, writing
from ssl_vit.config.loader import to_dict
from ssl_vit.errors import CheckpointError
from ssl_vit.interop import InteropError, foreign_pixel_norm
from ssl_vit.jsonfile import JsonFileError, parse_json, read_json
from ssl_vit.model.pixels import pixel_norm_problem
from ssl_vit.runs.occupancy import MANIFEST, STATE_FILE, is_checkpoint
from ssl_vit.train.weights_file import WeightsFileError, check_finite, read_header, saved_model

__all__ = [
    "CheckpointError",
    "checkpoint_dirs",
    "save_checkpoint",
    "load_checkpoint",
    "latest_valid_checkpoint",
    "resolve_checkpoint",
    "verify_checkpoint",
    "write_manifest",
    "save_weights",
    "save_encoder",
    "load_encoder",
    "load_head",
    "read_pixel_norm",
    "PixelStats",
]

log = logging.getLogger(__name__)
ENCODER_FILE = "encoder.safetensors"


class PixelStats(NamedTuple):
    """The pixel normalisation of [0, 1] RGB an encoder was trained with (data.mean / std)."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def save_weights(
    tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: dict[str, str]
) -> None:
    """Tensors as one safetensors file (detached, contiguous, on the CPU), string metadata."""
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    # safetensors creates its files 0600: give the file the mode every other file of a run or
    # an export gets (0666 less the umask), so that a group that reads them reads it too.
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_encoder(
    encoder: nn.Module,
    path: Path,
    model_config: dict[str, Any],
    pixels: PixelStats | None = None,
) -> None:
    """Encoder weights as safetensors; the model shape and the pixel normalisation it was
    trained with (`pixels`, when known) travel in the metadata."""
    meta = {"model_config": json.dumps(model_config)}
    if pixels is not None:
        meta["pixel_norm"] = json.dumps({"mean": list(pixels.mean), "std": list(pixels.std)})
    save_weights(encoder.state_dict(), path, meta)


def read_pixel_norm(path: str | Path) -> PixelStats | None:
    """The pixel normalisation stored with the encoder at `path`: an ssl-vit checkpoint
    directory or encoder.safetensors (the header only), or timm / transformers weights whose
    directory records it (`interop.foreign_pixel_norm`); None when none is stored (an encoder
    written before it was stored, a bare state dict). CheckpointError if malformed."""
    path = Path(path)
    file = path / ENCODER_FILE if path.is_dir() else path
    header: dict[str, Any] = {}
    if file.suffix == ".safetensors" and file.is_file():
        with suppress(WeightsFileError):  # not a safetensors file: no stats there
            header = read_header(file)[0]
    if "model_config" not in header:  # not ours: what a timm or transformers folder records
        try:
            stats = foreign_pixel_norm(path) if path.exists() else None
        except InteropError as e:
            raise CheckpointError(str(e)) from None
        return None if stats is None else PixelStats(*stats)  # type: ignore[arg-type]
    raw = header.get("pixel_norm")
    if raw is None:
        return None
    try:
        stats = parse_json(raw, "pixel_norm", dict)
        mean, std = stats["mean"], stats["std"]
        why = pixel_norm_problem(mean, std)  # a std of 0 or a NaN: every input NaN
        if why is not None:
            raise ValueError(why)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{file}: malformed pixel_norm metadata ({e})") from None
    return PixelStats(*(tuple(map(float, v)) for v in (mean, std)))  # type: ignore[arg-type]


def verify_if_checkpoint(path: str | Path) -> None:
    """Verify the checkpoint that `path` (a directory, or a file in one) belongs to: every read
    of a checkpoint goes through its manifest, whatever names it. A directory that holds a
    manifest, a training state or is named step_* is a checkpoint; a lone weights file is not."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    if is_checkpoint(folder) or folder.name.startswith("step_"):
        verify_checkpoint(folder)


def load_encoder(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, model config) from a checkpoint directory or an encoder.safetensors file,
    verified against the checkpoint's manifest when it has one (CheckpointError if it fails)."""
    path = Path(path)
    if path.is_dir():
        path = path / ENCODER_FILE
    if not path.is_file():
        raise CheckpointError(f"no encoder weights at {path}")
    verify_if_checkpoint(path)
    try:
        meta, shapes = read_header(path)
        if "model_config" not in meta:
            raise CheckpointError(f"{path} has no model_config metadata: not an ssl-vit encoder")
        # The metadata is untrusted: checked against the header's shapes before any tensor is
        # read or model built (a 2 KB file may claim width 32768 and depth 48).
        model = saved_model(meta, shapes, path)
        state = load_file(str(path))
        check_finite(state, path)  # a NaN weight: refused here, before any compute
    except CheckpointError:
        raise
    except ValueError as e:  # WeightsFileError, JsonFileError: one line naming the file
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    return state, to_dict(model)


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Finished checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    encoder: nn.Module,
    model_config: dict[str, Any],
    pixels: PixelStats | None = None,
    state: dict[str, Any],
    rng: dict[str, Any],
    rank: int = 0,
    is_main: bool = True,
    barrier: Any = None,
    keep: int = 3,
) -> Path:
    """Write checkpoint `step` atomically; every rank calls this (for its RNG state).

    `barrier` is a zero-argument callable synchronizing all ranks (None in one process).
    The checkpoint root must be on a filesystem shared by all ranks.
    """
    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    sync = barrier or (lambda: None)
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    sync()
    with _cleaned_on_failure(tmp), writing(final):  # disk full: one line naming the checkpoint
        _torch_save(rng, tmp / f"rng_rank{rank}.pt")
        if is_main:
            save_encoder(encoder, tmp / ENCODER_FILE, model_config, pixels)
            _torch_save({**state, "step": step}, tmp / STATE_FILE)
    sync()
    if is_main:
        with _cleaned_on_failure(tmp), writing(final):
            write_manifest(tmp, step=step)
        publish_dir(tmp, final)  # re-saving the same step (e.g. after a resume) replaces it
        for old in checkpoint_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    sync()
    return final


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through a Python file object: a failed write (disk full, `ulimit -f`) then
    keeps its OSError (errno) as the context of torch's "[enforce fail at ...]" RuntimeError,
    which `writing` turns into one line; given a path, torch's C++ writer loses the errno."""
    with open(path, "wb") as f:
        torch.save(obj, f)


@contextmanager
def _cleaned_on_failure(tmp: Path) -> Iterator[None]:
    """A failed write removes the partial checkpoint (it would hold the disk space)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(folder: Path, **extra: Any) -> None:
    """manifest.json (size and SHA-256 of every file of `folder`), then everything fsynced."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in folder.iterdir()
    }
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    write_json(folder / MANIFEST, {**extra, "files": files})  # last: it says the rest is whole


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file matches the manifest."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete checkpoint)")
    files = _manifest_files(manifest_path)
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {name}")
        if f.stat().st_size != info["bytes"] or file_sha256(f) != info["sha256"]:
            raise CheckpointError(f"{path}: {name} is truncated or corrupted (checksum mismatch)")


def _manifest_files(manifest: Path) -> dict[str, dict[str, Any]]:
    """The `files` of a manifest ({name: {bytes, sha256}}); CheckpointError naming it when it
    is not that (truncated, another shape, a name outside its folder)."""
    try:
        files = read_json(manifest).get("files")
        if not isinstance(files, dict):
            raise ValueError("no 'files' mapping")
        for name, info in files.items():
            if (
                Path(name).name != name
                or not isinstance(info, dict)
                or {"bytes", "sha256"} - set(info)
            ):
                raise ValueError(f"entry {name!r} is not a file name with bytes and sha256")
    except JsonFileError as e:  # names the file
        raise CheckpointError(f"unreadable {MANIFEST}: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"{manifest}: unreadable {MANIFEST}: {e}") from None
    return files


def load_checkpoint(
    path: str | Path, rank: int = 0, rng: bool = True, verified: bool = False
) -> dict[str, Any]:
    """Verified training state of checkpoint `path`, with this rank's RNG state under 'rng'
    (`rng=False`: without it, e.g. to look at the weights only). `verified`: the caller has
    just checked it (`latest_valid_checkpoint`): the SHA-256 of every file is not read twice."""
    path = Path(path)
    if not verified:
        verify_checkpoint(path)
    # weights_only: tensors and plain containers only, nothing unpickled as arbitrary objects.
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if not rng:
        return state
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.is_file():  # resumed on more ranks than saved: fall back to rank 0's state
        rng_file = path / "rng_rank0.pt"
    state["rng"] = torch.load(rng_file, map_location="cpu", weights_only=True)
    return state


def load_head(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The objective's own parameters ([mask] embedding, colour head) from the training state of
    a checkpoint (its directory, or a file in it such as its encoder.safetensors)."""
    path = Path(checkpoint)
    state_file = (path if path.is_dir() else path.parent) / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: not found, so there is no masked-prediction head")
    verify_if_checkpoint(state_file)
    model = torch.load(state_file, map_location="cpu", weights_only=True)["model"]
    head = {k: v for k, v in model.items() if not k.startswith("encoder.")}
    if not head:
        raise CheckpointError(f"{state_file}: holds no head weights")
    return head


def latest_valid_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that passes verification (others are logged)."""
    for path in reversed(checkpoint_dirs(root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            log.warning("skipping invalid checkpoint: %s", e)
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """Where a checkpoint is expected, also accept a run directory or its `checkpoints/`:
    those resolve to their newest checkpoint that passes verification (logged). A checkpoint
    directory, a weights file or a foreign (timm / transformers) directory is returned as is.
    Raises CheckpointError for a missing path or a run directory with no valid checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint, run directory or weights file")
    if path.is_file() or (path / ENCODER_FILE).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not checkpoint_dirs(root):
        return path  # not a run directory: e.g. timm / transformers weights, format detected later
    found = latest_valid_checkpoint(root)
    if found is None:
        raise CheckpointError(f"{path}: no valid checkpoint in {root} (all failed verification)")
    log.info("using checkpoint %s (the newest valid one in %s)", found, root)
    return found
