"""`ssl-vit select`: which images to label. TypiClust picks each cluster's densest image and
never an outlier; every method is a function of the features and the seed, keeps the earlier
picks of a smaller budget, and (through the job) of the images only: not of their order,
class folders, loader workers or process count. Unreadable images are named, counted skips."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, pipeline, record_timeouts
from PIL import Image

from ssl_vit.data.predict_stream import predict_loader
from ssl_vit.data.sources import open_source
from ssl_vit.eval.readouts import Extraction
from ssl_vit.eval.select_features import FeatureWriter, embed_batch
from ssl_vit.eval.select_output import source_names
from ssl_vit.eval.selection import METHODS, kcenter, normalised, select, typicality, typiclust
from ssl_vit.train.preflight import load_frozen_encoder

# --- the methods, on hand-made features ----------------------------------------------------

CENTRES = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
OUTLIERS = np.array([[-9.0, -9.0], [19.0, 19.0], [-9.0, 16.0], [14.0, -8.0]])


def blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian clusters of 60 points (std 1) and 4 far outliers -> (x [184, 2], the
    true cluster of each point: 0..2, -1 for an outlier)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([c + rng.normal(size=(60, 2)) for c in CENTRES] + [OUTLIERS])
    return x.astype(np.float32), np.repeat([0, 1, 2, -1], [60, 60, 60, len(OUTLIERS)])


def brute_typicality(x: np.ndarray, k: int = 20) -> np.ndarray:
    """The paper's typicality, one point at a time: 1 / (mean distance to its k nearest)."""
    d = np.sqrt(((x[:, None].astype(np.float64) - x[None]) ** 2).sum(-1))
    return np.array([1 / (np.sort(np.delete(row, i))[:k].mean() + 1e-5) for i, row in enumerate(d)])


def test_typicality_by_hand():
    x = np.array([[0.0], [1.0], [3.0], [7.0]])  # k = min(20, 4 - 1) = 3: every other point
    means = np.array([11 / 3, 9 / 3, 9 / 3, 17 / 3])
    np.testing.assert_allclose(typicality(x), 1 / (means + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(typicality(x, k=1), 1 / (np.array([1, 1, 2, 4]) + 1e-5), rtol=1e-6)
    assert np.isnan(typicality(x[:1])).all()  # one image: no neighbour


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_typiclust_picks_each_clusters_densest_point_never_an_outlier():
    x, truth = blobs()
    picks = typiclust(x, 3, seed=0)
    assert sorted(truth[picks.rows]) == [0, 1, 2]  # one per cluster, no outlier
    for r in picks.rows:  # the densest point of its (true) cluster, nearest its centre
        members = np.flatnonzero(truth == truth[r])
        assert r == members[np.argmax(brute_typicality(x[members]))]
        d = np.linalg.norm(x[members] - CENTRES[truth[r]], axis=1)
        assert np.linalg.norm(x[r] - CENTRES[truth[r]]) <= np.quantile(d, 0.1)
    # Largest first: the clusters k-means found (outliers included), by size.
    assert sum(picks.cluster_size) == len(x)
    assert list(picks.cluster_size) == sorted(picks.cluster_size, reverse=True)


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_large_clusters_and_duplicates_never_run_out(monkeypatch):
    """A cluster above MAX_TYPICALITY_POINTS is ranked on a seeded draw of that many, the rest
    after; with fewer distinct images than picks the clusters are visited again until every
    image is picked."""
    import warnings

    from ssl_vit.eval import selection

    monkeypatch.setattr(selection, "MAX_TYPICALITY_POINTS", 4)
    x = np.repeat(np.eye(3, dtype=np.float32), 10, axis=0)  # 3 distinct images, 10 times each
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # k-means: fewer distinct points than clusters
        picks = typiclust(x, 30, seed=0)
        again = typiclust(x, 30, seed=0)
    assert sorted(picks.rows.tolist()) == list(range(30))
    assert np.array_equal(picks.rows, again.rows)
    assert sorted(x[picks.rows[:3]].argmax(axis=1).tolist()) == [0, 1, 2]  # one per image first
    assert np.isnan(picks.typicality).sum() == 30 - 3 * 4  # beyond each draw of 4


@pytest.mark.parametrize("method", METHODS)
def test_picks_are_a_function_of_the_features_and_the_seed(method):
    x, _ = blobs()
    x = normalised(x + 20)  # all in one quadrant: the angles still tell the clusters apart
    first = select(method, x, 8, seed=3)
    assert np.array_equal(first.rows, select(method, x, 8, seed=3).rows)
    assert len(set(first.rows.tolist())) == 8
    if method == "random":
        assert not np.array_equal(first.rows, select(method, x, 8, seed=4).rows)


@pytest.mark.parametrize("method", METHODS)
def test_a_larger_budget_keeps_the_earlier_picks(method):
    x, truth = blobs(1)
    x = normalised(x + 20)
    round1 = select(method, x, 3, seed=0).rows
    round2 = select(method, x, 6, previous=round1, seed=0).rows
    assert len(round2) == 3 and not set(round2.tolist()) & set(round1.tolist())
    with pytest.raises(ValueError, match="must exceed the 3 earlier picks"):
        select(method, x, 3, previous=round1)


def test_typiclust_adds_from_clusters_without_an_earlier_pick():
    x, truth = blobs()
    round1 = typiclust(x, 2, seed=0)  # two of the three blobs
    round2 = typiclust(x, 3, previous=round1.rows, seed=0)
    assert {truth[round2.rows[0]], *truth[round1.rows]} == {0, 1, 2}


def test_kcenter_takes_the_farthest_point_first():
    x = np.array([[0.0, 0], [1, 0], [2, 0], [10, 0], [4, 0]], dtype=np.float32)
    assert kcenter(x, 3, previous=[0]).rows.tolist() == [3, 4]  # 10 away, then 4 (from 0 and 10)


# --- the job, on a tiny pretrained encoder and image folders -------------------------------


@pytest.fixture(scope="module")
def encoder_run(synthetic_shards, tmp_path_factory) -> Path:
    """A 2-step smoke pretraining run (patch 4, width 32, 16 px)."""
    out = tmp_path_factory.mktemp("pretrain")
    pipeline("pretrain")(
        ["--config", str(ROOT / "configs/pretrain/smoke.yaml"),
         f"data.train_shards={synthetic_shards}", f"output_dir={out}", "train.steps=2",
         "train.checkpoint_every=2", "train.log_every=1"]
    )  # fmt: skip
    return out


def image_folder(root: Path, classes: list[str], n: int = 30, bad: int = 2) -> Path:
    """`n` PNG images named img00.png ... (image i in class folder i % len(classes)), four
    colour groups with noise, and `bad` corrupt files bad0.png ... in the first class."""
    rng = np.random.default_rng(0)
    colours = np.array([[220, 30, 30], [30, 200, 40], [40, 40, 210], [200, 200, 200]])
    for i in range(n):
        pixels = np.clip(colours[i % 4] + rng.normal(0, 25, (16, 16, 3)), 0, 255)
        folder = root / classes[i % len(classes)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.astype(np.uint8)).save(folder / f"img{i:02d}.png")
    for j in range(bad):
        (root / classes[0] / f"bad{j}.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def run_select(run: Path, source: Path, out: Path, *args: str) -> dict:
    return pipeline("selection")(
        ["--checkpoint", str(run), "--source", str(source), "--output", str(out), *args]
    )


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "selection.jsonl").read_text().splitlines()]


def picked_files(out: Path) -> list[str]:
    """The images of to-label/ (any depth) by their original file name, in rank order."""
    return [p.name.split("-", 1)[1] for p in sorted((out / "to-label").rglob("*.png"))]


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_unreadable_images_are_skips_and_the_labels_are_never_read(encoder_run, tmp_path):
    src = image_folder(tmp_path / "src", ["cat", "dog", "fox"])
    # The same images, other class names in another order, and moved between the classes.
    other = tmp_path / "other"
    for i, p in enumerate(sorted(src.rglob("*.png"))):
        (other / ["zebra", "ant", "moth", "bee"][i % 4]).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, other / ["zebra", "ant", "moth", "bee"][i % 4] / p.name)
    for method in ("typiclust", "random"):  # (kcenter alike: its first pick is random's)
        a, b = tmp_path / f"a-{method}", tmp_path / f"b-{method}"
        res = run_select(encoder_run, src, a, "--budget", "5", "--method", method)
        run_select(encoder_run, other, b, "--budget", "5", "--method", method)
        assert res["images"] == 30 and res["skipped"] == 2
        assert {s["key"] for s in res["skipped_images"]} == {"cat/bad0.png", "cat/bad1.png"}
        assert res["feature_dim"] == 32 and res["image_size"] == 16  # the checkpoint's
        got = rows(a)
        assert [r["rank"] for r in got] == [1, 2, 3, 4, 5] and len({r["key"] for r in got}) == 5
        assert [r["file"] for r in got] == sorted(
            f"to-label/{p.name}" for p in (a / "to-label").iterdir()
        )
        for r in got:  # the copy is the source's file, byte for byte
            assert (a / r["file"]).read_bytes() == (src / r["key"]).read_bytes()
            assert r["path"] == str(src / r["key"]) and r["file"].endswith(Path(r["key"]).name)
        assert picked_files(a) == picked_files(b), method  # by content, whatever the folders
        assert [r["index"] for r in rows(a)] != [r["index"] for r in rows(b)]  # other places
    assert rows(tmp_path / "a-typiclust")[0]["typicality"] > 0
    assert rows(tmp_path / "a-random")[0]["cluster"] is None


def test_a_pool_with_class_folders_and_loose_images_is_read_whole(encoder_run, tmp_path):
    """The pool is every image under --source: a first round sorted into class folders beside
    the images still to label. It read the class folders' images alone for its count and
    every image in its stream, and died ("6 images, 3 when the job started")."""
    src = image_folder(tmp_path / "pool", ["cat"], n=3, bad=0)
    for i in range(3):
        shutil.copy(src / "cat" / f"img{i:02d}.png", src / f"loose{i}.png")
    res = run_select(encoder_run, src, tmp_path / "pick", "--budget", "6", "--method", "random")
    assert res["images"] == 6 and res["skipped"] == 0
    assert sorted(r["key"] for r in rows(tmp_path / "pick")) == [
        *(f"cat/img{i:02d}.png" for i in range(3)),
        *(f"loose{i}.png" for i in range(3)),
    ]


def test_a_run_directory_given_as_images_is_named_with_where_its_images_are(encoder_run, tmp_path):
    """`data.train=runs/mine-pick` (the select run, not its to-label/) trained one class named
    'to-label', and predict / select read its folders as classes: each is now one line."""
    from ssl_vit.config import ConfigError
    from ssl_vit.train.preflight import check_labelled_source

    src = image_folder(tmp_path / "pool", ["cat"], n=4, bad=0)
    pick = tmp_path / "pick"
    run_select(encoder_run, src, pick, "--budget", "2", "--method", "random")
    said = f"a select run directory, not images: the images it picked are in {pick / 'to-label'}"
    with pytest.raises(ConfigError, match=f"^data.train='{pick}': {said}$"):
        check_labelled_source("data.train", str(pick))
    with pytest.raises(SystemExit, match=f"--source {pick}: {said}"):
        run_select(encoder_run, pick, tmp_path / "again", "--budget", "1")
    with pytest.raises(ConfigError, match="a pretraining run directory, not images$"):
        check_labelled_source("fewshot.train", str(encoder_run))
    assert not (tmp_path / "again").exists()


def test_rounds_grow_the_selection_and_keep_the_users_labels(encoder_run, tmp_path):
    src = image_folder(tmp_path / "src", ["x"], bad=0)
    out = tmp_path / "pick"
    run_select(encoder_run, src, out, "--budget", "3")
    first = rows(out)
    labelled = out / "to-label" / "cat"  # the user sorts the first pick into its class
    labelled.mkdir()
    moved = Path(first[0]["file"]).name
    (out / "to-label" / moved).rename(labelled / moved)
    res = run_select(encoder_run, src, out, "--budget", "6")
    second = rows(out)
    assert res["earlier_picks"] == 3 and res["new_picks"] == 3 and res["round"] == 2
    assert [r["key"] for r in second[:3]] == [r["key"] for r in first]
    assert [r["round"] for r in second] == [1, 1, 1, 2, 2, 2]
    assert len(picked_files(out)) == 6 and (labelled / moved).is_file()
    assert not (out / "to-label" / moved).exists()  # not copied again
    with pytest.raises(SystemExit, match="holds 6 picks already"):
        run_select(encoder_run, src, out, "--budget", "6")
    with pytest.raises(SystemExit, match=r"holds cat besides the copies select made"):
        run_select(encoder_run, src, out, "--budget", "2", "--overwrite")
    shutil.rmtree(labelled)
    run_select(encoder_run, src, out, "--budget", "2", "--overwrite", "--no-copy")
    assert len(rows(out)) == 2 and not (out / "to-label").exists()


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_a_round_reuses_the_features_unless_what_they_were_read_with_changed(
    encoder_run, tmp_path, monkeypatch
):
    """A larger budget in the same --output reads no image again (the same picks as a round
    whose features are read again); another batch size or one more image reads them again."""
    from ssl_vit.data import predict_stream

    src = image_folder(tmp_path / "src", ["x"], bad=2)
    out, again = tmp_path / "pick", tmp_path / "again"
    assert run_select(encoder_run, src, out, "--budget", "3")["features_reused"] is False
    shutil.copytree(out, again)
    (again / "features.index.npz").unlink()  # this copy's next round reads every image
    fresh = run_select(encoder_run, src, again, "--budget", "6")
    read = predict_stream.predict_loader

    def no_images(*args, **kwargs):
        raise AssertionError("an image was read again")

    monkeypatch.setattr(predict_stream, "predict_loader", no_images)
    reused = run_select(encoder_run, src, out, "--budget", "6")
    assert reused["features_reused"] is True and fresh["features_reused"] is False
    assert (reused["images"], reused["skipped"]) == (fresh["images"], fresh["skipped"]) == (30, 2)
    assert [{k: v for k, v in r.items() if k != "file"} for r in rows(out)] == [
        {k: v for k, v in r.items() if k != "file"} for r in rows(again)
    ]
    monkeypatch.setattr(predict_stream, "predict_loader", read)
    other_batch = run_select(encoder_run, src, out, "--budget", "7", "--batch-size", "5")
    assert other_batch["features_reused"] is False
    image_folder(tmp_path / "more", ["x"], n=31, bad=0)
    shutil.copy(tmp_path / "more" / "x" / "img30.png", src / "x")  # a new image in the source
    for budget, reused in (("8", False), ("9", True)):
        res = run_select(encoder_run, src, out, "--budget", budget, "--batch-size", "5")
        assert res["features_reused"] is reused, budget
    (out / "features.index.npz").write_bytes(b"not an index")  # damaged: read them again
    res = run_select(encoder_run, src, out, "--budget", "10", "--batch-size", "5")
    assert res["features_reused"] is False and len(rows(out)) == 10


def test_bad_input_is_one_line_before_any_image_is_read(encoder_run, tmp_path):
    src = image_folder(tmp_path / "src", ["x"], n=4, bad=0)
    out = tmp_path / "out"
    cases = [
        (encoder_run, src, out, "--budget", "5"),
        (encoder_run, tmp_path / "no", out, "--budget", "2"),
        (tmp_path / "nothing", src, out, "--budget", "2"),
        (encoder_run, src, encoder_run, "--budget", "2"),
        (encoder_run, src, out, "--budget", "0"),
    ]  # fmt: skip
    matches = ["more than the 4 images", "--source", "no such file", "a pretraining run", "budget"]
    for args, match in zip(cases, matches, strict=True):
        with pytest.raises(SystemExit, match=match):
            run_select(*args)
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_the_features_file_needs_its_room_before_any_image_is_read(tmp_path, monkeypatch):
    from ssl_vit.atomic import WriteError
    from ssl_vit.eval import select_features

    usage = shutil.disk_usage(tmp_path)._replace(free=10**9)
    monkeypatch.setattr(select_features.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(WriteError, match="1.54 GB for 1000000 images x 768 float16, 1.00 GB"):
        FeatureWriter(tmp_path / "features.npy", 1_000_000, 768)
    assert not any(tmp_path.iterdir())


def features_file(run: Path, source: Path, out: Path, workers: int, rank: int, world: int):
    """features.npy of `source` as rank `rank` of `world` processes, each round's batches
    appended in rank order as the main process does: the one-process file, if the stream and
    the writer keep the source's order."""
    frozen = load_frozen_encoder("--checkpoint", str(run))
    how = Extraction(frozen.mean, frozen.std)
    n, B = 30 + 2, 4
    loaders = [iter(predict_loader(str(source), n, B, 16, num_workers=workers, rank=r,
                                   world_size=world)) for r in range(world)]  # fmt: skip
    writer = FeatureWriter(out / "features.npy", n, 32)
    for g in range(-(-n // B)):
        batch = next(loaders[g % world])
        writer.write(embed_batch(frozen.encoder, batch, how, "cls", g * B))
    return writer.close()


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_features_do_not_depend_on_workers_or_processes(encoder_run, tmp_path):
    src = image_folder(tmp_path / "src", ["a", "b"])
    tables = {}
    for workers, world in ((0, 1), (2, 1), (0, 2)):
        out = tmp_path / f"w{workers}r{world}"
        out.mkdir()
        tables[workers, world] = features_file(encoder_run, src, out, workers, 0, world)
    one = tables[0, 1]
    assert one.features.shape == (30, 32) and len(one.skipped) == 2
    for t in tables.values():
        assert t.path.read_bytes() == one.path.read_bytes()
        assert t.names == one.names and np.array_equal(t.keys, one.keys)
    # Source indices: known from the batch, unless it held an unreadable image (a/bad*.png).
    assert one.index.tolist()[:4] == [-1, -1, 4, 5] and (one.index == -1).sum() == 2
    # Through the job: workers 0 and 2 pick the same images from the same features.
    for w in (0, 2):
        run_select(encoder_run, src, tmp_path / f"job{w}", "--budget", "4", "--workers", str(w),
                   "--batch-size", "4")  # fmt: skip
    a, b = tmp_path / "job0", tmp_path / "job2"
    assert (a / "features.npy").read_bytes() == (b / "features.npy").read_bytes()
    assert (a / "selection.jsonl").read_text() == (b / "selection.jsonl").read_text()
    names = source_names(open_source(str(src)))
    assert all(r["index"] == names.index(r["key"]) for r in rows(a))


def test_select_is_a_sub_command_of_the_cli(capsys):
    from ssl_vit.cli import JOBS, main

    assert "select" in JOBS
    with pytest.raises(SystemExit) as e:
        main(["select", "--help"])
    assert e.value.code == 0 and "--budget" in capsys.readouterr().out


@pytest.mark.system
def test_two_processes_write_the_selection_of_one(encoder_run, tmp_path):
    """`accelerate launch` with 2 processes: the same features.npy and selection.jsonl (random
    picks: the method runs on the main process alone, what differs is the feature pass)."""
    import subprocess

    from test_distributed import LAUNCH

    src = image_folder(tmp_path / "src", ["a", "b"])
    common = ["--checkpoint", str(encoder_run), "--source", str(src), "--budget", "4",
              "--method", "random", "--batch-size", "3"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    pipeline("selection")([*common, "--output", str(one), "--workers", "0"])
    cmd = [*LAUNCH, str(ROOT / "pipelines/selection.py"), *common, "--output", str(two)]
    proc = subprocess.run([*cmd, "--workers", "1"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (one / "features.npy").read_bytes() == (two / "features.npy").read_bytes()
    assert (one / "selection.jsonl").read_text() == (two / "selection.jsonl").read_text()
    res = json.loads((two / "results.json").read_text())
    assert res["processes"] == 2 and res["images"] == 30 and res["skipped"] == 2


def test_the_collectives_wait_dist_s_and_the_loaders_data_s(encoder_run, tmp_path, monkeypatch):
    seen = record_timeouts(monkeypatch)
    src = image_folder(tmp_path / "src", ["x"], n=4, bad=0)
    run_select(encoder_run, src, tmp_path / "out", "--budget", "2", "timeouts.data_s=70",
               "timeouts.dist_s=990")  # fmt: skip
    assert seen["dist_s"] == 990 and seen["data_s"]() == 70  # before issue 48: 70 and 70


def test_pick_quality_scores_a_pick_by_its_nearest_pick_labels(encoder_run, tmp_path, capsys):
    """scripts/pick_quality.py on two select outputs of one labelled folder (cls and gap
    features): a budget of every image labels each image by itself (100%, every class
    covered); a pick of one image labels all with its class (1 class, 1 / 4 of the images)."""
    import importlib.util

    src = image_folder(tmp_path / "src", ["a", "b", "c", "d"], n=24, bad=0)
    for pool in ("cls", "gap"):
        run_select(encoder_run, src, tmp_path / pool, "--budget", "1", "--no-copy", f"pool={pool}")
    spec = importlib.util.spec_from_file_location("pick_quality", ROOT / "scripts/pick_quality.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folders = [str(tmp_path / "cls"), str(tmp_path / "gap")]
    script.main([*folders, "--source", str(src), "--budgets", "24", "1", "--seeds", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * 2 * 2  # folders x methods x budgets
    for line in lines:
        if " 24: " in line:
            assert line.endswith("classes [4, 4], nearest-pick top-1 100.0 [100.0, 100.0]")
        else:
            assert line.endswith("classes [1, 1], nearest-pick top-1 25.0 [25.0, 25.0]")
