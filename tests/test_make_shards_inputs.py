"""Bad inputs to the write side of make-shards / make-synthetic (issue 38): parts that disagree,
a symlinked output, a dead worker, more parts than images, absurd --workers, photos options
that were ignored. Each ends in one error line naming the path or option, and nothing written
before is lost or mixed."""

import io
import json
import multiprocessing
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssl_vit.cli import main as cli
from ssl_vit.config import ConfigError
from ssl_vit.data import open_source, read_index, resolve_shards, sources
from ssl_vit.data.write import convert
from ssl_vit.data.write.convert import make_shards
from ssl_vit.data.write.writer import ShardWriter
from ssl_vit.datasets.synthetic import make_synthetic_shards
from ssl_vit.runs.lock import lock_run_dir
from ssl_vit.train.preflight import check_shards


def _folder(root: Path, n: int, seed: int, classes: tuple[str, ...] = ("a", "b")) -> Path:
    """`n` 12x12 PNGs named img00.png ... in class folders: two folders made with the same `n`
    hold the same file names, as a train and a test split often do."""
    for i in range(n):
        pixels = np.random.default_rng([seed, i]).integers(0, 256, (12, 12, 3), dtype=np.uint8)
        path = root / classes[i % len(classes)] / f"img{i:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        path.write_bytes(buf.getvalue())
    return root


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (path relative to it -> bytes), hidden ones included."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    return err[0]


def _make_shards(source: Path, output: Path, *extra: str) -> int:
    args = ["--source", str(source), "--output", str(output), "--workers", "1"]
    return cli(["make-shards", *args, *extra])


@pytest.fixture
def splits(tmp_path) -> tuple[Path, Path]:
    """A train and a test folder: the same classes and file names, other images."""
    return _folder(tmp_path / "train", 6, seed=0), _folder(tmp_path / "test", 6, seed=1)


@pytest.mark.parametrize(
    ("split", "extra", "differs"),
    [
        ("test", [], "source"),
        ("train", ["--max-size", "8"], "max_size 8 vs None"),
        ("train", ["--no-verify"], "verify False vs True"),
    ],
)
def test_a_part_that_disagrees_is_refused_before_it_is_written(
    splits, tmp_path, capsys, split, extra, differs
):
    """Issue 38 #2: part 1 from the test split (or another --max-size, --no-verify) into the
    folder holding part 0 of the train split is one line naming both parts and the field."""
    train, test = splits
    root = tmp_path / "p"
    assert _make_shards(train, root, "--part", "0/2") == 0
    before = _tree(root)
    capsys.readouterr()
    source = test if split == "test" else train
    assert _make_shards(source, root, "--part", "1/2", *extra) == 1
    line = _one_error(capsys)
    assert differs in line, line
    assert str(root / "part-00001-of-00002") in line and str(root / "part-00000-of-00002") in line
    assert _tree(root) == before  # part 0 untouched, no part 1, no staging left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p", "test", "train"]
    assert _make_shards(train, root, "--part", "1/2") == 0  # the agreeing part still goes in


def test_a_source_that_changed_between_parts_is_refused(tmp_path, capsys):
    """The same path, but the source gained images (or classes) between the parts' jobs."""
    src = _folder(tmp_path / "src", 6, seed=0)
    root = tmp_path / "p"
    assert _make_shards(src, root, "--part", "0/2") == 0
    _folder(src / "c", 2, seed=2, classes=("",))  # c/img00.png, c/img01.png: a new class
    capsys.readouterr()
    assert _make_shards(src, root, "--part", "1/2") == 1
    assert "source images 8 vs 6" in _one_error(capsys)


def test_parts_that_disagree_are_refused_when_read(splits, tmp_path):
    """Parts written apart (or before parts were compared) and put side by side: every reader
    refuses them in one line naming the two parts, whether given as ROOT, a brace pattern or a
    list; parts of two folders stay two datasets joined on purpose."""
    train, test = splits
    root, other = tmp_path / "p", tmp_path / "q"
    assert make_shards(train, root, progress=False, part="0/2")["num_samples"] == 3
    make_shards(test, other, progress=False, part="1/2")
    os.rename(other / "part-00001-of-00002", root / "part-00001-of-00002")
    part0, part1 = root / "part-00000-of-00002", root / "part-00001-of-00002"
    brace = str(root / "part-{00000..00001}-of-00002")
    for spec in (str(root), brace, f"{part0},{part1}"):
        # (read_index describes a pattern or list by its first part alone: ROOT only)
        for read in (resolve_shards, open_source, read_index)[: 3 if spec == str(root) else 2]:
            with pytest.raises(ValueError) as e:
                read(spec)
            message = str(e.value)
            assert "\n" not in message and "source" in message, message
            assert str(part0) in message and str(part1) in message
    with pytest.raises(ConfigError, match=r"^data\.train='.*/p': .* not parts of one dataset"):
        check_shards("data.train", str(root))  # a job's check before compute: the key named
    make_shards(test, other, progress=False, part="0/2")  # q: part 0 of test, alone
    assert len(open_source(f"{part0},{other / 'part-00000-of-00002'}")) == 6


def test_parts_written_before_the_comparison_still_read(splits, tmp_path):
    """An index without the `conversion` record (written by an older version) is compared on
    the fields it has."""
    train, _ = splits
    root = tmp_path / "p"
    for i in range(2):
        make_shards(train, root, progress=False, part=f"{i}/2")
    index = root / "part-00000-of-00002" / "index.json"
    old = json.loads(index.read_text())
    del old["conversion"]
    index.write_text(json.dumps(old))
    assert len(open_source(str(root))) == 6 and len(resolve_shards(str(root))) == 2


def test_more_parts_than_images_is_refused_before_writing(tmp_path, capsys):
    """Issue 38 #13: a 200-part split of 100 images could never be completed."""
    src = _folder(tmp_path / "src", 5, seed=0)
    root = tmp_path / "p"
    assert _make_shards(src, root, "--part", "3/8") == 1
    line = _one_error(capsys)
    assert "--part 3/8" in line and "5 images" in line and "8 parts" in line, line
    assert not root.exists()
    assert _make_shards(src, root, "--part", "4/5") == 0  # one image a part is a split


def test_a_symlinked_output_is_refused_and_left_as_it_was(tmp_path, capsys):
    """Issue 38 #9: the dataset was swapped in place of the link, then rmtree failed on it and
    the user's link was left renamed. Now: one line naming the link, before any work."""
    real, link = tmp_path / "real", tmp_path / "link"
    make_synthetic_shards(real, n=4, image_size=8, shard_size=2)
    link.symlink_to(real, target_is_directory=True)
    before = _tree(real)
    src = _folder(tmp_path / "src", 4, seed=0)
    assert _make_shards(src, link) == 1
    assert str(link) in _one_error(capsys)
    for kind in ("shapes", "photos"):
        argv = ["make-synthetic", "--kind", kind, "--output", str(link), "--num", "2"]
        assert cli(argv) == 1 and "symbolic link" in _one_error(capsys)
    assert link.is_symlink() and os.readlink(link) == str(real) and _tree(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "src"]


@pytest.mark.system
@pytest.mark.skipif(
    multiprocessing.get_start_method() != "fork", reason="the patched read reaches forked workers"
)
def test_a_dead_worker_is_one_line_and_the_old_dataset_stays(tmp_path, monkeypatch, capsys):
    """Issue 38 #11: a SIGKILLed worker (as the out-of-memory killer kills) was a 33-line
    BrokenProcessPool traceback. The worker that reads zzz.png kills itself: the workers are
    forks of this process, so they inherit the patched read."""
    data = tmp_path / "data"
    make_synthetic_shards(data, n=4, image_size=8, shard_size=2)
    before = _tree(data)
    src = _folder(tmp_path / "src", 8, seed=0)
    shutil.copy(src / "a" / "img00.png", src / "a" / "zzz.png")
    parent, read = os.getpid(), sources.FolderSource.__getitem__

    def dying(self, i):
        if self.files[i].endswith("zzz.png") and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return read(self, i)

    monkeypatch.setattr(sources.FolderSource, "__getitem__", dying)
    monkeypatch.setattr(convert, "available_cpus", lambda: 2)
    args = ["make-shards", "--source", str(src), "--output", str(data), "--workers", "2"]
    assert cli([*args, "--shard-size", "1", "--overwrite"]) == 1
    line = _one_error(capsys)
    assert "worker died" in line and "killed by SIGKILL" in line and str(data) in line, line
    assert _tree(data) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "src"]  # no staging left
    deadline = time.monotonic() + 60  # killed on the way out; gone once the kernel runs them
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []  # no worker left behind


def test_workers_are_capped_at_the_cpus_in_one_line(tmp_path, monkeypatch, caplog, capsys):
    """--workers 1500 started 103 processes on 2 CPUs."""
    src = _folder(tmp_path / "src", 8, seed=0)
    started = []
    pool = convert.ProcessPoolExecutor
    monkeypatch.setattr(convert, "available_cpus", lambda: 2)
    monkeypatch.setattr(
        convert, "ProcessPoolExecutor", lambda n, **kw: started.append(n) or pool(n, **kw)
    )
    argv = ["make-shards", "--source", str(src), "--output", str(tmp_path / "out")]
    assert cli([*argv, "--workers", "1500"]) == 0
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert capped == ["--workers 1500: capped at the 2 CPUs available"]
    assert started == [2] and "2 workers" in capsys.readouterr().out


def test_photos_refuse_an_image_size_they_would_ignore(tmp_path, capsys):
    out = tmp_path / "photos"
    argv = ["make-synthetic", "--kind", "photos", "--output", str(out), "--num", "2"]
    assert cli([*argv, "--image-size", "64"]) == 1
    assert "--image-size" in _one_error(capsys) and not out.exists()


def test_photo_folder_refuses_a_folder_with_images_of_the_user(tmp_path, capsys):
    """--folder into a non-empty folder mixed the user's images into the photos' classes."""
    folder = _folder(tmp_path / "mine", 2, seed=0, classes=("chelsea",))
    before = _tree(folder)
    argv = ["make-synthetic", "--kind", "photos", "--folder", "--output", str(folder)]
    assert cli([*argv, "--num", "2"]) == 1
    line = _one_error(capsys)
    assert str(folder) in line and "--overwrite" in line and _tree(folder) == before
    pytest.importorskip("skimage")
    assert cli([*argv, "--num", "2", "--overwrite"]) == 0  # replaced as a whole, not mixed
    assert sorted(_tree(folder)) == [
        "astronaut/00000000_astronaut.jpg",
        "chelsea/00000001_chelsea.jpg",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# --- Issue 47: an output make-shards does not own ---------------------------------------------


def _entries(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under `root`, hidden ones included -> (inode, bytes of a regular file): a
    folder copied and swapped in has the same bytes but new inodes."""
    found = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
        found[str(p.relative_to(root))] = (st.st_ino, data)
    return found


def _foreign_output(tmp_path: Path, layout: str) -> tuple[Path, Path, str]:
    """(source, output, what the refusal names) for one layout of an output holding what
    make-shards did not write."""
    src = tmp_path / "src"
    if layout == "notes and hard links":
        _folder(src, 4, seed=0)
        out = tmp_path / "out"
        (out / "mine").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        _folder(out / "mine", 2, seed=3, classes=("x",))
        os.link(out / "mine" / "x" / "img00.png", out / "mine" / "x" / "link.png")
        return src, out, "mine"
    if layout == "dataset and a FIFO":
        _folder(src, 4, seed=0)
        out = tmp_path / "out"
        make_shards(src, out, progress=False)
        os.mkfifo(out / "pipe")
        return src, out, "pipe"
    if layout == "source inside":
        out = tmp_path / "out"
        src = _folder(out / "images", 4, seed=0)
        return src, out, str(src)
    assert layout == "source itself"
    _folder(src, 4, seed=0)
    return src, src, str(src)


@pytest.mark.parametrize(
    "layout", ["notes and hard links", "dataset and a FIFO", "source inside", "source itself"]
)
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_holding_what_make_shards_did_not_write_is_refused(
    tmp_path, capsys, layout, overwrite
):
    """Issue 47 #2: such an output was copied into the staging folder and swapped in: the
    source inside it replaced by a copy, hard links made full copies, a FIFO ended the job with
    a Python list. Now one line naming it, before any image is read; nothing moves."""
    src, out, names = _foreign_output(tmp_path, layout)
    before = _entries(tmp_path)
    reads = []
    read = sources.FolderSource.__getitem__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources.FolderSource, "__getitem__", lambda s, i: reads.append(i) or read(s, i))
        assert _make_shards(src, out, *["--overwrite"] * overwrite) == 1
    line = _one_error(capsys)
    assert str(out) in line and names in line, line
    assert line.endswith(("new or empty folder", "pick another directory")), line
    assert reads == [] and _entries(tmp_path) == before  # same inodes: nothing copied


@pytest.mark.parametrize("maker", ["make-shards", "make-synthetic"])
def test_overwrite_replaces_only_an_earlier_dataset(tmp_path, capsys, maker):
    """An empty folder is written into; a dataset there is replaced with --overwrite only,
    whole (no old shard stays beside the new ones), and nothing is left beside it."""
    src, out = _folder(tmp_path / "src", 6, seed=0), tmp_path / "data"
    out.mkdir()
    if maker == "make-shards":
        assert _make_shards(src, out) == 0  # an empty existing folder: fine
    else:
        make_synthetic_shards(out, n=8, image_size=8, shard_size=1)
    before = _entries(out)
    capsys.readouterr()
    assert _make_shards(src, out, "--shard-size", "4") == 1
    line = _one_error(capsys)
    assert str(out) in line and "--overwrite" in line, line
    assert _entries(out) == before
    assert _make_shards(src, out, "--shard-size", "4", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "index.json",
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    assert json.loads((out / "index.json").read_text())["num_samples"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "src"]


def test_parts_go_only_into_a_folder_of_parts(tmp_path, capsys):
    """The parts of a job array share their root: a file of the user's there is refused like
    in a dataset's folder; a part already written is replaced with --overwrite only."""
    src, root = _folder(tmp_path / "src", 6, seed=0), tmp_path / "p"
    assert _make_shards(src, root, "--part", "0/2") == 0
    (root / "README").write_text("mine")
    before = _entries(root)
    capsys.readouterr()
    for overwrite in ([], ["--overwrite"]):
        assert _make_shards(src, root, "--part", "1/2", *overwrite) == 1
        line = _one_error(capsys)
        assert str(root) in line and "README" in line, line
    assert _entries(root) == before
    (root / "README").unlink()
    assert _make_shards(src, root, "--part", "1/2") == 0
    part0 = root / "part-00000-of-00002"
    written = _entries(part0)
    assert _make_shards(src, root, "--part", "0/2") == 1
    assert "already written" in _one_error(capsys) and _entries(part0) == written
    assert _make_shards(src, root, "--part", "0/2", "--overwrite", "--shuffle-seed", "1") == 0
    assert len(open_source(str(root))) == 6 and _entries(part0) != written
    assert sorted(p.name for p in root.iterdir()) == [part0.name, "part-00001-of-00002"]


def test_shard_writer_replaces_only_a_dataset(tmp_path):
    """The swap replaces the whole folder, so it never goes over a file it did not write: one
    there before is refused (make-synthetic too), one put there meanwhile fails the close and
    the folder stays as it was."""
    out = tmp_path / "syn"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"syn: holds notes\.txt, not .*new or empty folder"):
        make_synthetic_shards(out, n=4, image_size=8)
    (out / "notes.txt").unlink()
    with pytest.raises(ValueError, match="late.txt"), ShardWriter(out, 2) as writer:
        writer.write("k0", "png", b"x", 0)
        (out / "late.txt").write_text("written meanwhile")
        writer.close(label_names=["a"], source="test")
    assert sorted(_entries(tmp_path)) == ["syn", "syn/late.txt"]  # no staging left
    assert (out / "late.txt").read_text() == "written meanwhile"


# --- Issue 47: run directories ------------------------------------------------------------------


def _run_output(runs: Path, layout: str) -> tuple[Path, str]:
    """(output, what the refusal says) for one layout of a run directory, as a fine-tune run
    leaves it or a live one holds it."""
    run = runs / "ft"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("output_dir: runs/ft\nfinetune:\n  epochs: 1\n")
    if layout == "finished run":
        (run / "results.json").write_text("{}\n")
        (run / "model.safetensors").write_bytes(b"weights")
        return run, "run directory"
    if layout == "live run":
        _LOCKS.append(lock_run_dir(run))  # held by this process as a job holds it
        return run, "run directory"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    if layout == "in its checkpoints":
        return run / "checkpoints" / "shards", "checkpoints"
    assert layout == "its labelled copy"
    make_synthetic_shards(run / "labelled", n=4, image_size=8, shard_size=2)
    return run / "labelled", "labelled"


_LOCKS: list = []


@pytest.mark.parametrize(
    "layout", ["finished run", "live run", "in its checkpoints", "its labelled copy"]
)
@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--part", "0/2"]])
def test_a_run_directory_is_refused(tmp_path, capsys, layout, extra):
    """Issue 47 #3: shards were mixed into a fine-tune's run directory (copied and swapped,
    its .lock never looked at). Refused as predict and export refuse it, in one line naming
    it, before any image is read; a new folder inside a run is written, as theirs are."""
    src, runs = _folder(tmp_path / "src", 4, seed=0), tmp_path / "runs"
    out, says = _run_output(runs, layout)
    before = _entries(runs)
    try:
        assert _make_shards(src, out, *extra) == 1
        line = _one_error(capsys)
        assert str(out) in line and says in line and "folder of their own" in line, line
        assert _entries(runs) == before
    finally:
        while _LOCKS:
            _LOCKS.pop().release()
    assert _make_shards(src, runs / "ft" / "shards", *extra) == 0
