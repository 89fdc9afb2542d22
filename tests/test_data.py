"""Data layer: shard writing and resolving, sources, the synthetic set, loaders and the CLI."""

import io
import json
import logging
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from ssl_vit.cli import main
from ssl_vit.config import ConfigError, FinetuneDataConfig, PretrainDataConfig
from ssl_vit.data import (
    StreamArgs,
    decode_image,
    eval_loader,
    open_source,
    pretrain_loader,
    read_index,
    resolve_shards,
    train_loader,
)
from ssl_vit.data.write.convert import make_shards
from ssl_vit.datasets.synthetic import SYNTHETIC_LABELS, synthetic_shapes
from ssl_vit.errors import InputError
from ssl_vit.train.preflight import check_labelled_source


def _data(train_shards: str = "", shuffle_buffer: int = 1000, **kw) -> PretrainDataConfig:
    """The data config of a loader (shuffle_buffer: the loaders' default before they took one)."""
    return PretrainDataConfig(train_shards=train_shards, shuffle_buffer=shuffle_buffer, **kw)


def _image_bytes(seed: int, fmt: str = "PNG", size: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size + 2, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _write_files(root: Path, names: list[str]) -> dict[str, bytes]:
    """Write an image per relative name (format from the extension); return name -> bytes."""
    files = {}
    for i, name in enumerate(names):
        fmt = {"png": "PNG", "jpg": "JPEG", "bmp": "BMP"}[name.rsplit(".", 1)[-1]]
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data := _image_bytes(i, fmt))
        files[name] = data
    return files


def _read_shards(folder: Path) -> dict[str, dict[str, bytes]]:
    """key -> {ext: bytes}, read with tarfile (independently of the code under test)."""
    samples: dict[str, dict[str, bytes]] = {}
    for path in sorted(folder.glob("*.tar")):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


def _eval_keys(source: str, **kw) -> list[str]:
    keys, skipped = [], 0
    for batch in eval_loader(source, 5, 32, **kw):
        keys += batch.keys
        skipped += batch.skipped
    assert skipped == 0
    return keys


# --------------------------------------------------------------------------------------------
# make_shards


def test_folder_round_trip(tmp_path):
    names = ["dog/b.png", "dog/a.jpg", "cat/x.y.png", "cat/x_y.png", "cat/sub/z.png", "ant/1.bmp"]
    files = _write_files(tmp_path / "src", names + ["dog/a.png"])
    (tmp_path / "src" / "dog" / "notes.txt").write_text("not an image")
    index = make_shards(tmp_path / "src", tmp_path / "out", shard_size=3, progress=False)

    assert index["label_names"] == ["ant", "cat", "dog"]
    assert index["num_samples"] == 7 and index["num_skipped"] == 0
    assert [s["num_samples"] for s in index["shards"]] == [3, 3, 1]
    assert json.loads((tmp_path / "out" / "index.json").read_text()) == index
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["index.json"] + [f"shard-00000{i}.tar" for i in range(3)]
    samples = _read_shards(tmp_path / "out")
    assert len(samples) == 7 and all("." not in k for k in samples)
    # Every file is stored byte for byte, under its extension, with its class folder's label.
    got = {
        (ext, data, int(s["cls"]))
        for s in samples.values()
        for ext, data in s.items()
        if ext != "cls"
    }
    want = {
        (n.rsplit(".", 1)[1], d, ["ant", "cat", "dog"].index(n.split("/")[0]))
        for n, d in files.items()
    }
    assert got == want
    assert "cat_sub_z" in samples and "dog_a" in samples and "dog_a_2" in samples


def test_unlabelled_folder(tmp_path):
    _write_files(tmp_path / "src", ["a.png", "b.png", "c.jpg"])
    index = make_shards(tmp_path / "src", tmp_path / "out", progress=False)
    assert index["label_names"] == [] and index["num_samples"] == 3
    samples = _read_shards(tmp_path / "out")
    assert sorted(samples) == ["a", "b", "c"] and all("cls" not in s for s in samples.values())
    labels = torch.cat([b.labels for b in eval_loader(str(tmp_path / "out"), 2, 16, num_workers=0)])
    assert labels.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("workers", [1, 2])
def test_hf_dataset_round_trip(tmp_path, workers):
    datasets = pytest.importorskip("datasets")
    images = [_image_bytes(i) for i in range(5)]
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "y": datasets.ClassLabel(names=["no", "yes"]),
            "id": datasets.Value("int32"),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "img": [{"bytes": b, "path": None} for b in images],
            "y": [1, 0, 1, 1, 0],
            "id": list(range(5)),
        },
        features=features,
    )
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(tmp_path / "hf")

    out = tmp_path / "out"
    index = make_shards(tmp_path / "hf", out, split="train", progress=False, workers=workers)
    assert index["label_names"] == ["no", "yes"] and index["num_samples"] == 5
    got = {(s["png"], int(s["cls"])) for s in _read_shards(tmp_path / "out").values()}
    assert got == set(zip(images, [1, 0, 1, 1, 0], strict=True))

    test = open_source(str(tmp_path / "hf"), split="test")
    assert len(test) == 2 and test.labels().tolist() == [1, 0]
    assert [(r.index, r.data) for r in test.iter_records([1])] == [(1, images[1])]


def test_a_saved_dataset_is_read_by_split_name_and_says_why_it_has_no_labels(tmp_path, caplog):
    """A saved DatasetDict given as a job's source (`data.eval=hf`) names its split: reading
    "train" unasked would score a fine-tune on its own training images. A label column that is
    no ClassLabel is named, with the fix."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": _image_bytes(i), "path": None} for i in range(5)]}
        | {"label": [0, 1, 1, 0, 1]},
        features=features,
    )
    datasets.DatasetDict({"train": ds, "test": ds.select([3, 4])}).save_to_disk(tmp_path / "two")
    datasets.DatasetDict({"test": ds.select([0])}).save_to_disk(tmp_path / "one")
    two = str(tmp_path / "two")

    with pytest.raises(ConfigError) as e:
        check_labelled_source("data.eval", two)
    assert str(e.value) == (
        f"data.eval={two!r}: {two}: a dataset of 2 splits (test, train); name the one to "
        f"read: {two}/test or {two}/train"
    )
    assert check_labelled_source("data.eval", f"{two}/test") == ["a", "b"]
    assert open_source(f"{two}/test").labels().tolist() == [0, 1]
    assert open_source(two, split="test").labels().tolist() == [0, 1]  # make-shards' --split
    assert open_source(str(tmp_path / "one")).labels().tolist() == [0]  # one split: no choice
    # A class column stored as ints (or strings) names no classes: the error says how to fix it.
    ds.cast_column("label", datasets.Value("int64")).save_to_disk(tmp_path / "ints")
    with pytest.raises(ConfigError, match=r"its column 'label' is Value\('int64'\), not a "):
        check_labelled_source("data.train", str(tmp_path / "ints"))
    with caplog.at_level(logging.WARNING):
        make_shards(tmp_path / "ints", tmp_path / "shards", progress=False)
    assert "not a ClassLabel" in caplog.text and "written without labels" in caplog.text


def test_hub_dataset_name(tmp_path, monkeypatch):
    """`hf://NAME:SPLIT` goes to datasets.load_dataset (stubbed here: no network in tests)."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": _image_bytes(i), "path": None} for i in range(3)], "label": [0, 1, 1]},
        features=features,
    )
    calls = []
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split: calls.append((name, split)) or ds
    )
    src = open_source("hf://someone/tiny:test")
    assert calls == [("someone/tiny", "test")]
    assert src.label_names == ["a", "b"] and src.labels().tolist() == [0, 1, 1]
    with pytest.raises(FileNotFoundError, match="not found"):
        open_source(str(tmp_path / "someone/tiny"))


def test_corrupt_files_are_skipped(tmp_path, caplog):
    _write_files(tmp_path / "src", ["a/1.png", "a/2.png", "b/3.png"])
    (tmp_path / "src" / "a" / "empty.png").write_bytes(b"")
    (tmp_path / "src" / "b" / "text.png").write_bytes(b"this is not a png at all")
    with caplog.at_level(logging.WARNING):
        index = make_shards(tmp_path / "src", tmp_path / "out", progress=False)
    assert index["num_samples"] == 3 and index["num_skipped"] == 2
    assert sorted(_read_shards(tmp_path / "out")) == ["a_1", "a_2", "b_3"]
    assert "empty.png" in caplog.text and "text.png" in caplog.text


# --------------------------------------------------------------------------------------------
# Streaming


def _bad_shard(path: Path) -> list[str]:
    """A shard with 6 good samples and 3 bad ones; returns the good keys."""
    good = [f"g{i}" for i in range(6)]
    png = _image_bytes(99)
    with wds.TarWriter(str(path), encoder=False) as w:
        for i, key in enumerate(good[:3]):
            w.write({"__key__": key, "png": _image_bytes(i), "cls": b"1"})
        w.write({"__key__": "truncated", "png": png[: len(png) // 2], "cls": b"0"})
        w.write({"__key__": "garbage", "jpg": b"\x00garbage" * 20, "cls": b"0"})
        w.write({"__key__": "noimage", "cls": b"0"})
        for i, key in enumerate(good[3:]):
            w.write({"__key__": key, "png": _image_bytes(10 + i), "cls": b"1"})
    return good


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_skips_bad_samples(tmp_path, num_workers):
    good = _bad_shard(tmp_path / "shard-000000.tar")
    _bad_shard(tmp_path / "shard-000001.tar")
    batches = list(eval_loader(str(tmp_path), 4, 16, num_workers=num_workers))
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys) == sorted(good * 2)
    assert sum(b.skipped for b in batches) == 6  # 3 bad samples in each shard
    assert all(b.images.shape[1:] == (3, 16, 16) for b in batches)
    assert all((b.labels == 1).all() for b in batches)


def test_truncated_and_broken_shards(tmp_path, synthetic_shards):
    shard = synthetic_shards / "shard-000000.tar"
    with tarfile.open(shard) as tar:  # cut in the middle of an image near the shard's middle
        images = [m for m in tar.getmembers() if m.name.endswith(".png")]
    image = images[len(images) // 2]
    cut = image.offset_data + image.size // 2
    (tmp_path / "cut.tar").write_bytes(shard.read_bytes()[:cut])
    (tmp_path / "junk.tar").write_bytes(b"this is not a tar file" * 100)
    spec = f"{tmp_path / 'cut.tar'}::{tmp_path / 'junk.tar'}"
    batches = list(eval_loader(spec, 8, 32, num_workers=0))
    # The samples before the cut arrive; the one cut in half has its .cls but no image.
    assert 10 < sum(len(b.keys) for b in batches) < 48
    assert sum(b.skipped for b in batches) == 1
    assert sum(b.skipped_shards for b in batches) == 2  # the cut, and the file that is no tar

    urls = [str(synthetic_shards / "shard-000001.tar"), str(tmp_path / "missing.tar")]
    it = iter(pretrain_loader(_data(shuffle_buffer=0), StreamArgs(16, 0, 32), urls=urls))
    batches = [next(it) for _ in range(12)]
    assert sum(b.skipped_shards for b in batches) > 0
    assert all(len(b.keys) == 16 for b in batches)


def test_stream_fails_loudly_instead_of_spinning(tmp_path):
    with wds.TarWriter(str(tmp_path / "bad.tar"), encoder=False) as w:
        for i in range(20):
            w.write({"__key__": f"k{i}", "png": b"not a png"})
    stream = StreamArgs(4, 0, 16, max_consecutive_failures=10)
    loader = pretrain_loader(_data(str(tmp_path / "bad.tar")), stream)
    with pytest.raises(InputError, match="10 samples in a row failed to decode"):
        next(iter(loader))
    missing = [str(tmp_path / "gone.tar")]
    loader = pretrain_loader(_data(), stream, urls=missing)
    with pytest.raises(InputError, match="no samples from the last 10 shards"):
        next(iter(loader))


@pytest.mark.parametrize(
    ("num_workers", "world_size"), [(0, 1), (2, 1), (0, 2), (2, 2), (0, 3)]
)  # 2 shards: (2, 2) and (0, 3) split samples by index modulo instead of by shard
def test_eval_loader_delivers_each_sample_once(synthetic_shards, num_workers, world_size):
    per_rank = [
        _eval_keys(str(synthetic_shards), num_workers=num_workers, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    keys = [k for ks in per_rank for k in ks]
    assert sorted(keys) == [key for key, _, _ in synthetic_shapes(96)]
    assert all(per_rank)  # no rank is left without data


def test_eval_loader_indices_and_limit(synthetic_shards):
    labels = open_source(str(synthetic_shards)).labels()
    batches = list(eval_loader(str(synthetic_shards), 4, 32, num_workers=2, indices=[90, 3, 50]))
    keys = [k for b in batches for k in b.keys]
    got = sorted(zip(keys, torch.cat([b.labels for b in batches]).tolist(), strict=True))
    assert got == [("00000003_frame", labels[3]), ("00000050_disc", 0), ("00000090_disc", 0)]
    first = [
        k
        for b in eval_loader(str(synthetic_shards), 4, 32, num_workers=0, limit=10)
        for k in b.keys
    ]
    assert first == [f"{i:08d}_{SYNTHETIC_LABELS[i % 10]}" for i in range(10)]


def test_pretrain_loader_batches(synthetic_shards):
    rng_before = torch.get_rng_state()
    loaders = [
        pretrain_loader(_data(str(synthetic_shards)), StreamArgs(8, 0, 24, seed=s))
        for s in (0, 0, 1)
    ]
    first = [next(iter(loader)) for loader in loaders]
    assert torch.equal(torch.get_rng_state(), rng_before)  # augmentation uses its own RNG
    batch = first[0]
    assert batch.images.shape == (8, 3, 24, 24) and batch.images.dtype == torch.uint8
    assert batch.labels.dtype == torch.int64 and ((batch.labels >= 0) & (batch.labels < 10)).all()
    assert batch.skipped == 0 and batch.skipped_shards == 0
    assert torch.equal(first[0].images, first[1].images)  # same seed, same stream
    assert not torch.equal(first[0].images, first[2].images)

    it = iter(
        pretrain_loader(_data(str(synthetic_shards), shuffle_buffer=20), StreamArgs(16, 2, 32))
    )
    batches = [next(it) for _ in range(8)]  # 128 > 96 samples: the stream does not end
    assert all(b.images.shape == (16, 3, 32, 32) for b in batches)


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_assemble_the_batches_of_the_serial_stream(synthetic_shards, workers):
    """5 lanes split unevenly over 2 or 3 workers (3 + 2, 2 + 2 + 1), each sending its share of
    `workers` batches at once: the same batches, positions and labels as the stream read in
    the main process, in order."""

    def batches(num_workers):
        data = _data(str(synthetic_shards), shuffle_buffer=10, lanes=5)
        it = iter(pretrain_loader(data, StreamArgs(10, num_workers, 16, seed=3)))
        return [next(it) for _ in range(7)]  # not a multiple of the workers

    for a, b in zip(batches(0), batches(workers), strict=True):
        assert a.keys == b.keys and a.position == b.position
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
        assert b.images.is_contiguous() and b.images.shape == (10, 3, 16, 16)


def test_train_loader_from_folder(tmp_path):
    _write_files(tmp_path / "src", [f"{c}/{i}.png" for c in ("a", "b") for i in range(5)])
    it = iter(
        train_loader(
            FinetuneDataConfig(train=str(tmp_path / "src"), lanes=1), StreamArgs(4, 0, 8, seed=3)
        )
    )
    batches = [next(it) for _ in range(5)]  # 20 samples: two epochs
    assert all(b.images.shape == (4, 3, 8, 8) for b in batches)
    keys = [k for b in batches for k in b.keys]
    assert sorted(keys[:10]) == sorted(keys[10:]) and keys[:10] != keys[10:]
    assert [int(k[0] == "b") for k in keys] == torch.cat([b.labels for b in batches]).tolist()
    # A source without labels is refused before the job starts (the one check; the loader
    # trusts it).
    _write_files(tmp_path / "flat", ["a.png"])
    with pytest.raises(ConfigError, match="has no labels"):
        check_labelled_source("data.train", str(tmp_path / "flat"))


def test_decode_image_formats():
    for fmt in ("PNG", "JPEG", "BMP"):  # BMP: torchvision cannot, PIL fallback
        image = decode_image(_image_bytes(0, fmt))
        assert image.shape == (3, 16, 18) and image.dtype == torch.uint8
    for bad in (b"", b"garbage", _image_bytes(0)[:60]):
        with pytest.raises((RuntimeError, ValueError, OSError)):
            decode_image(bad)


# --------------------------------------------------------------------------------------------
# Sources, resolving, synthetic data


def test_sources_read_only_chosen_samples(synthetic_shards, tmp_path):
    shards = open_source(str(synthetic_shards))
    assert len(shards) == 96 and shards.label_names == SYNTHETIC_LABELS
    assert shards.labels().tolist() == [i % 10 for i in range(96)]
    want = {i: (data, label) for i, (_, data, label) in enumerate(synthetic_shapes(96))}
    got = [(r.index, r.data, r.label) for r in shards.iter_records([95, 47, 48, 0])]
    assert [i for i, _, _ in got] == [0, 47, 48, 95]
    assert all((d, y) == want[i] for i, d, y in got)

    files = _write_files(tmp_path, ["b/1.png", "a/2.png", "a/1.png"])
    folder = open_source(str(tmp_path))
    assert folder.label_names == ["a", "b"] and folder.labels().tolist() == [0, 0, 1]
    assert [(r.index, r.data, r.label) for r in folder.iter_records([2])] == [
        (2, files["b/1.png"], 1)
    ]
    with pytest.raises(FileNotFoundError, match="not found"):
        open_source(str(tmp_path / "nope"))


def test_resolve_shards(synthetic_shards, tmp_path):
    d = synthetic_shards
    shards = [str(d / "shard-000000.tar"), str(d / "shard-000001.tar")]
    assert resolve_shards(str(d)) == shards
    assert resolve_shards(str(d / "index.json")) == shards
    assert resolve_shards(f"{d}/shard-{{000000..000001}}.tar") == shards
    assert resolve_shards(shards[1]) == shards[1:]
    assert resolve_shards(f"{shards[1]}::{shards[0]}") == shards[::-1]
    assert resolve_shards("pipe:cat a-{0..1}.tar") == ["pipe:cat a-0.tar", "pipe:cat a-1.tar"]
    assert read_index(str(d))["num_samples"] == 96
    assert read_index(shards[0])["label_names"] == SYNTHETIC_LABELS
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_shards(str(tmp_path / "missing"))
    with pytest.raises(
        FileNotFoundError, match=f"no shards \\(\\*.tar\\) in directory {tmp_path}$"
    ):
        resolve_shards(str(tmp_path))
    _write_files(tmp_path / "photos", ["cat/a/1.jpg"])  # a new user's photos: how to shard them
    with pytest.raises(FileNotFoundError, match="it holds images.*make-shards --source .*photos"):
        resolve_shards(str(tmp_path / "photos"))
    with pytest.raises(FileNotFoundError, match="1 of 3 shards"):
        resolve_shards(f"{d}/shard-{{000000..000002}}.tar")


def test_synthetic_is_deterministic():
    a = list(synthetic_shapes(20, image_size=32, seed=5))
    assert a == list(synthetic_shapes(20, image_size=32, seed=5))
    assert a[:7] == list(synthetic_shapes(7, image_size=32, seed=5))  # sample i independent of n
    assert [x[1] for x in a] != [x[1] for x in synthetic_shapes(20, image_size=32, seed=6)]
    assert [y for _, _, y in a] == [i % 10 for i in range(20)]
    assert len({k for k, _, _ in a}) == 20 and all("." not in k for k, _, _ in a)
    images = torch.stack([decode_image(data) for _, data, _ in a]).float()
    assert images.shape == (20, 3, 32, 32)
    # Shapes are visible: within an image, the foreground differs clearly from the background.
    assert (images.flatten(1).std(1) > 15).all()


def test_synthetic_shape_colour_is_the_class_hue(monkeypatch):
    """Each class has a typical colour: the shape's mean colour (its pixels, read through the
    mask render_shape drew) has hue label/10 within HUE_JITTER, over 10 classes x 20 draws; and
    the jitter is used (the hues spread), so neighbouring classes overlap in colour."""
    import colorsys

    from ssl_vit.datasets import synthetic as syn

    masks = []
    real_mask = syn._shape_mask
    monkeypatch.setattr(syn, "_shape_mask", lambda *a: masks.append(real_mask(*a)) or masks[-1])
    offsets = []
    for label in range(10):
        for seed in range(20):
            img = syn.render_shape(label, 32, np.random.default_rng([7, label, seed]))
            rgb = img[masks[-1]].astype(np.float64).mean(0) / 255
            hue = colorsys.rgb_to_hsv(*rgb)[0]
            offsets.append((hue - label / 10 + 0.5) % 1.0 - 0.5)  # signed, on the circle
    offsets = np.array(offsets)
    assert np.abs(offsets).max() <= syn.HUE_JITTER + 0.02  # noise sigma 4 moves the mean little
    assert np.abs(offsets).max() > 0.8 * syn.HUE_JITTER and offsets.std() > 0.04


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_make_shards(tmp_path, capsys):
    _write_files(tmp_path / "src", ["a/1.png", "b/2.png"])
    out = tmp_path / "out"
    assert main(["make-shards", "--source", str(tmp_path / "src"), "--output", str(out)]) == 0
    assert read_index(str(out))["num_samples"] == 2
    assert "wrote 2 images" in capsys.readouterr().out

    assert main(["make-synthetic", "--output", str(tmp_path / "syn"), "--num", "12"]) == 0
    assert read_index(str(tmp_path / "syn"))["num_samples"] == 12

    assert main(["make-shards", "--source", str(tmp_path / "nope"), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and err.count("\n") == 1 and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# Resumable training streams


def _take(loader, n: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("world_size", [1, 3])  # 3 ranks > 2 shards: shards are shared
def test_training_epoch_sees_every_sample_once(synthetic_shards, world_size):
    keys = []
    for rank in range(world_size):
        stream = StreamArgs(8 * world_size, 0, 16, rank=rank, world_size=world_size)
        loader = pretrain_loader(_data(str(synthetic_shards), lanes=2 * world_size), stream)
        # 2 lanes (a shard each), or 6 sharing the 2 shards (3 each): epoch 0 ends together.
        share = 96 // world_size
        keys += [k for b in _take(loader, share // 8) for k in b.keys]
    assert sorted(keys) == sorted(k for k, _, _ in synthetic_shapes(96))


@pytest.mark.parametrize("resampled", [False, True])
def test_training_stream_resumes_exactly(synthetic_shards, resampled):
    from ssl_vit.data import StreamTracker

    data = _data(str(synthetic_shards), shuffle_buffer=10, resampled=resampled)
    stream = StreamArgs(global_micro=8, num_workers=2, image_size=16, seed=4)
    loader = pretrain_loader(data, stream)
    full = _take(loader, 9)
    tracker = StreamTracker(loader.tracker.identity, loader.tracker.lanes)
    for b in full[:5]:
        tracker.update(b)
    # Resumed with 1 worker, or as 2 processes of 4: the same batches.
    resumed = _take(
        pretrain_loader(data, replace(stream, num_workers=1, resume=tracker.state_dict())), 4
    )
    for a, b in zip(full[5:], resumed, strict=True):
        assert a.keys == b.keys and torch.equal(a.images, b.images)
    halves = [
        _take(
            pretrain_loader(
                data, replace(stream, resume=tracker.state_dict(), rank=r, world_size=2)
            ),
            4,
        )
        for r in range(2)
    ]
    for a, b, c in zip(full[5:], *halves, strict=True):
        assert a.keys == b.keys + c.keys and torch.equal(a.images, torch.cat([b.images, c.images]))


def test_training_stream_counts_bad_samples_and_shards(tmp_path, synthetic_shards):
    jpeg = _image_bytes(7, "JPEG")
    with wds.TarWriter(str(tmp_path / "bad.tar"), encoder=False) as w:
        for i in range(3):
            w.write({"__key__": f"g{i}", "png": _image_bytes(i)})
        w.write({"__key__": "truncated_jpeg", "jpg": jpeg[: len(jpeg) // 2]})
        w.write({"__key__": "not_an_image", "png": b"hello, world" * 10})
        w.write({"__key__": "zero_bytes", "png": b""})
        w.write({"__key__": "no_image", "txt": b"caption only"})
        for i in range(3, 6):
            w.write({"__key__": f"g{i}", "png": _image_bytes(i)})
    (tmp_path / "directory.tar").mkdir()  # exists, cannot be read as a file
    urls = [
        str(synthetic_shards / "shard-000000.tar"),
        str(tmp_path / "bad.tar"),
        str(tmp_path / "missing.tar"),
        str(tmp_path / "directory.tar"),
    ]
    batches = _take(
        pretrain_loader(
            _data(shuffle_buffer=0, lanes=1),  # one lane: epochs in order
            # Epoch 0 visits the unreadable shards first (a shard's error is reported with the
            # batch that follows it: a last one would be reported in epoch 1's first batch).
            StreamArgs(6, 0, 16, seed=1),
            urls=urls,
        ),
        9,
    )
    keys = [k for b in batches for k in b.keys]  # one epoch: 48 + 6 good samples
    assert sorted(keys) == sorted(
        [k for k, _, _ in synthetic_shapes(48)] + [f"g{i}" for i in range(6)]
    )
    assert sum(b.skipped for b in batches) == 4  # the 4 bad samples
    assert sum(b.skipped_shards for b in batches) == 2  # missing and unreadable


def test_lanes_resolve_and_split_in_order():
    from ssl_vit.data.stream_state import lane_range, resolve_lanes

    assert resolve_lanes(0, 4096, 8, None) == 64  # auto: the largest divisor up to 64
    assert resolve_lanes(0, 100, 1, None) == 50
    assert resolve_lanes(0, 128, 1, None, shards=10) == 8  # a lane per shard at most
    assert resolve_lanes(0, 32, 2, 16) == 16  # resuming: the checkpoint's count
    assert resolve_lanes(8, 32, 2, 16) == 8  # asked for (the stream check refuses a change)
    assert resolve_lanes(0, 128, 1, None, paired=True) == 64  # mixup: an even share (2)
    assert resolve_lanes(0, 96, 1, None, paired=True) == 48  # not 32: 3 a lane
    with pytest.raises(ValueError, match="^data.lanes: 32 lanes give 3 images each"):
        resolve_lanes(32, 96, 1, None, paired=True)
    with pytest.raises(ValueError, match="data.lanes: 3 .auto. does not divide .* 7"):
        resolve_lanes(0, 7, 1, None, paired=True)
    # An auto count that does not split over the processes (fewer shards than processes):
    # the fewest lanes that do, sharing shards; none (an odd mixup share): the error.
    assert resolve_lanes(0, 32, 2, None, shards=1) == 2  # 1 shard, 2 processes
    assert resolve_lanes(0, 256, 8, None, shards=3) == 8  # 3 shards, 8 processes
    assert resolve_lanes(0, 1000, 8, None) == 8  # 50 would not split over 8
    assert resolve_lanes(0, 32, 1, None, shards=1) == 1  # one process: one lane a shard
    with pytest.raises(ValueError, match="data.lanes: 3 .auto. lanes do not split over 2"):
        resolve_lanes(0, 6, 2, None, paired=True)
    with pytest.raises(ValueError, match="data.lanes: 4 lanes do not split over 8"):
        resolve_lanes(4, 32, 8, None)  # asked for: as given
    with pytest.raises(ValueError, match="data.lanes: 16 does not divide the global micro"):
        resolve_lanes(16, 24, 1, None)
    for lanes, world in ((16, 1), (16, 2), (12, 3), (64, 8)):
        for workers in range(1, lanes // world + 1):
            order = [
                lane
                for rank in range(world)
                for w in range(workers)
                for lane in lane_range(lanes, rank, world, w, workers)
            ]
            assert order == list(range(lanes))  # rank-major, worker-major, contiguous
            sizes = [len(lane_range(lanes, 0, world, w, workers)) for w in range(workers)]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_a_resumed_lane_rereads_at_most_its_shard_up_to_its_position(synthetic_shards, monkeypatch):
    """Resuming costs reading each lane's current shard up to its position (to the end of the
    shuffle block holding it), never the samples of earlier shards."""
    from ssl_vit.data import stages

    data = _data(str(synthetic_shards), shuffle_buffer=16)  # 2 lanes, blocks of 8
    stream = StreamArgs(global_micro=8, num_workers=0, image_size=16, seed=2)
    loader = pretrain_loader(data, stream)
    it = iter(loader)
    for _ in range(15):  # 60 samples per lane: past its first shard (48), 12 into its second
        loader.tracker.update(next(it))
    state = loader.tracker.state_dict()
    assert sorted(tuple(p) for p in state["positions"].values()) == [(1, 12), (1, 12)]
    read = []
    real = stages.shard_samples

    def counted(*args, **kwargs):
        for sample in real(*args, **kwargs):
            read.append(sample["__key__"])
            yield sample

    monkeypatch.setattr(stages, "shard_samples", counted)
    next(iter(pretrain_loader(data, replace(stream, resume=state))))
    assert len(read) == 2 * 16  # per lane: blocks 0 and 1 of its shard (12 consumed, 4 next)


def test_share_gives_each_sample_to_one_unit():
    """`share`, the one split of a source over ranks, workers or lanes: every unit gets data,
    every sample of every item goes to exactly one unit, and units reading whole items read
    u, u + units, ..."""
    from ssl_vit.data.stages import share

    for n in range(1, 7):
        for units in range(1, 9):
            seen = []
            for u in range(units):
                mine, keep, of = share(n, u, units)
                items = range(n)[mine]
                assert items, (n, u, units)
                if n >= units:
                    assert list(items) == list(range(u, n, units)) and (keep, of) == (0, 1)
                seen += [(j, i) for j in items for i in range(12) if i % of == keep]
            assert sorted(seen) == [(j, i) for j in range(n) for i in range(12)]


def test_tar_groups_reads_a_truncated_shard_up_to_the_cut(tmp_path):
    """The one tar reader: a shard cut inside a member yields the samples before the cut and
    the one it cut (as read so far), then reports one error (with the URL) to `on_error`;
    without `on_error` it raises."""
    import tarfile

    from ssl_vit.data.tar import tar_groups
    from ssl_vit.data.write.writer import ShardWriter

    with ShardWriter(tmp_path / "ds", shard_size=10) as w:
        for i in range(4):
            w.write(f"s{i}", "png", bytes(2000), label=i)
        w.close(label_names=[str(i) for i in range(4)], source="test")
    shard = tmp_path / "ds" / "shard-000000.tar"
    whole = [(i, g["__key__"], g["cls"]) for i, g in tar_groups(str(shard))]
    assert whole == [(i, f"s{i}", str(i).encode()) for i in range(4)]
    cut = tmp_path / "cut.tar"
    # A sample is 3584 bytes (512 + 512 label, 512 + 2048 image): cut inside s2's image.
    cut.write_bytes(shard.read_bytes()[: 2 * 3584 + 1024 + 512 + 100])
    errors = []
    got = [g for _, g in tar_groups(str(cut), on_error=errors.append)]
    assert [g["__key__"] for g in got] == ["s0", "s1", "s2"] and "png" not in got[2]
    assert len(errors) == 1 and str(cut) in errors[0].args
    with pytest.raises(tarfile.ReadError):
        list(tar_groups(str(cut)))


# --------------------------------------------------------------------------------------------
# Issue 47, defect 4: make-shards keeps EXIF orientation (read upright, never turned twice)


@pytest.mark.parametrize("max_size", [None, 24])
def test_make_shards_of_oriented_images_reads_back_upright(tmp_path, max_size):
    """JPEGs and PNGs with EXIF orientations 1-8 through make-shards: stored byte for byte (the
    tag kept: the reader turns them) or, resized (`max_size`), re-encoded upright without the
    tag (so never turned twice); read back, each is the image exif_transpose shows, its
    recorded original size the upright one."""
    from test_images import exif_transposed, oriented, upright_reference

    src = tmp_path / "src"
    src.mkdir()
    for orientation in range(1, 9):
        for fmt in ("JPEG", "PNG"):
            name = f"o{orientation}_{fmt.lower()}.{fmt.lower()}"  # key o1_jpeg, ...
            (src / name).write_bytes(oriented(orientation, fmt))
    index = make_shards(src, tmp_path / "out", progress=False, max_size=max_size, shuffle_seed=None)
    assert index["num_samples"] == 16 and index["num_skipped"] == 0
    samples = _read_shards(tmp_path / "out")
    for key, sample in samples.items():
        orientation, fmt = int(key[1]), key.rsplit("_", 1)[1].upper()
        ((_, data),) = sample.items()
        image = decode_image(data)
        if max_size is None:
            assert data == oriented(orientation, fmt)
            assert torch.equal(image, upright_reference(orientation, fmt)), key
            continue
        with Image.open(io.BytesIO(data)) as im:
            assert 0x0112 not in im.getexif(), key  # re-encoded upright: no tag to turn it again
        assert image.shape == (3, 24, 32), key
        small = Image.fromarray(exif_transposed(oriented(orientation, fmt)))
        expected = np.asarray(small.resize((32, 24), Image.Resampling.BICUBIC))
        diff = np.abs(image.permute(1, 2, 0).numpy().astype(int) - expected).mean()
        assert diff < 10, (key, diff)  # JPEG q90 of saturated blocks; a wrong turn: ~50
    if max_size is not None:
        assert {s["original_sizes"] for s in index["shards"]} == {" ".join(["64x48"] * 16)}
        return
    # The evaluation / few-shot stream of the shards: the evaluation transform of each upright
    # image.
    from ssl_vit.data.images import eval_transform

    seen = {}
    for batch in eval_loader(str(tmp_path / "out"), 5, 16, num_workers=0):
        seen.update(zip(batch.keys, batch.images, strict=True))
    assert len(seen) == 16
    for key, image in seen.items():
        orientation, fmt = int(key[1]), key.rsplit("_", 1)[1].upper()
        assert torch.equal(image, eval_transform(16)(upright_reference(orientation, fmt))), key


# --------------------------------------------------------------------------------------------
# Issue 47, defect 5: images beside a folder's class folders are never dropped unsaid


def _nested_folder(root: Path) -> dict[str, bytes]:
    """Root images, two class folders, one with a deeper sub-folder, a hidden folder."""
    names = ["b.png", "a.jpg", "cat/1.png", "cat/deep/er/2.png", "dog/3.png", ".hidden/4.png"]
    return _write_files(root, names)


def test_folder_source_labels_modes_keep_or_name_the_root_images(tmp_path, caplog):
    """Labels "required" leave the root images out in one warning naming them; "optional" keeps
    them after the class images, label -1; "ignored" gives every image, none labelled; the
    order is deterministic (class by class, then the root's, each sorted)."""
    from ssl_vit.data.sources import FolderSource

    _nested_folder(tmp_path)
    classes = ["cat/1.png", "cat/deep/er/2.png", "dog/3.png"]
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data.sources"):
        required = FolderSource(tmp_path)
    assert required.files == classes and required.labels().tolist() == [0, 0, 1]
    assert "leaving out 2 images outside its class folders (no class: a.jpg, b.png)" in caplog.text
    caplog.clear()  # opened again (a training stream does on every visit): not named again
    with caplog.at_level(logging.WARNING, logger="ssl_vit.data.sources"):
        assert FolderSource(tmp_path).files == classes
    assert "leaving out" not in caplog.text
    optional = FolderSource(tmp_path, "optional")
    assert optional.files == classes + ["a.jpg", "b.png"]
    assert optional.labels().tolist() == [0, 0, 1, -1, -1]
    assert optional.label_names == ["cat", "dog"]
    ignored = FolderSource(tmp_path, "ignored")
    assert ignored.files == optional.files and ignored.label_names == []
    assert ignored.labels().tolist() == [-1] * 5
    assert [optional.name(r) for r in optional.iter_records()] == optional.files
    assert open_source(str(tmp_path), labels="ignored").files == optional.files


def test_make_shards_counts_the_images_beside_the_class_folders_as_skipped(tmp_path, caplog):
    """make-shards of a labelled folder with images at its root (and a deeper sub-folder):
    the class images are written with their labels, each root image is a skip counted in
    index.json and logged with its reason, never dropped unsaid."""
    files = _nested_folder(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        index = make_shards(tmp_path / "src", tmp_path / "out", progress=False, shard_size=2)
    assert index["label_names"] == ["cat", "dog"]
    assert index["num_samples"] == 3 and index["num_skipped"] == 2
    samples = _read_shards(tmp_path / "out")
    assert sorted(samples) == ["cat_1", "cat_deep_er_2", "dog_3"]
    assert samples["cat_deep_er_2"] == {"png": files["cat/deep/er/2.png"], "cls": b"0"}
    for name in ("a.jpg", "b.png"):
        assert f"skipping {tmp_path / 'src' / name}: outside the class folders" in caplog.text
