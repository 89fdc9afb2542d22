"""Every bad input is one line (issue 21, the input half): images of any mode decode to 8-bit
RGB, one pixel limit everywhere, class names compared before compute, bad labels and bad images
counted and skipped, every numeric config key range-checked, malformed YAML / study files /
shards named in one `error:` line."""

import dataclasses
import gzip
import io
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import pipeline
from PIL import Image

from ssl_vit.config import ConfigError, from_dict, load_config, to_dict
from ssl_vit.config.schema import FewshotConfig, FinetuneConfig, PretrainConfig
from ssl_vit.config.study import StudyConfig
from ssl_vit.data import decode_image, eval_loader
from ssl_vit.data.decode import MAX_PIXELS, _header_size
from ssl_vit.data.write.convert import make_shards
from ssl_vit.data.write.writer import ShardWriter
from ssl_vit.objectives.targets import mean_color_classes

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.image_size=16", "model.patch_size=4", "model.width=16", "model.depth=1"]
TINY += ["model.heads=2"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png16(pixels: np.ndarray) -> bytes:
    """A real 16-bit PNG (grey [H, W] or RGB [H, W, 3] uint16): Pillow cannot write 16-bit RGB."""
    h, w = pixels.shape[:2]
    color_type = 2 if pixels.ndim == 3 else 0
    rows = b"".join(b"\0" + pixels[y].astype(">u2").tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    body = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def huge_png(side: int = 20000) -> bytes:
    """A PNG whose header says side x side (8-bit grey): what a reader sees before decoding."""
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0"))


def encode(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def to8(v16: int) -> int:
    return round(v16 / 257)


# 16-bit levels whose 8-bit values are all different; PIL's own convert clips all but 0 to 255.
LEVELS16 = [0, 4112, 32896, 61680, 65535]


def test_16bit_png_scaled_not_clipped():
    grey = np.array([LEVELS16] * 2, dtype=np.uint16)  # [2, 5]
    via_pil = Image.fromarray(grey)
    assert via_pil.mode == "I;16"
    for data in (encode(via_pil), png16(grey)):
        out = decode_image(data)
        assert out.dtype == torch.uint8 and out.shape == (3, 2, 5)
        assert out[:, 0].tolist() == [[to8(v) for v in LEVELS16]] * 3
    rgb = np.zeros((3, 4, 3), dtype=np.uint16)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 65535, 32896, 4112
    out = decode_image(png16(rgb))
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 4)
    assert out[:, 1, 2].tolist() == [255, 128, 16]


def test_every_mode_decodes_to_8bit_rgb():
    grey16 = np.array([LEVELS16], dtype=np.uint16)
    expected_grey = [to8(v) for v in LEVELS16]
    cases = {
        "I (TIFF)": (Image.fromarray(grey16.astype(np.int32)), "TIFF", expected_grey),
        "F (TIFF)": (Image.fromarray((grey16 / 65535).astype(np.float32)), "TIFF", expected_grey),
        "LA": (Image.new("LA", (5, 1), (100, 7)), "PNG", [100] * 5),
        "P": (Image.new("RGB", (5, 1), (30, 60, 90)).convert("P"), "PNG", None),
        "RGBA": (Image.new("RGBA", (5, 1), (10, 20, 30, 0)), "PNG", None),
        "CMYK (JPEG)": (Image.new("CMYK", (5, 1), (10, 20, 30, 40)), "JPEG", None),
        "CMYK (TIFF)": (Image.new("CMYK", (5, 1), (10, 20, 30, 40)), "TIFF", None),
    }
    for name, (im, fmt, grey) in cases.items():
        data = encode(im, fmt)
        out = decode_image(data)
        assert out.dtype == torch.uint8 and out.shape == (3, 1, 5), name
        if grey is not None:
            assert out.tolist() == [[grey]] * 3, name
        else:  # PIL's own conversion (alpha dropped), as decoded from the same bytes
            ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
            assert np.abs(out.numpy().astype(int) - ref).max() <= 1, name


def test_header_size_matches_pil():
    rng = np.random.default_rng(0)
    for i in range(20):
        h, w = (int(v) for v in rng.integers(1, 70, size=2))
        im = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        for fmt, kw in (("PNG", {}), ("JPEG", {"progressive": bool(i % 2)})):
            buf = io.BytesIO()
            im.save(buf, format=fmt, **kw)
            assert _header_size(buf.getvalue()) == (w, h)
    assert _header_size(encode(im, "BMP")) is None


def test_pixel_limit_is_one_for_every_reader(tmp_path, caplog):
    side = int(MAX_PIXELS**0.5) + 1
    big = huge_png(side)
    with pytest.raises(ValueError, match=f"{side}x{side} image: more than {MAX_PIXELS} pixels"):
        decode_image(big)
    # An image folder (the eval and few-shot path) skips it, counted, the file named in the log.
    folder = tmp_path / "folder"
    (folder / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i, i, i)).save(folder / "a" / f"ok{i}.png")
    (folder / "a" / "huge.png").write_bytes(big)
    batches = list(eval_loader(str(folder), 8, 8, num_workers=0))
    assert sum(len(b.labels) for b in batches) == 3
    assert sum(b.skipped for b in batches) == 1
    assert str(folder / "a" / "huge.png") in caplog.text and "more than" in caplog.text
    # make-shards refuses the same file (counted), and its shards would skip it alike.
    index = make_shards(folder, tmp_path / "shards", progress=False)
    assert index["num_samples"] == 3 and index["num_skipped"] == 1


def _uniform_folder(root: Path, colours16: dict[str, list[tuple[int, int, int]]]) -> Path:
    """Class folders of 8x8 16-bit PNGs of one colour each (RGB, or grey if r == g == b)."""
    for cls, colours in colours16.items():
        (root / cls).mkdir(parents=True)
        for i, c in enumerate(colours):
            px = np.broadcast_to(np.array(c, dtype=np.uint16), (8, 8, 3))
            data = png16(px[..., 0].copy()) if len(set(c)) == 1 else png16(px.copy())
            (root / cls / f"{i}.png").write_bytes(data)
    return root


def test_pretraining_on_16bit_images_sees_their_colours(tmp_path):
    from ssl_vit.config.schema import PretrainDataConfig
    from ssl_vit.data import StreamArgs, pretrain_loader

    colours = {"a": [(v, 65535 - v, 32896) for v in LEVELS16], "b": [(v, v, v) for v in LEVELS16]}
    _uniform_folder(tmp_path / "img", colours)
    make_shards(tmp_path / "img", tmp_path / "shards", progress=False, shuffle_seed=None)
    data = PretrainDataConfig(train_shards=str(tmp_path / "shards"))
    batch = next(iter(pretrain_loader(data, StreamArgs(10, 0, 8))))
    assert batch.images.dtype == torch.uint8 and batch.skipped == 0
    expected = {
        f"{c}_{i}": [to8(v) for v in col] for c in colours for i, col in enumerate(colours[c])
    }
    for image, key in zip(batch.images, batch.keys, strict=True):
        # A uniform image stays uniform through any crop and flip: its exact 8-bit colour.
        assert image.flatten(1).unique(dim=1).T.tolist() == [expected[key]], key
        want = torch.tensor(expected[key], dtype=torch.uint8)[:, None, None].expand(3, 8, 8)
        assert torch.equal(mean_color_classes(image[None], 4), mean_color_classes(want[None], 4))


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def _folders(root: Path, classes: list[str], n: int = 3, size: int = 16) -> Path:
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (size, size), (40 * k, 20 * i, 100)).save(root / cls / f"{i}.png")
    return root


def test_fewshot_job_refuses_other_class_names_in_one_line(tmp_path):
    """In this process: the line is the SystemExit's message (a launched job prints it alone,
    test_fewshot_on_a_finetuned_classifier_is_one_line_naming_it)."""
    train = _folders(tmp_path / "train", ["a", "b"])
    test = _folders(tmp_path / "test", ["a", "c"])
    out = tmp_path / "out"
    args = ["--checkpoint", "random", *TINY, f"fewshot.train={train}", f"fewshot.eval={test}"]
    with pytest.raises(SystemExit) as stop:
        pipeline("fewshot")([*args, f"output_dir={out}"])
    assert str(stop.value) == (
        "error: fewshot.eval: label names differ from fewshot.train's "
        "(only in fewshot.train: ['b'], only in fewshot.eval: ['c'])"
    )
    assert not out.exists()


def _shards(out: Path, samples: list[tuple[bytes, int]], names: list[str]) -> Path:
    with ShardWriter(out, shard_size=len(samples)) as w:
        for i, (data, label) in enumerate(samples):
            w.write(f"s{i:03d}", "png", data, label)
        w.close(label_names=names, source="test")
    return out


def test_pretraining_monitor_class_names_and_bad_shards(tmp_path, synthetic_shards):
    main = pipeline("pretrain")
    base = ["--config", str(ROOT / "configs/pretrain/smoke.yaml"), *TINY, "train.steps=2"]
    base += [f"data.train_shards={synthetic_shards}", f"output_dir={tmp_path / 'run'}"]
    train = _folders(tmp_path / "ftrain", ["a", "b"])
    other = _folders(tmp_path / "feval", ["a", "c"])
    with pytest.raises(SystemExit, match=r"^error: fewshot.eval: label names differ from "):
        main([*base, f"fewshot.train={train}", f"fewshot.eval={other}"])
    # A zero-byte, random or empty .tar: named before compute.
    bad = tmp_path / "bad"
    bad.mkdir()
    garbage_gz = gzip.compress(b"not a tar" * 100)
    cases = [
        ("zero", b""),
        ("random", np.random.default_rng(0).bytes(3000)),
        ("empty", b"\0" * 1024),
    ]
    for name, content in [*cases, ("gz", garbage_gz)]:
        tar = bad / f"{name}.tar"
        tar.write_bytes(content)
        with pytest.raises(
            SystemExit,
            match=rf"^error: data.train_shards: shard {tar} is (not a readable|an empty) tar",
        ):
            main([*base[:-2], f"data.train_shards={tar}", f"output_dir={tmp_path / 'run'}"])
        with pytest.raises(SystemExit, match=rf"^error: fewshot.train: shard {tar} "):
            main([*base, f"fewshot.train={tar}", f"fewshot.eval={synthetic_shards}"])
    assert not (tmp_path / "run").exists()


def test_a_finetune_scores_an_eval_split_with_classes_it_has_no_images_of(tmp_path):
    """A few picked labels missed a class of the test split: the fine-tune trains on the classes
    it has and scores the test images of those (matched by name, as predict matches them),
    naming the classes left out; predict on the same split gives the same confusion matrix.
    Both refused it before ("label names differ"). Names on both sides that the other lacks
    are still a mismatch, in one line."""
    from ssl_vit.train.preflight import eval_label_map

    assert eval_label_map(["a", "b"], ["a", "b"]) is None
    assert eval_label_map(["b", "d"], ["a", "b", "c", "d"]) == (-1, 0, -1, 1)
    assert eval_label_map(["a", "b", "c"], ["c", "a"]) == (2, 0)  # a test split of fewer
    with pytest.raises(
        ConfigError, match=r"only in data.train: \['b'\], only in data.eval: \['c'\]"
    ):
        eval_label_map(["a", "b"], ["a", "c"])

    train = _folders(tmp_path / "train", ["b", "d"], n=4)
    test = _folders(tmp_path / "test", ["a", "b", "c", "d"], n=3)
    out = tmp_path / "ft"
    args = ["--config", str(ROOT / "configs/finetune/smoke.yaml"), *TINY, "train.steps=3"]
    args += [
        f"data.train={train}",
        f"data.eval={test}",
        f"output_dir={out}",
        "init.checkpoint=none",
    ]
    res = pipeline("finetune")(args)
    assert res["label_names"] == ["b", "d"] and res["eval_classes_left_out"] == ["a", "c"]
    assert sum(map(sum, res["confusion_matrix"])) == 6  # the 3 test images of b and of d
    pred = pipeline("predict")(
        ["--checkpoint", str(out), "--source", str(test), "--output", str(tmp_path / "p")]
    )
    assert (pred["images"], pred["confusion_matrix"]) == (12, res["confusion_matrix"])
    assert pred["top1"] == res["top1"] and pred["classes_left_out"] == ["a", "c"]
    from ssl_vit.report.classifier_section import classifier_section
    from ssl_vit.report.runs import load_runs

    captions = [c.caption for c in classifier_section(load_runs([tmp_path])).charts]
    assert len(captions) == 2 and all("6 scored, the classes a, c left out" in c for c in captions)
    other = _folders(tmp_path / "other", ["b", "e"])
    with pytest.raises(SystemExit, match="label names differ"):
        pipeline("finetune")([*args, f"data.eval={other}", f"output_dir={tmp_path / 'ft2'}"])
    one = _folders(tmp_path / "one", ["b"])  # it trained a 1-class "classifier" silently
    with pytest.raises(SystemExit, match=r"data.train='.*one': one class \('b'\); a classifier"):
        pipeline("finetune")([*args, f"data.train={one}", f"output_dir={tmp_path / 'ft3'}"])
    assert not (tmp_path / "ft2").exists() and not (tmp_path / "ft3").exists()


def test_a_finetunes_unreadable_test_images_are_counted_and_none_scored_is_no_top1(tmp_path, capfd):
    """data.eval with unreadable images: top-1 is over those scored, the skipped counted in
    results.json and warned; with none scored, top-1 is None ("not measured"), not the 0.0
    it reported before (and no count)."""
    train = _folders(tmp_path / "train", ["a", "b"], n=4)
    test = _folders(tmp_path / "test", ["a", "b"], n=2)
    for cls in ("a", "b"):
        (test / cls / "9.png").write_bytes(b"not a png")
    bad = tmp_path / "bad"
    for cls in ("a", "b"):
        (bad / cls).mkdir(parents=True)
        (bad / cls / "0.png").write_bytes(b"not a png")
    args = ["--config", str(ROOT / "configs/finetune/smoke.yaml"), *TINY, "train.steps=2"]
    args += [f"data.train={train}", "init.checkpoint=none", "data.num_workers=0"]
    some = pipeline("finetune")([*args, f"data.eval={test}", f"output_dir={tmp_path / 'ft'}"])
    assert some["eval_skipped"] == 2 and sum(map(sum, some["confusion_matrix"])) == 4
    assert some["top1"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    logged = capfd.readouterr().err  # the job logs to stderr
    assert f"data.eval={test}: 2 image(s) skipped (unreadable, " in logged
    assert "top-1 is over the 4 scored" in logged
    none = pipeline("finetune")([*args, f"data.eval={bad}", f"output_dir={tmp_path / 'ft2'}"])
    assert none["top1"] is None and none["eval_skipped"] == 2
    logged = capfd.readouterr().err
    assert f"data.eval={bad}: none of its images was scored (2 skipped: " in logged
    assert "top-1 not measured" in logged
    rows = (tmp_path / "ft2" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["top1"] is None
    from ssl_vit.cli import main as cli

    assert cli(["export", str(tmp_path / "ft2"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"No top-1 measured: none of the images of `{bad}` could be scored (2 skipped)" in card
    # Few-shot on the same test split: null accuracies (NaN in the job), said as such.
    few = ["--checkpoint", "random", *TINY, f"fewshot.train={train}", f"fewshot.eval={bad}"]
    few += ["fewshot.shots=[2]", "fewshot.seeds=[0]", f"output_dir={tmp_path / 'fs'}"]
    pipeline("fewshot")(few)
    saved = json.loads((tmp_path / "fs" / "results.json").read_text())
    assert (saved["2shot"], saved["num_test"], saved["skipped_eval"]) == (None, 0, 2)
    out = capfd.readouterr()
    assert "2-shot: l2=1024.0: not measured" in out.out and "nan" not in out.out
    assert "few-shot: 2-shot n/a (0 test images" in out.err
    assert f"fewshot.eval={bad}: none of its images was scored (2 skipped: " in out.err


def _fewshot_sources(tmp_path: Path) -> tuple[Path, Path]:
    """Train: a folder with one corrupt image in class a; eval: shards with one test label (7)
    outside the 2 classes."""
    train = _folders(tmp_path / "ftrain", ["a", "b"], n=4)
    (train / "a" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    good = [encode(Image.new("RGB", (16, 16), (60 * k, 0, 90))) for k in range(2)]
    test = _shards(tmp_path / "ftest", [(good[0], 0), (good[1], 1), (good[1], 7)], ["a", "b"])
    return train, test


def test_pretraining_monitor_survives_bad_images_and_labels(tmp_path, capfd):
    """Pretraining on 16-bit images only, its few-shot monitor on a train side with a corrupt
    image and a test side with an out-of-range label: the job ends with finite losses."""
    train, test = _fewshot_sources(tmp_path)
    _uniform_folder(tmp_path / "img16", {"a": [(v, v // 2, 65535 - v) for v in LEVELS16]})
    make_shards(tmp_path / "img16", tmp_path / "shards16", progress=False)
    main = pipeline("pretrain")
    res = main(
        [
            *("--config", str(ROOT / "configs/pretrain/smoke.yaml"), *TINY, "train.steps=2"),
            *(f"data.train_shards={tmp_path / 'shards16'}", f"output_dir={tmp_path / 'run'}"),
            *(f"fewshot.train={train}", f"fewshot.eval={test}", "fewshot.num_workers=0"),
            *("fewshot.shots=[4]", "fewshot.seeds=[0]"),
        ]
    )
    assert math.isfinite(res["loss"]) and res["skipped_samples"] == 0
    few = res["fewshot"]
    assert (few["skipped_train"], few["skipped_train_labels"], few["skipped_eval"]) == (1, 0, 1)
    assert few["num_train_features"] == 7 and few["num_test"] == 2
    logged = capfd.readouterr().err  # the job logs to stderr
    reason = "UnidentifiedImageError: cannot identify image file (1 skipped by this worker)"
    assert f"skipping sample a_1 in {train / 'a' / '1.png'}: {reason}" in logged  # by a worker
    assert "label 7 out of range [0, 2)" in logged


def test_fewshot_train_labels_out_of_range_are_counted_skips(tmp_path, caplog):
    from ssl_vit.eval.fewshot_job import fewshot_evaluate
    from ssl_vit.model import build_vit

    img = [encode(Image.new("RGB", (16, 16), (60 * k, 0, 90))) for k in range(2)]
    samples = [(img[0], 0), (img[1], 1), (img[0], 0), (img[1], 5), (img[1], 1), (img[0], -3)]
    train = _shards(tmp_path / "train", samples, ["a", "b"])
    test = _shards(tmp_path / "test", samples[:3], ["a", "b"])
    overrides = [*TINY, f"fewshot.train={train}", f"fewshot.eval={test}", "fewshot.num_workers=0"]
    # each class has 2 samples with a valid label
    overrides += ["fewshot.shots=[2]", "fewshot.seeds=[0, 1]"]
    cfg = load_config(FewshotConfig, None, overrides)
    norm = dict(image_size=16, mean=(0.5,) * 3, std=(0.5,) * 3)
    res = fewshot_evaluate(build_vit(cfg.model), cfg.fewshot, **norm)
    assert res["skipped_train_labels"] == 2 and res["num_train_features"] == 4
    assert res["skipped_eval"] == 0 and res["num_test"] == 3
    assert "skipping 2 samples labelled outside [0, 2)" in caplog.text


def test_finetune_stream_skips_out_of_range_labels(tmp_path, caplog):
    from ssl_vit.config.schema import FinetuneDataConfig
    from ssl_vit.data import StreamArgs, train_loader

    img = encode(Image.new("RGB", (16, 16), (9, 9, 9)))
    shards = _shards(tmp_path / "s", [(img, 0), (img, 2), (img, 1), (img, -1)], ["a", "b"])
    data = FinetuneDataConfig(train=str(shards), shuffle_buffer=1)
    batches = iter(train_loader(data, StreamArgs(2, 0, 16), num_classes=2))
    first, second = next(batches), next(batches)  # epoch 1, then epoch 2's first batch
    # Skips are reported with the next batch sent: s001 (2) with the first, s003 (-1) and
    # epoch 2's s001 with the second.
    assert first.labels.tolist() == [0, 1] and first.skipped == 1
    assert second.labels.tolist() == [0, 1] and second.skipped == 2
    assert (
        "label 2 out of range [0, 2)" in caplog.text and f"{shards}/shard-000000.tar" in caplog.text
    )


def test_self_training_reads_every_unlabelled_image_of_a_folder(tmp_path):
    """distill.unlabelled as an image folder with class folders and images beside them: the
    unlabelled stream reads all of them (issue 47 #5 in another job: none dropped)."""
    from ssl_vit.config.schema import FinetuneDataConfig
    from ssl_vit.data import StreamArgs, train_loader

    folder = tmp_path / "photos"
    for i, sub in enumerate(["a", "a", "b", ".", "."]):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (50 * i, 9, 9)).save(folder / sub / f"{i}.png")
    data = FinetuneDataConfig(train=str(tmp_path / "unused"), shuffle_buffer=1)
    batch = next(iter(train_loader(data, StreamArgs(5, 0, 16), source=str(folder))))
    reds = sorted(round(float(r) / 50) for r in batch.images[:, 0].float().mean(dim=(1, 2)))
    assert reds == [0, 1, 2, 3, 4] and batch.skipped == 0  # one epoch: each image once


def test_a_folder_smaller_than_the_batch_gets_fewer_lanes(tmp_path):
    """A label budget's few images (12) under a micro-batch of 32: auto lanes stop at one per
    image (8, the largest divisor of 32 up to 12), and the first micro-batch holds every image;
    more lanes than images, asked for, is one line naming the fix."""
    from ssl_vit.config.schema import FinetuneDataConfig
    from ssl_vit.data import StreamArgs, train_loader

    folder = tmp_path / "to-label"
    for i in range(12):
        (folder / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (20 * i, 9, 9)).save(folder / "ab"[i % 2] / f"{i}.png")
    data = FinetuneDataConfig(train=str(folder), shuffle_buffer=1)
    loader = train_loader(data, StreamArgs(32, 0, 16), num_classes=2)
    assert loader.tracker.lanes == 8
    batch = next(iter(loader))
    reds = [round(float(r) / 20) for r in batch.images[:, 0].float().mean(dim=(1, 2))]
    # Each lane reads all of its share of the first epoch (1 or 2 images) within its 4.
    assert len(reds) == 32 and set(reds) == set(range(12))
    with pytest.raises(ConfigError, match=r"12 samples < 16 lanes .*set data.lanes to at most 12"):
        train_loader(dataclasses.replace(data, lanes=16), StreamArgs(32, 0, 16), num_classes=2)


# Each bad value and the start of its one-line error; every numeric key is range-checked.
BAD_CONFIGS = [
    (
        PretrainConfig,
        "objective.mask_ratio=0.001",
        "objective.mask_ratio: 0.001 x 16 patches corrupts none",
    ),
    (PretrainConfig, "model.width=0", "model.width: must be > 0, got 0"),
    (PretrainConfig, "model.depth=-1", "model.depth: must be > 0"),
    (PretrainConfig, "model.heads=0", "model.heads: must be > 0"),
    (PretrainConfig, "model.patch_size=0", "model.patch_size: must be > 0"),
    (PretrainConfig, "model.mlp_ratio=0", "model.mlp_ratio: must be > 0"),
    (PretrainConfig, "model.width=30", "model.width (30) must be divisible by model.heads (4)"),
    (PretrainConfig, "model.image_size=0", "model.image_size: must be > 0"),
    (PretrainConfig, "data.crop_scale=[2,-1]", "data.crop_scale: need 0 < low <= high <= 1"),
    (PretrainConfig, "data.crop_scale=[0.9,0.5]", "data.crop_scale: need 0 < low <= high <= 1"),
    (PretrainConfig, "data.std=[0,0,0]", "data.std: every value must be > 0"),
    (PretrainConfig, "data.shuffle_buffer=-1", "data.shuffle_buffer: must be >= 0"),
    (PretrainConfig, "train.lr=inf", "train.lr: must be a finite number, got 'inf'"),
    (PretrainConfig, "train.lr=.nan", "train.lr: must be a finite number"),
    (PretrainConfig, "train.lr=0", "train.lr: must be > 0"),
    (PretrainConfig, "train.min_lr=1", "train.min_lr (1.0) must be <= train.lr"),
    (PretrainConfig, "train.weight_decay=-0.1", "train.weight_decay: must be >= 0"),
    (PretrainConfig, "train.grad_clip=-1", "train.grad_clip: must be >= 0"),
    (PretrainConfig, "train.betas=[0.9,1.0]", "train.betas[1]: must be in [0, 1)"),
    (FinetuneConfig, "train.momentum=1.5", "train.momentum: must be in [0, 1)"),
    (PretrainConfig, "train.keep_checkpoints=0", "train.keep_checkpoints: must be >= 1"),
    (PretrainConfig, "train.warmup_steps=-1", "train.warmup_steps: must be >= 0"),
    (PretrainConfig, "fewshot.shots=[-1]", "fewshot.shots: expected distinct counts >= 1"),
    (PretrainConfig, "fewshot.seeds=[]", "fewshot.seeds: an empty list"),
    (PretrainConfig, "fewshot.l2_reg=[0.0]", "fewshot.l2_reg: every value must be > 0"),
    (PretrainConfig, "fewshot.every=-5", "fewshot.every: must be >= 0"),
    (FewshotConfig, "fewshot.shots=[0, 5]", "fewshot.shots: expected distinct counts >= 1"),
    (FewshotConfig, "fewshot.shots=[0, 5]", "fewshot.shots: expected distinct counts >= 1"),
    (FewshotConfig, "fewshot.seeds=[]", "fewshot.seeds: an empty list"),
    (FewshotConfig, "fewshot.seeds=[-1]", "fewshot.seeds: every value must be >= 0"),
    (FewshotConfig, "fewshot.l2_reg=[-1.0]", "fewshot.l2_reg: every value must be > 0"),
    (FewshotConfig, "data.std=[1,0,1]", "data.std: every value must be > 0"),
    (FewshotConfig, "fewshot.batch_size=0", "fewshot.batch_size: must be >= 1"),
    (FewshotConfig, "fewshot.every=5", "fewshot.every: pretraining only"),
    (FewshotConfig, "fewshot.layers=[]", "fewshot.layers: an empty list"),
    (PretrainConfig, "timeouts.stop_s=0", "timeouts.stop_s: must be > 0"),
    (FinetuneConfig, "data.crop_scale=[0,1]", "data.crop_scale: need 0 < low <= high <= 1"),
    (FinetuneConfig, "data.max_eval=-1", "data.max_eval: must be >= 0"),
    (FinetuneConfig, "ema=1.0", "ema: must be in [0, 1)"),
    (FinetuneConfig, "eval_every=-1", "eval_every: must be >= 0"),
    (FinetuneConfig, "model.width=[1,", "override 'model.width=[1,': malformed YAML at line 1"),
]
REQUIRED = {
    PretrainConfig: ["data.train_shards=x"],
    FewshotConfig: ["fewshot.train=x", "fewshot.eval=y"],
    FinetuneConfig: ["data.train=x"],
}


@pytest.mark.parametrize(("schema", "override", "message"), BAD_CONFIGS)
def test_bad_config_values_are_one_line_naming_the_key(schema, override, message):
    base = [*TINY, "model.heads=4", *REQUIRED[schema]]
    with pytest.raises(ConfigError) as err:
        load_config(schema, None, [*base, override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


SHIPPED = {
    "pretrain": PretrainConfig,
    "finetune": FinetuneConfig,
    "fewshot": FewshotConfig,
    "study": StudyConfig,
}


def test_shipped_configs_still_load():
    """Every config shipped for a pipeline loads and validates into its schema, and is what it
    loads: written out (as config.yaml records it) and read back, the same config. No folder is
    passed over: configs/accelerate/ is accelerate's own format, every other one has a schema."""
    paths = sorted((ROOT / "configs").glob("*/*.yaml"))
    assert {p.parent.name for p in paths} == {*SHIPPED, "accelerate"}
    checked = set()
    for path in paths:
        schema = SHIPPED.get(path.parent.name)
        if schema is None:
            continue
        cfg = load_config(schema, path)
        assert isinstance(cfg, schema), path
        assert from_dict(schema, to_dict(cfg)) == cfg, path
        checked.add(path.parent.name)
    assert checked == set(SHIPPED)  # at least one config of each kind


def test_fp16_on_a_cpu_is_refused():
    from ssl_vit.train.runtime import resolve_mixed_precision

    if torch.cuda.is_available():
        pytest.skip("has a GPU: fp16 runs")
    with pytest.raises(ConfigError, match=r"^train.mixed_precision=fp16: needs a CUDA GPU"):
        resolve_mixed_precision("fp16")
    assert resolve_mixed_precision("no") == "no"


def test_malformed_yaml_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {width: 32\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: malformed YAML at line \d+, column \d+: "):
        load_config(PretrainConfig, bad)
    with pytest.raises(SystemExit, match=rf"^error: {bad}: malformed YAML at line 2, column 6: "):
        pipeline("pretrain")(["--config", str(bad), f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


def study(argv: list[str]):
    import importlib.util

    spec = importlib.util.spec_from_file_location("study_script", ROOT / "scripts" / "study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["study_script"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("variants: [{name: ok}\n", "malformed YAML at line"),
        ("variants: 3\n", "variants: expected a list"),
        ("variants: [{name: ../../x}]\n", "variants: name '../../x' must be a simple name"),
        ("variants: [{name: a/b}]\n", "variants: name 'a/b' must be a simple name"),
        (
            "variants: [{name: a}]\nquick: {pretrain: [steps]}\n",
            "pretrain: override 'steps' is not",
        ),
        ("variants: [{name: a}]\nquick: {finetune_image_size: -8}\n", "finetune_image_size, "),
    ],
)
def test_bad_study_files_are_one_line_and_write_nothing(tmp_path, text, message):
    path = tmp_path / "study.yaml"
    out = tmp_path / "out" / "study"
    path.write_text(f"data: {{train: a, eval: b}}\nfull: {{output_dir: {out}}}\n{text}")
    with pytest.raises(SystemExit) as err:
        study(["--config", str(path)])
    assert str(err.value).startswith("error: ") and message in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_hf_dataset_16bit_huge_and_unlabelled_rows(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")
    grey = np.full((8, 8), 32896, dtype=np.uint16)
    rows = [(png16(grey), 0), (huge_png(), 1), (encode(Image.new("RGB", (8, 8))), -1)]
    features = datasets.Features(
        {"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b"])}
    )
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": b, "path": None} for b, _ in rows], "y": [y for _, y in rows]},
        features=features,
    )
    ds.save_to_disk(tmp_path / "hf")
    batches = list(eval_loader(str(tmp_path / "hf"), 4, 8, num_workers=0, num_classes=2))
    assert sum(b.skipped for b in batches) == 2
    (image,) = torch.cat([b.images for b in batches])
    assert image.unique().tolist() == [128]  # 32896 / 257
    assert f"{tmp_path / 'hf'} row 1" in caplog.text and "more than" in caplog.text
    assert "label -1 out of range [0, 2)" in caplog.text


# --------------------------------------------------------------------------------------------
# Issue 29, the second campaign: absurd aspect ratios, FIFOs and devices, null HF images, two
# image columns, a user's shard-notes.txt, duplicated YAML keys, alias bombs, an MLP of nothing.


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (8-bit grey), as `huge_png`: ~60 bytes."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0"))


def test_absurd_aspect_ratio_is_refused_before_decoding():
    from ssl_vit.data.decode import MAX_ASPECT

    # The 1 x 2,000,000 PNG: refused from its header, no pixel decoded (evaluation would
    # have resized it to 224 x 448 M pixels, 18 GB).
    with pytest.raises(ValueError, match="^1x2000000 image: aspect ratio beyond 100:1"):
        decode_image(png_header(1, 2_000_000))
    for size, fmt in (((1000, 2), "PNG"), ((2, 1000), "BMP"), ((1000, 2), "JPEG")):
        with pytest.raises(ValueError, match=f"^{size[0]}x{size[1]} image: aspect ratio"):
            decode_image(encode(Image.new("RGB", size), fmt))  # torchvision's path and PIL's
    assert MAX_ASPECT == 100
    assert decode_image(encode(Image.new("RGB", (200, 2)))).shape == (3, 2, 200)  # 100:1 is ok
    with pytest.raises(ValueError, match="^0x5 image: no pixels"):
        decode_image(png_header(0, 5))


def test_absurd_aspect_ratio_is_a_counted_skip_everywhere(tmp_path, caplog):
    """An eval folder, pretraining with `data.augment=device` (workers resize the shorter side)
    and make-shards each skip a 1000 x 2 image, counted and named: the memory bound is that no
    such image reaches a resize (a resized image is at most 100 x S^2 pixels)."""
    from ssl_vit.config.schema import PretrainDataConfig
    from ssl_vit.data import StreamArgs, pretrain_loader

    long = encode(Image.new("RGB", (1000, 2), (9, 9, 9)))
    folder = _folders(tmp_path / "folder", ["a"], n=3, size=8)
    (folder / "a" / "long.png").write_bytes(long)
    batches = list(eval_loader(str(folder), 8, 8, num_workers=0))
    assert sum(len(b.labels) for b in batches) == 3 and sum(b.skipped for b in batches) == 1
    assert str(folder / "a" / "long.png") in caplog.text and "aspect ratio beyond" in caplog.text

    index = make_shards(folder, tmp_path / "made", progress=False)
    assert index["num_samples"] == 3 and index["num_skipped"] == 1

    good = [encode(Image.new("RGB", (8, 8), (k, 0, 0))) for k in range(3)]
    shards = _shards(tmp_path / "shards", [(d, 0) for d in good] + [(long, 0)], ["a"])
    data = PretrainDataConfig(train_shards=str(shards), shuffle_buffer=1)
    loader = iter(pretrain_loader(data, StreamArgs(3, 0, 8, load_size=8)))
    first = [next(loader) for _ in range(2)]  # 6 good images: the whole first epoch read
    assert all(b.images.shape == (3, 3, 8, 8) for b in first)
    assert sum(b.skipped for b in first) >= 1


_READ_FOLDER = """
import json, sys
from ssl_vit.data import eval_loader
from ssl_vit.data.write.convert import make_shards
folder, out = sys.argv[1:]
index = make_shards(folder, out, progress=False)
batches = list(eval_loader(folder, 8, 8, num_workers=0))
print(json.dumps([index["num_samples"], index["num_skipped"], sum(len(b.labels) for b in batches),
                  sum(b.skipped for b in batches)]))
"""


@pytest.mark.system
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_and_device_in_a_class_folder_are_counted_skips(tmp_path):
    """A FIFO named zz.png and a symlink to /dev/zero: make-shards and the eval loader neither
    wait (the FIFO has no writer) nor read without end; a symlink to a regular file is read.
    In a subprocess with a timeout, so a regression fails instead of hanging the suite."""
    folder = _folders(tmp_path / "folder", ["a"], n=2, size=8)
    os.mkfifo(folder / "a" / "zz.png")
    os.symlink("/dev/zero", folder / "a" / "zero.png")
    os.symlink(folder / "a" / "0.png", folder / "a" / "link.png")  # followed: a regular file
    proc = subprocess.run(
        [sys.executable, "-c", _READ_FOLDER, str(folder), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[3, 2, 3, 2]"
    assert f"cannot read {folder / 'a' / 'zz.png'}: not a regular file (a FIFO)" in proc.stderr
    assert "zero.png: not a regular file (a character device)" in proc.stderr


def test_image_file_size_cap(tmp_path, monkeypatch):
    from ssl_vit.data import decode
    from ssl_vit.data.sources import FolderSource

    folder = _folders(tmp_path / "folder", ["a"], n=2, size=8)
    size = (folder / "a" / "0.png").stat().st_size
    monkeypatch.setattr(decode, "MAX_FILE_BYTES", size - 1)
    with pytest.raises(OSError, match=f"^{size} bytes: more than {size - 1}"):
        decode.read_image_file(folder / "a" / "0.png")
    assert FolderSource(folder)[0].data == b""  # logged; every consumer skips empty data


def test_hf_null_image_row_is_a_counted_skip(tmp_path, caplog):
    from ssl_vit.eval.fewshot_job import _subset_batches

    datasets = pytest.importorskip("datasets")
    png = encode(Image.new("RGB", (8, 8), (1, 2, 3)))
    features = datasets.Features(
        {"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b"])}
    )
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": png, "path": None}, None, {"bytes": png, "path": None}], "y": [0, 1, 1]},
        features=features,
    )
    ds.save_to_disk(tmp_path / "hf")
    index = make_shards(tmp_path / "hf", tmp_path / "shards", progress=False)
    assert index["num_samples"] == 2 and index["num_skipped"] == 1
    batches = list(eval_loader(str(tmp_path / "hf"), 4, 8, num_workers=0))
    assert sum(len(b.labels) for b in batches) == 2 and sum(b.skipped for b in batches) == 1
    kept: list[int] = []  # few-shot's train side
    (x, y), *rest = _subset_batches(str(tmp_path / "hf"), np.arange(3), 8, 4, 0, kept)
    assert not rest and x.shape == (2, 3, 8, 8) and kept == [0, 2] and y.tolist() == [0, 1]
    assert f"{tmp_path / 'hf'} row 1: the image is null" in caplog.text


def test_hf_dataset_with_two_image_columns_is_one_line(tmp_path):
    from ssl_vit.data.sources import open_source

    datasets = pytest.importorskip("datasets")
    png = {"bytes": encode(Image.new("RGB", (8, 8))), "path": None}
    features = datasets.Features({"mask": datasets.Image(), "image": datasets.Image()})
    datasets.Dataset.from_dict({"mask": [png], "image": [png]}, features=features).save_to_disk(
        tmp_path / "hf"
    )
    message = r"2 Image columns \(mask, image\); keep the one to read"
    with pytest.raises(ValueError, match=message) as err:
        open_source(str(tmp_path / "hf"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=message):
        make_shards(tmp_path / "hf", tmp_path / "shards", progress=False)
    assert not (tmp_path / "shards").exists()


def test_make_shards_keeps_files_that_only_look_like_shards(tmp_path):
    folder = _folders(tmp_path / "folder", ["a"], n=2, size=8)
    out = tmp_path / "out"
    out.mkdir()
    keep = {"shard-notes.txt": "my notes", "shard-000001.tar.bak": "backup", "README": "hi"}
    for name, text in keep.items():
        (out / name).write_text(text)
    (out / "shard-000007.tar").write_text("an old shard")  # the writer's own name
    # Issue 47: a folder holding files of the user's is refused, never copied and swapped.
    with pytest.raises(ValueError, match=r"holds README, shard-000001\.tar\.bak, shard-notes"):
        make_shards(folder, out, progress=False, overwrite=True)
    assert {n: (out / n).read_text() for n in keep} == keep
    assert sorted(p.name for p in out.iterdir()) == sorted([*keep, "shard-000007.tar"])


def test_yaml_key_given_twice_is_one_line_naming_it(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 3\nmodel:\n  width: 32\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, path)
    assert str(err.value) == (
        f"{path}, line 5, column 1: key 'train' given twice (YAML would keep only the last)"
    )
    with pytest.raises(ConfigError, match="key 'steps' given twice"):  # nested, and overrides
        load_config(PretrainConfig, None, ["train={steps: 1, steps: 2}"])


def test_yaml_alias_bomb_is_one_short_line(tmp_path):
    """9^5 values from ~300 bytes (the issue's 438 bytes made 9^9: a 400 MB error line); a
    few aliases, as the shipped study config uses, still load."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcd", "bcde", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\ntrain: {steps: *e}\n")
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, path)
    assert str(err.value) == (
        f"{path}, line 5, column 4: YAML aliases expand to more than 10000 values"
    )
    path.write_text("a: &a [1]\nb: &b [*b]\n")
    with pytest.raises(ConfigError, match="line 2, column 4: a recursive YAML alias"):
        load_config(PretrainConfig, path)
    path.write_text("train: &t {steps: 7}\n")  # an anchor and no alias: fine
    assert load_config(PretrainConfig, path, [*TINY, "data.train_shards=x"]).train.steps == 7


def test_mlp_without_hidden_units_is_refused_naming_the_key():
    tiny = [*TINY, "data.train_shards=x"]
    with pytest.raises(ConfigError) as err:
        load_config(PretrainConfig, None, [*tiny, "model.mlp_ratio=0.01"])
    assert str(err.value) == (
        "model.mlp_ratio: 0.01 x model.width 16 leaves the MLP no hidden unit "
        "(need int(width * mlp_ratio) >= 1)"
    )
    cfg = load_config(PretrainConfig, None, [*tiny, "model.mlp_ratio=0.0625"])
    assert int(cfg.model.width * cfg.model.mlp_ratio) == 1


@pytest.mark.system
def test_missing_tracker_package_is_one_line_before_the_run_dir(tmp_path, synthetic_shards):
    """Issue 29 #14: the tracker's package is checked before config.yaml is written."""
    import importlib.util

    if importlib.util.find_spec("comet_ml") is not None:
        pytest.skip("comet_ml is installed here")
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs/pretrain/smoke.yaml"), f"output_dir={out}"]
    args += [f"data.train_shards={synthetic_shards}", "trackers=[comet_ml]"]
    proc = _run("pretrain.py", *args, cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "trackers" in last and "comet_ml" in last and "not installed" in last
    assert not (out / "config.yaml").exists()


def _fewshot_args(tmp_path: Path, checkpoint: str, eval_spec: str | None = None) -> list[str]:
    train = _folders(tmp_path / "train", ["a", "b"])
    spec = eval_spec or str(_folders(tmp_path / "test", ["a", "b"]))
    return ["--checkpoint", checkpoint, *TINY, f"fewshot.train={train}", f"fewshot.eval={spec}"]


@pytest.mark.system
def test_fewshot_on_a_finetuned_classifier_is_one_line_naming_it(tmp_path):
    """Issue 29 #15: a fine-tune's model.safetensors is not an encoder: one line, not
    KeyError 'pos_embed'."""
    from ssl_vit.model import Classifier, build_vit
    from ssl_vit.train.classifier_file import ClassifierSpec, save_classifier

    cfg = from_dict(PretrainConfig, {"data": {"train_shards": "x"}, "model": {}}).model
    for kv in TINY:
        key, value = kv.split("=")
        setattr(cfg, key.split(".")[1], int(value))
    weights = tmp_path / "ft" / "model.safetensors"
    weights.parent.mkdir()
    model = Classifier(build_vit(cfg), 2, "cls")
    spec = ClassifierSpec(to_dict(cfg), "cls", ("a", "b"), (0.5,) * 3, (0.5,) * 3)
    save_classifier(model, weights, spec)
    out = tmp_path / "out"
    proc = _run(
        "fewshot.py", *_fewshot_args(tmp_path, str(weights)), f"output_dir={out}", cwd=tmp_path
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{weights} is a fine-tuned classifier (model.safetensors), not an encoder" in last, last
    assert not out.exists()


@pytest.mark.system
def test_fewshot_on_an_offline_hub_dataset_is_one_line_naming_the_key(tmp_path):
    out = tmp_path / "out"
    args = _fewshot_args(tmp_path, "random", "hf://no-such-user/no-such-set:test")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pipelines" / "fewshot.py"), *args, f"output_dir={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("error: fewshot.eval='hf://no-such-user/no-such-set:test': "), last
    assert "cannot reach the Hugging Face Hub (offline?)" in last, last


def test_import_of_a_pickle_or_a_malformed_config_json_is_one_line(tmp_path, capsys):
    import pickle

    from ssl_vit.cli import main as cli

    pickle.dump({"w": Path("x")}, (tmp_path / "weights.pkl").open("wb"))  # a class: refused
    assert cli(["import", str(tmp_path / "weights.pkl"), str(tmp_path / "o1")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ssl-vit import: error: {tmp_path / 'weights.pkl'}: a pickle file; only safetensors "
        "and weights-only torch files (tensors in plain containers) are read"
    ]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "vit",')
    torch.save({}, tmp_path / "hf" / "pytorch_model.bin")
    assert cli(["import", str(tmp_path / "hf"), str(tmp_path / "o2")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"ssl-vit import: error: {tmp_path / 'hf' / 'config.json'}: not valid JSON ("
    ), err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.system
def test_a_source_of_no_images_ends_the_job_in_one_line_whichever_process_reads_it(tmp_path):
    """Every sample unreadable: the stream stops after `max_consecutive_failures` in a row
    rather than spin, and its error is the job's one line, no traceback, exit 1, the same
    whether the job's process read it or a loader worker (which DataLoader re-raises with the
    worker's traceback in the message: before, the line said only "Caught RuntimeError in
    DataLoader worker process 0." after the traceback)."""
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "bad.tar"), encoder=False) as w:
        for i in range(20):
            w.write({"__key__": f"k{i:02d}", "png": b"not a png"})
    lines = []
    for workers in (0, 1):
        proc = _run(
            "pretrain.py",
            *("--config", str(ROOT / "configs/pretrain/smoke.yaml"), *TINY, "train.steps=2"),
            *(f"data.train_shards={tmp_path / 'bad.tar'}", f"data.num_workers={workers}"),
            f"output_dir={tmp_path / f'run{workers}'}",
            cwd=tmp_path,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines.append(proc.stderr.strip().splitlines()[-1])
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(
        "error: InputError: 1000 samples in a row failed to decode (last: k"
    ) and lines[0].endswith(
        f" in {tmp_path / 'bad.tar'}: UnidentifiedImageError: cannot identify image file); is "
        "the data corrupt or not images? (last good checkpoint: none)"
    ), lines[0]


def test_a_test_split_that_is_the_training_source_is_warned(tmp_path, caplog, capfd, monkeypatch):
    """The source a job scores on is the one it trains on, holds it or is held in it (a folder
    and a shard of it, whatever the spelling of the path): a warning naming both keys and what
    the figure then is; siblings, other folders and other remote specs are not warned."""
    from ssl_vit.train.preflight import warn_shared

    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "train-more").mkdir()
    (tmp_path / "data" / "train" / "shard-000001.tar").touch()  # the sources a job has checked
    monkeypatch.chdir(tmp_path)
    shared = [
        ("data/train", "./data/train/"),
        ("data/train", str(tmp_path / "data" / "train")),
        ("data/train", "data/train/shard-{000000..000003}.tar"),
        ("data/train/shard-000001.tar", "data"),
        ("pipe:curl -s u/a.tar", " pipe:curl -s u/a.tar"),
    ]
    apart = [("data/train", "data/train-more"), ("pipe:curl -s u/a.tar", "pipe:curl -s u/b.tar")]
    for reads, scores in shared + apart:
        caplog.clear()
        warn_shared(
            ("data.train", reads), ("data.eval", scores), "top-1 counts images it trains on"
        )
        want = [] if (reads, scores) in apart else [
            f"data.eval={scores} is data.train={reads} or shares its images: top-1 counts "
            "images it trains on"
        ]  # fmt: skip
        assert [r.getMessage() for r in caplog.records] == want, (reads, scores)
    # The jobs that score: fine-tune (data.train, distill.unlabelled) and few-shot.
    imgs = str(_folders(tmp_path / "imgs", ["a", "b"], n=4))
    args = ["--config", str(ROOT / "configs/finetune/smoke.yaml"), *TINY, "train.steps=1"]
    args += [f"data.train={imgs}", f"data.eval={imgs}/", "init.checkpoint=none"]
    args += ["train.batch_size=4"]
    online = ["distill.mode=online", f"distill.unlabelled={imgs}", "distill.momentum=0.5"]
    pipeline("finetune")([*args, *online, f"output_dir={tmp_path / 'ft'}"])
    few = ["--checkpoint", "random", *TINY, f"fewshot.train={imgs}", f"fewshot.eval={imgs}"]
    pipeline("fewshot")([*few, "fewshot.shots=[1]", f"output_dir={tmp_path / 'fs'}"])
    pred = ["--checkpoint", str(tmp_path / "ft"), "--source", imgs]
    pipeline("predict")([*pred, "--output", str(tmp_path / "p")])
    logged = capfd.readouterr().err
    assert f"--source {imgs} is the classifier's data.train={imgs} or shares its images" in logged
    assert f"data.eval={imgs}/ is data.train={imgs} or shares its images: top-1 counts" in logged
    assert (
        f"data.eval={imgs}/ is distill.unlabelled={imgs} or shares its images: its test " in logged
    )
    assert (
        f"fewshot.eval={imgs} is fewshot.train={imgs} or shares its images: the accuracies "
        in logged
    )
