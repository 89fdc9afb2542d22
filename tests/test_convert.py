"""make-shards at scale (ssl_vit/data/write/: convert.py, prepare.py, parts.py): N workers
write exactly what one writes, parts make the whole and read as one dataset, --max-size stores
images at training size, a killed run leaves the old dataset and no worker behind."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_atomic_writes import STALLED_READ  # make-shards whose read of zzz.png never returns

from ssl_vit.cli import main as cli
from ssl_vit.data import eval_loader, open_source, resolve_shards
from ssl_vit.data.write.convert import make_shards
from ssl_vit.data.write.parts import part_indices


def _image(path: Path, width: int, height: int, seed: int) -> bytes:
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    im = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="PNG" if path.suffix == ".png" else "JPEG", quality=85)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """23 images in 3 classes, JPEG and PNG, 20 to 90 px, and 3 unreadable files."""
    root = tmp_path_factory.mktemp("convert") / "src"
    for i in range(23):
        ext = "png" if i % 3 == 0 else "jpg"
        _image(root / f"c{i % 3}" / f"img{i:02d}.{ext}", 20 + 3 * i, 90 - 2 * i, seed=i)
    for name in ("c0/bad0.jpg", "c1/bad1.png", "c2/zz_bad2.jpg"):
        (root / name).write_bytes(b"\xff\xd8 not a jpeg" if name.endswith("jpg") else b"")
    return root


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _tar_samples(folder: Path) -> dict[str, bytes]:
    """Every sample's image bytes (key -> bytes) of a shard directory, read with tarfile."""
    import tarfile

    out = {}
    for path in sorted(folder.glob("*.tar")):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if not m.name.endswith(".cls"):
                    out[m.name.split(".")[0]] = tar.extractfile(m).read()
    return out


@pytest.mark.parametrize("max_size", [None, 40])
def test_two_workers_write_what_one_writes(folder, tmp_path, caplog, max_size):
    """Same shards, same bytes, same index.json; each unreadable file skipped, counted and named
    once, whichever worker met it."""
    kw = dict(shard_size=4, progress=False, max_size=max_size)
    one = make_shards(folder, tmp_path / "one", workers=1, **kw)
    caplog.clear()
    two = make_shards(folder, tmp_path / "two", workers=2, **kw)
    assert one == two and one["num_samples"] == 23 and one["num_skipped"] == 3
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    skips = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert sorted(m.split(":")[0].rsplit("/", 1)[1] for m in skips) == [
        "bad0.jpg",
        "bad1.png",
        "zz_bad2.jpg",
    ]


def test_max_size_resizes_big_images_and_copies_small_ones(folder, tmp_path):
    index = make_shards(folder, tmp_path / "out", shard_size=5, progress=False, max_size=40)
    assert index["resize"] == {
        "max_size": 40,
        "quality": 90,
        "lossless": False,
        "resized": 16,  # images 7..22 have a shorter side above 40 (20 + 3i x 90 - 2i)
        "copied": 7,
    }
    sources = {p.stem: p for p in folder.rglob("img*")}
    stored = _tar_samples(tmp_path / "out")
    sizes = " ".join(s["original_sizes"] for s in index["shards"]).split()
    keys = [k for s in index["shards"] for k in _shard_keys(tmp_path / "out" / s["name"])]
    assert len(sizes) == len(keys) == 23
    for key, size in zip(keys, sizes, strict=True):
        src = sources[key.split("_", 1)[1]]
        w, h = Image.open(src).size
        assert size == f"{w}x{h}"
        im = Image.open(io.BytesIO(stored[key]))
        if min(w, h) <= 40:
            assert stored[key] == src.read_bytes()  # copied byte for byte
        else:
            assert im.format == "JPEG" and min(im.size) == 40
            assert abs(max(im.size) - max(w, h) * 40 / min(w, h)) <= 0.5  # aspect kept
    lossless = make_shards(folder, tmp_path / "png", progress=False, max_size=40, lossless=True)
    formats = {Image.open(io.BytesIO(b)).format for b in _tar_samples(tmp_path / "png").values()}
    assert formats == {"JPEG", "PNG"} and lossless["resize"]["lossless"] is True


def _shard_keys(path: Path) -> list[str]:
    import tarfile

    with tarfile.open(path) as tar:
        return [m.name.split(".")[0] for m in tar.getmembers() if not m.name.endswith(".cls")]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_parts_make_the_whole_and_read_as_one_dataset(folder, tmp_path):
    whole = make_shards(folder, tmp_path / "whole", shard_size=4, progress=False)
    root = tmp_path / "parts"
    for i in range(3):
        index = make_shards(folder, root, shard_size=4, progress=False, part=f"{i}/3", workers=2)
        assert index["part"] == [i, 3] and index["source_samples"] == 26
    parts = [root / f"part-{i:05d}-of-00003" for i in range(3)]
    samples = [_tar_samples(p) for p in parts]
    assert sum(len(s) for s in samples) == whole["num_samples"]
    assert {k: v for s in samples for k, v in s.items()} == _tar_samples(tmp_path / "whole")
    assert sum(json.loads((p / "index.json").read_text())["num_skipped"] for p in parts) == 3
    keys = sorted(open_source(str(tmp_path / "whole")).sample_keys())
    brace = str(root / "part-{00000..00002}-of-00003")
    listed = ",".join(str(p) for p in parts)
    for spec in (str(root), brace, listed):
        source = open_source(spec)
        assert sorted(source.sample_keys()) == keys and len(source) == len(keys)
        assert len(resolve_shards(spec)) == sum(len(list(p.glob("*.tar"))) for p in parts)
        seen = [k for batch in eval_loader(spec, 5, 16) for k in batch.keys]
        assert sorted(seen) == keys  # every sample once
    assert part_indices(10, 1, 3) == [1, 4, 7]


def test_a_part_written_twice_or_of_another_split_is_refused(folder, tmp_path, capsys):
    root = tmp_path / "parts"
    args = ["make-shards", "--source", str(folder), "--output", str(root), "--workers", "1"]
    assert cli([*args, "--part", "1/3"]) == 0
    before = _files(root / "part-00001-of-00003")
    capsys.readouterr()
    for part, says in (("1/3", "already written"), ("0/4", "split into 3, not 4")):
        assert cli([*args, "--part", part]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert _files(root / "part-00001-of-00003") == before
    assert cli([*args, "--part", "3/3"]) == 1 and "0 <= I < N" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 of 3 parts not written yet"):
        resolve_shards(str(root))  # never a silent two thirds of the data


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc/*/stat: no kernel option needed)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.system
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_killed_parallel_make_shards_keeps_the_dataset_and_no_worker(tmp_path):
    data = tmp_path / "data"
    src = tmp_path / "src" / "cls"
    for i in range(4):
        _image(src / f"old{i}.png", 16, 16, seed=i)
    make_shards(src.parent, data, shard_size=2, progress=False)
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    for i in range(7):  # zzz.png is read last (--no-shuffle): a worker blocks there
        _image(src / ("zzz.png" if i == 6 else f"img{i}.png"), 16, 16, seed=10 + i)
    args = ["make-shards", "--source", str(src.parent), "--output", str(data), "--no-shuffle"]
    cmd = [sys.executable, "-c", STALLED_READ, *args, "--shard-size", "1", "--workers", "2"]
    cmd.append("--overwrite")  # the old dataset is replaced only if the run completes
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob(".data.staging-*/shard-*.tar"))) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "never got going"
            time.sleep(0.05)
        workers = _children(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert workers and {p.name: p.read_bytes() for p in data.iterdir()} == before
    deadline = time.monotonic() + 60  # the workers notice within a second
    while any(_running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(w) for w in workers), "a worker outlived its killed parent"
