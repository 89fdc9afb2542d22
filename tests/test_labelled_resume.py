"""A label-budget run's own files (`labelled.json`, `labelled/`) under --resume and faults
(ssl_vit/data/labelled.py, labelled_record.py): another K or seed is refused before anything is
written; a damaged copy is rebuilt, byte for byte, from a source that still gives the same
subset; a changed source is named (which class, how many images) and a moved one continues; a
symbolic link is refused, never followed; a stop signal during the copy leaves nothing behind;
images training cannot decode are left out of the copy and of `num_labelled`."""

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import pipeline
from PIL import Image
from test_faults import stop_after_step
from test_pipelines import ROOT, finetune_args

from ssl_vit.config import ConfigError, FinetuneConfig, load_config
from ssl_vit.data import labelled as labelled_module
from ssl_vit.data import open_source
from ssl_vit.data.labelled import (
    CopyInterruptedError,
    check_recorded,
    choose_labelled,
    use_labelled,
)
from ssl_vit.runs.lock import LOCK_NAME
from ssl_vit.train.rundir import claim_run_dir, run_files

LOGGER = "ssl_vit.data.labelled"


def _folder(root: Path, counts: dict[str, int]) -> Path:
    """An image folder: class -> that many distinct 8x8 PNGs (keys `{class}_img{i:02d}`)."""
    for c, (name, n) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (8, 8), (c * 60, i * 10, 0)).save(root / name / f"img{i:02d}.png")
    return root


def _image(src: Path, key: str) -> Path:
    name, _, stem = key.partition("_")
    return src / name / f"{stem}.png"


def _snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file below `folder` but the lock."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def _shards(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "labelled").glob("shard-*.tar"))


def _refused(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture
def run(tmp_path):
    """A source of 2 classes x 6 images and a run directory holding its K = 3 copy."""
    src = _folder(tmp_path / "src", {"cat": 6, "dog": 6})
    run_dir = tmp_path / "run"
    use_labelled(choose_labelled(str(src), 3, 0), run_dir, write=True)
    return src, run_dir


def test_another_budget_is_refused_before_anything_is_written(run):
    """Issue 38 #5: labelled.json lost, --resume with another K (or K = 0, or another seed):
    refused in one line naming the change; nothing rewritten. The run's own K rebuilds it."""
    src, run_dir = run
    original = _snapshot(run_dir)
    (run_dir / "labelled.json").unlink()  # lost: the copy's index.json still says K = 3
    before = _snapshot(run_dir)
    asked = [
        (choose_labelled(str(src), 2, 0), "data.labels_per_class 3 -> 2"),
        (choose_labelled(str(src), 3, 1), "data.labels_seed 0 -> 1"),
        (None, "data.labels_per_class 3 -> 0"),
    ]
    for subset, change in asked:
        line = _refused(lambda s=subset: check_recorded(s, run_dir))
        assert line.startswith("--resume: ") and change in line and "index.json" in line, line
        if subset is not None:
            assert _refused(lambda s=subset: use_labelled(s, run_dir, write=True)) == line
    assert _snapshot(run_dir) == before
    use_labelled(choose_labelled(str(src), 3, 0), run_dir, write=True)
    assert _snapshot(run_dir) == original  # labelled.json back, the copy byte for byte


@pytest.mark.parametrize("text", ['{"labels_per_class": 3, "keys"', "[1, 2]", '{"keys": 5}'])
def test_a_damaged_record_is_rebuilt_and_still_guards_the_budget(run, text, caplog):
    """labelled.json truncated or of another shape: its copy's index still refuses another K;
    the run's own K rebuilds the record (named in the log), identical to the first."""
    src, run_dir = run
    original = _snapshot(run_dir)
    (run_dir / "labelled.json").write_text(text)
    line = _refused(lambda: check_recorded(choose_labelled(str(src), 4, 0), run_dir))
    assert "data.labels_per_class 3 -> 4" in line, line
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        use_labelled(choose_labelled(str(src), 3, 0), run_dir, write=True)
    assert f"{run_dir / 'labelled.json'}: " in caplog.text and "rebuilding the copy" in caplog.text
    assert _snapshot(run_dir) == original


@pytest.mark.parametrize("damage", ["emptied", "truncated", "one byte changed", "removed"])
def test_a_damaged_copy_is_rebuilt_from_the_source(run, damage, caplog):
    """Issue 38 #7: a shard of the copy emptied, truncated, altered or gone: the source still
    gives the same subset, so the copy is rebuilt (the shard named), identical to the first."""
    src, run_dir = run
    original = _snapshot(run_dir)
    shard = _shards(run_dir)[1]
    data = bytearray(shard.read_bytes())
    if damage == "removed":
        shard.unlink()
    else:
        data[700] ^= 0xFF  # inside the first member's bytes
        cut = {"emptied": 0, "truncated": len(data) // 2}.get(damage, len(data))
        shard.write_bytes(bytes(data[:cut]))
    subset = choose_labelled(str(src), 3, 0)
    check_recorded(subset, run_dir)  # the same subset: no error
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        use_labelled(subset, run_dir, write=True)
    assert f"{shard}" in caplog.text and "rebuilding the copy" in caplog.text
    assert _snapshot(run_dir) == original


def test_a_changed_source_is_named_and_nothing_is_rewritten(run):
    """Issue 38 #8 and #7: the source gained an image: the line names the class and its counts
    (with a damaged copy: the shard, and that it cannot be rebuilt); without labelled.json, the
    copy's own keys show a source that lost a chosen image. Nothing is rewritten."""
    src, run_dir = run
    Image.new("RGB", (8, 8), (9, 9, 9)).save(src / "cat" / "img99.png")
    subset = choose_labelled(str(src), 3, 0)
    line = _refused(lambda: check_recorded(subset, run_dir))
    assert "class 'cat': 6 -> 7 images" in line and "restore that source" in line, line
    assert "dog" not in line and "damaged" not in line
    shard = _shards(run_dir)[0]
    shard.write_bytes(b"")
    before = _snapshot(run_dir)
    line = _refused(lambda: use_labelled(subset, run_dir, write=True))
    assert "class 'cat': 6 -> 7 images" in line and f"{shard} has 0 bytes" in line, line
    assert "cannot be rebuilt" in line
    assert _snapshot(run_dir) == before
    # labelled.json lost, and a chosen image gone from the source: the copy still holds it.
    (src / "cat" / "img99.png").unlink()
    (run_dir / "labelled.json").unlink()
    gone = choose_labelled(str(src), 3, 0).keys["dog"][0]
    _image(src, gone).unlink()
    line = _refused(lambda: check_recorded(choose_labelled(str(src), 3, 0), run_dir))
    assert "class 'dog': " in line and " copied images no longer drawn" in line, line
    assert "labelled/index.json" in line


def test_a_damaged_copy_is_not_rebuilt_from_other_bytes(run):
    """The same keys and counts but a chosen image's bytes changed: an intact copy continues
    (training reads only the copy); a damaged one is not rebuilt from other images."""
    src, run_dir = run
    subset = choose_labelled(str(src), 3, 0)
    Image.new("RGB", (8, 8), (1, 2, 3)).save(_image(src, subset.keys["dog"][0]))
    check_recorded(subset, run_dir)
    use_labelled(subset, run_dir, write=True)  # intact: kept
    _shards(run_dir)[2].write_bytes(b"")
    before = _snapshot(run_dir)
    line = _refused(lambda: use_labelled(subset, run_dir, write=True))
    assert "the chosen images of class 'dog' have other bytes" in line, line
    assert _snapshot(run_dir) == before
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".labelled")] == []


def test_a_moved_source_continues_and_rebuilds(run, tmp_path, caplog):
    """Issue 38 #8: the same images elsewhere (a byte-identical copy) give the same subset: the
    run continues on its copy, nothing rewritten; a damaged copy is rebuilt from there."""
    src, run_dir = run
    moved = tmp_path / "elsewhere" / "images"
    shutil.copytree(src, moved)
    shutil.rmtree(src)
    before = _snapshot(run_dir)
    subset = choose_labelled(str(moved), 3, 0)
    check_recorded(subset, run_dir)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        use_labelled(subset, run_dir, write=True)
    assert _snapshot(run_dir) == before and "continuing on its copy" in caplog.text
    shards = {p.name: p.read_bytes() for p in _shards(run_dir)}
    _shards(run_dir)[0].write_bytes(b"")
    use_labelled(subset, run_dir, write=True)
    assert {p.name: p.read_bytes() for p in _shards(run_dir)} == shards
    assert json.loads((run_dir / "labelled.json").read_text())["source"] == str(moved)


def test_a_symlinked_copy_is_refused_never_followed(run, tmp_path):
    """Issue 38 #9: `labelled` a symbolic link: one line naming it, the folder it points to
    untouched; --overwrite removes the link, not that folder."""
    src, run_dir = run
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run_dir / "labelled", elsewhere)
    (run_dir / "labelled").symlink_to(elsewhere)
    kept = _snapshot(elsewhere)
    subset = choose_labelled(str(src), 3, 0)
    for call in (lambda: check_recorded(subset, run_dir), lambda: use_labelled(subset, run_dir, 1)):
        line = _refused(call)
        assert f"{run_dir / 'labelled'} is a symbolic link (to {elsewhere})" in line, line
    assert (run_dir / "labelled").is_symlink() and _snapshot(elsewhere) == kept
    smoke = str(ROOT / "configs/finetune/smoke.yaml")
    cfg = load_config(FinetuneConfig, smoke, [f"output_dir={run_dir}", f"data.train={src}"])
    claim_run_dir(run_dir, cfg, overwrite=True).release()
    assert not os.path.lexists(run_dir / "labelled") and _snapshot(elsewhere) == kept


def test_a_source_without_class_names_is_refused_naming_data_train(synthetic_shards, tmp_path):
    """Issue 38 #12: remote shards without an index name no classes: refused before anything
    is read or written, naming data.train (not the run's internal copy)."""
    spec = f"pipe:cat {synthetic_shards}/shard-000000.tar"
    line = _refused(lambda: choose_labelled(spec, 1, 0))
    assert line.startswith(f"data.labels_per_class=1: data.train={spec!r} names no classes"), line
    out = tmp_path / "ft"
    with pytest.raises(SystemExit) as e:
        pipeline("finetune")(finetune_args(spec, out, "data.labels_per_class=1"))
    assert str(e.value) == f"error: {line}"
    assert not out.exists() or run_files(out) == []


def test_images_training_cannot_decode_are_left_out_and_not_counted(tmp_path, caplog):
    """Issue 38 (also found): a drawn image that does not decode is not copied, is named, and
    `num_labelled` counts the images trained on, also when the copy is read back."""
    src = _folder(tmp_path / "src", {"cat": 4, "dog": 4})
    _image(src, "dog_img01").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 8)
    subset = choose_labelled(str(src), 4, 0)  # every image is drawn, the broken one too
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        use_labelled(subset, tmp_path / "run", write=True)
    assert list(subset.unusable) == ["dog_img01"] and subset.num_labelled == 7
    assert "1 of the 8 images drawn cannot be decoded" in caplog.text and "dog_img01" in caplog.text
    record = json.loads((tmp_path / "run" / "labelled.json").read_text())
    assert record["num_labelled"] == 7 and record["counts"] == {"cat": 4, "dog": 3}
    assert list(record["unusable"]) == ["dog_img01"]
    copy = open_source(str(tmp_path / "run" / "labelled"))
    assert len(copy) == 7 and "dog_img01" not in copy.sample_keys()
    again = choose_labelled(str(src), 4, 0)  # --resume: read back from labelled.json
    use_labelled(again, tmp_path / "run", write=True)
    assert again.num_labelled == 7 and again.unusable == subset.unusable


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_copy_leaves_nothing_behind(tmp_path, monkeypatch, request, sig):
    """Issue 38 #6, in-process: SIGTERM / SIGINT at the third image copied: one line, no staging
    folder, no copy, no record; the handlers before are back."""
    src = _folder(tmp_path / "src", {"cat": 4, "dog": 4})
    writes = []

    class Signalled(labelled_module.ShardWriter):
        def write(self, *args, **kwargs):
            writes.append(1)
            if len(writes) == 3:
                os.kill(os.getpid(), sig)
            super().write(*args, **kwargs)

    monkeypatch.setattr(labelled_module, "ShardWriter", Signalled)
    # As in a job started in the foreground: a shell's background job starts with SIGINT ignored,
    # and the copy leaves an ignored signal alone.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, before))
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    run_dir = tmp_path / "run"
    with pytest.raises(CopyInterruptedError) as e:
        use_labelled(choose_labelled(str(src), 3, 0), run_dir, write=True)
    assert str(e.value).startswith(f"{sig.name} while copying the labelled subset into {run_dir}")
    assert list(run_dir.iterdir()) == []
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


# The fine-tune job with a copy slowed to seconds (as K = 990 of large images), for a signal to
# land in it: each image written 0.3 s late.
_SLOW_COPY = f"""
import runpy, sys, time
import ssl_vit.data.labelled as labelled

class Slow(labelled.ShardWriter):
    def write(self, *args, **kwargs):
        time.sleep(0.3)
        super().write(*args, **kwargs)

labelled.ShardWriter = Slow
runpy.run_path({str(ROOT / "pipelines/finetune.py")!r}, run_name="__main__")
"""


@pytest.mark.system
def test_sigterm_during_the_copy_ends_in_one_line_and_the_same_command_starts(tmp_path):
    """Issue 38 #6, the job: SIGTERM while the subset is copied ends it with one line (exit 1),
    no staging folder and no run files left, so the same command starts again; it then counts
    the images it trained on (one of the 8 drawn does not decode)."""
    src = _folder(tmp_path / "src", {"cat": 4, "dog": 4})
    _image(src, "cat_img02").write_bytes(b"")
    out = tmp_path / "ft"
    args = finetune_args(src, out, "data.labels_per_class=4", "train.steps=2")
    log = tmp_path / "job.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        cmd = [sys.executable, "-c", _SLOW_COPY, *args]
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        end = time.time() + 300  # (the job's imports: seconds, minutes on a loaded machine)
        while not any(out.glob(".labelled.staging-*")):
            assert job.poll() is None and time.time() < end, log.read_text()[-3000:]
            time.sleep(0.005)
        job.send_signal(signal.SIGTERM)
        assert job.wait(60) == 1, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith(f"error: SIGTERM while copying the labelled subset into {out}"), last
    assert not any(out.glob(".labelled*")) and run_files(out) == []
    results = pipeline("finetune")(args)  # the same command
    assert results["num_labelled"] == 7 and results["labels_per_class"] == 4


@pytest.mark.system
def test_resume_checks_the_run_s_own_files_before_writing(synthetic_shards, tmp_path, monkeypatch):
    """Issue 38 #5 and #7, the job: with labelled.json lost, --resume with another K (or K = 0;
    or, with the copy gone too, a K that config.yaml contradicts) is one line and rewrites
    nothing; with its own K it rebuilds labelled.json and a truncated shard, identical, and
    finishes the run."""
    main = pipeline("finetune")
    out = tmp_path / "ft"
    steps = ["train.steps=6", "train.log_every=1"]
    stop_after_step(monkeypatch, 3)
    main(finetune_args(synthetic_shards, out, "data.labels_per_class=4", *steps))
    monkeypatch.undo()
    copy = {k: v for k, v in _snapshot(out).items() if k.startswith("labelled")}
    (out / "labelled.json").unlink()
    before = _snapshot(out)
    for k in (3, 0):
        with pytest.raises(SystemExit) as e:
            main(
                finetune_args(
                    synthetic_shards, out, f"data.labels_per_class={k}", *steps, "--resume"
                )
            )
        line = str(e.value)
        assert line.startswith("error: --resume: ") and f"data.labels_per_class 4 -> {k}" in line
        assert _snapshot(out) == before
    (out / "labelled").rename(out / "copy-aside")
    with pytest.raises(SystemExit, match="cannot continue with data.labels_per_class 4 -> 3"):
        main(finetune_args(synthetic_shards, out, "data.labels_per_class=3", *steps, "--resume"))
    (out / "copy-aside").rename(out / "labelled")
    assert _snapshot(out) == before
    shard = _shards(out)[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    results = main(
        finetune_args(synthetic_shards, out, "data.labels_per_class=4", *steps, "--resume")
    )
    assert results["step"] == 6 and results["num_labelled"] == 40
    assert {k: v for k, v in _snapshot(out).items() if k.startswith("labelled")} == copy
