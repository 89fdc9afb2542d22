"""`ssl_vit.atomic.replacing`: the one way a promised-atomic file is written. A write that fails
midway leaves the old file as it was and nothing beside it; every such write goes through it."""

import errno
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import ssl_vit.atomic as ssl_atomic
from ssl_vit.atomic import WriteError, replacing, write_json, write_text
from ssl_vit.config import PretrainConfig
from ssl_vit.config.loader import from_dict, save_config
from ssl_vit.train.checkpoint import load_checkpoint, save_checkpoint
from ssl_vit.train.rng import rng_state

ROOT = Path(__file__).resolve().parents[1]


def _beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_a_write_that_raises_keeps_the_old_file(tmp_path):
    path = tmp_path / "labels.json"
    write_json(path, ["cat", "dog"])
    with pytest.raises(RuntimeError, match="killed"), replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == '[\n "cat",\n "dog"\n]\n' and _beside(path) == []


def test_a_failed_rename_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_text(path, "old\n")

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ssl_atomic.os, "replace", full)
    with pytest.raises(WriteError, match=f"cannot write {re.escape(str(path))}: No space left"):
        write_text(path, "new\n")
    assert path.read_text() == "old\n" and _beside(path) == []


def test_promised_atomic_writes_go_through_the_helper(tmp_path, monkeypatch):
    """config.yaml (`save_config`) and a checkpoint (its manifest, its directory) are written
    through `ssl_vit.atomic` (every file it writes is fsynced before the rename)."""
    flushed: list[str] = []
    fsync = ssl_atomic._fsync
    monkeypatch.setattr(ssl_atomic, "_fsync", lambda p: (flushed.append(Path(p).name), fsync(p)))
    save_config(from_dict(PretrainConfig, {"data": {"train_shards": "x"}}), tmp_path / "c.yaml")
    assert ".c.yaml.tmp-" in flushed[0] and (tmp_path / "c.yaml").is_file()
    flushed.clear()
    enc = nn.Linear(2, 2)
    state = {"model": enc.state_dict()}
    ckpt = save_checkpoint(
        tmp_path / "ckpts", 3, encoder=enc, model_config={}, state=state, rng=rng_state()
    )
    assert any(n.startswith(".manifest.json.tmp-") for n in flushed) and "ckpts" in flushed
    assert load_checkpoint(ckpt)["step"] == 3 and _beside(ckpt) == []
    assert torch.equal(load_checkpoint(ckpt)["model"]["weight"], enc.weight)


def test_no_write_renames_a_file_of_its_own():
    """One mechanism: no module but ssl_vit.atomic renames a temporary file into place."""
    own = [
        f"{p.relative_to(ROOT)}:{i}"
        for folder in ("ssl_vit", "pipelines", "scripts")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if p != ROOT / "ssl_vit" / "atomic.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"os\.replace\(|\.tmp-|NamedTemporaryFile\(.*delete=False", line)
    ]
    assert own == [], own


def test_pid_named_temp_is_a_sibling(tmp_path):
    with replacing(tmp_path / "model.safetensors") as tmp:
        assert tmp.parent == tmp_path and str(os.getpid()) in tmp.name
        tmp.write_bytes(b"x")
    assert (tmp_path / "model.safetensors").read_bytes() == b"x"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_weights_files_get_the_mode_of_every_other_file(tmp_path, umask):
    """safetensors writes its files 0600: a model, checkpoint or export a group can read
    except for its weights. They get what `open` gives any other file (0666 less the umask)."""
    from ssl_vit.train.checkpoint import save_weights

    old = os.umask(umask)
    try:
        with replacing(tmp_path / "model.safetensors") as tmp:
            save_weights({"w": torch.ones(2)}, tmp, {})
        write_text(tmp_path / "labels.json", "[]\n")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o666 & ~umask, "labels.json": 0o666 & ~umask}
