"""make-synthetic --kind photos (ssl_vit/datasets/photos.py): ImageNet-like JPEGs from the
photographs scikit-image ships, deterministic per (seed, i), as shards or an image folder."""

import io
import json

import pytest
from PIL import Image

from ssl_vit.cli import main as cli

pytest.importorskip("skimage")
from ssl_vit.datasets.photos import PHOTO_NAMES, load_photos, photo_views  # noqa: E402


@pytest.fixture(scope="module")
def photos():
    return load_photos()


def test_photo_views_are_imagenet_like_and_deterministic(photos):
    views = list(photo_views(12, seed=3, photos=photos))
    assert [k for k, _, _ in views] == [f"{i:08d}_{PHOTO_NAMES[i % 9]}" for i in range(12)]
    assert [label for _, _, label in views] == [i % 9 for i in range(12)]
    for _, data, _ in views:
        im = Image.open(io.BytesIO(data))
        assert im.format == "JPEG" and im.mode == "RGB"
        assert 200 <= max(im.size) <= 1000 and min(im.size) >= 100  # aspects 16:9 .. 9:16
    # Sample i depends on (seed, i) only: the first 5 of 12 are the 5 of a shorter run.
    assert list(photo_views(5, seed=3, photos=photos)) == views[:5]
    assert list(photo_views(2, seed=4, photos=photos))[1][1] != views[1][1]


def test_cli_make_synthetic_photos_shards_and_folder(tmp_path, capsys):
    out = tmp_path / "shards"
    assert cli(["make-synthetic", "--kind", "photos", "--output", str(out), "--num", "5"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 5 and index["label_names"] == PHOTO_NAMES
    folder = tmp_path / "folder"
    args = ["make-synthetic", "--kind", "photos", "--folder", "--output", str(folder)]
    assert cli([*args, "--num", "5"]) == 0
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jpg"))
    assert files == sorted(f"{PHOTO_NAMES[i]}/{i:08d}_{PHOTO_NAMES[i]}.jpg" for i in range(5))
    assert "5 ImageNet-like JPEG photos" in capsys.readouterr().out
    assert cli(["make-synthetic", "--folder", "--output", str(tmp_path / "x")]) == 1


def test_decode_benchmark_runs(tmp_path, capsys, monkeypatch):
    """scripts/bench_decode.py on 4 photos: one JSON line with the per-image milliseconds."""
    import importlib.util
    import sys
    from pathlib import Path

    assert (
        cli(
            [
                "make-synthetic",
                "--kind",
                "photos",
                "--folder",
                "--output",
                str(tmp_path),
                "--num",
                "4",
            ]
        )
        == 0
    )
    script = Path(__file__).resolve().parents[1] / "scripts/bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["x", "--folder", str(tmp_path), "--repeats", "1"])
    bench.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["images"] == 4 and out["decode"] > 0 and out["decode + crop"] > 0
