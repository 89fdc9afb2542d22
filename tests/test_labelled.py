"""The label budget (`data.labels_per_class`): a class-balanced subset that depends on the
source and `data.labels_seed` only, refused in one line when a class is too small, recorded in
the run directory, and the only images a fine-tune on it trains on."""

import io
import json
import os
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import pipeline
from PIL import Image
from test_distributed import LAUNCH, _free_port
from test_faults import stop_after_step
from test_pipelines import ROOT, finetune_args

from ssl_vit.config import ConfigError
from ssl_vit.data import open_source
from ssl_vit.data.labelled import choose_labelled
from ssl_vit.data.write.convert import make_shards
from ssl_vit.datasets.synthetic import SYNTHETIC_LABELS, make_synthetic_shards

K = 4  # per class: 40 of the 96 fixture images


def _label_of(spec: str) -> dict[str, str]:
    source = open_source(spec)
    names = source.label_names
    return {k: names[c] for k, c in zip(source.sample_keys(), source.labels(), strict=True)}


def test_subset_is_class_balanced_and_a_function_of_the_seed(synthetic_shards):
    spec = str(synthetic_shards)
    label_of = _label_of(spec)
    available = Counter(label_of.values())
    for seed in range(20):  # many draws: each one balanced, and K per class of that class
        subset = choose_labelled(spec, K, seed)
        assert list(subset.keys) == list(SYNTHETIC_LABELS)
        for name, keys in subset.keys.items():
            assert len(keys) == len(set(keys)) == K
            assert {label_of[k] for k in keys} == {name}
        assert subset.available == dict(available) and subset.num_labelled == 10 * K
    a, b = choose_labelled(spec, K, 0), choose_labelled(spec, K, 0)
    assert a.keys == b.keys and a.indices == b.indices  # the same subset every time
    assert choose_labelled(spec, K, 1).keys != a.keys  # another seed, another subset
    small = choose_labelled(spec, 2, 0)  # a smaller budget is inside the larger one
    assert all(set(small.keys[n]) <= set(a.keys[n]) for n in a.keys)


def test_subset_does_not_depend_on_how_the_source_is_stored(tmp_path):
    """The same images as a class folder, as shards of another size and order, and as an HF
    dataset: the same keys are chosen (keys, not positions, decide)."""
    folder = tmp_path / "folder"
    for i in range(30):
        (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i * 8, 0, 0)).save(folder / f"c{i % 3}" / f"img{i:02d}.png")
    make_shards(folder, tmp_path / "a", shard_size=7, shuffle_seed=0, progress=False)
    make_shards(folder, tmp_path / "b", shard_size=30, shuffle_seed=5, progress=False)
    chosen = [choose_labelled(str(p), 3, 0).keys for p in (folder, tmp_path / "a", tmp_path / "b")]
    assert chosen[0] == chosen[1] == chosen[2]


def test_subset_of_an_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    images = []
    for i in range(12):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(buf, "PNG")
        images.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features(
        {"img": datasets.Image(), "y": datasets.ClassLabel(names=["a", "b"])}
    )
    labels = [i % 2 for i in range(12)]
    datasets.Dataset.from_dict({"img": images, "y": labels}, features=features).save_to_disk(
        tmp_path / "hf"
    )
    subset = choose_labelled(str(tmp_path / "hf"), 2, 0)
    assert {n: len(k) for n, k in subset.keys.items()} == {"a": 2, "b": 2}
    assert all(labels[int(k)] == ["a", "b"].index(n) for n, ks in subset.keys.items() for k in ks)


def test_a_class_too_small_is_one_line_before_compute(synthetic_shards, tmp_path):
    smallest = min(Counter(_label_of(str(synthetic_shards)).values()).items(), key=lambda x: x[1])
    with pytest.raises(ConfigError) as e:
        choose_labelled(str(synthetic_shards), 50, 0)
    msg = str(e.value)
    assert "\n" not in msg and "data.labels_per_class=50" in msg
    assert f"{smallest[0]!r}" in msg and f"only {smallest[1]} images" in msg
    # The job: exit with that line, and no run directory made (nothing was computed).
    out = tmp_path / "ft"
    with pytest.raises(SystemExit) as e:
        pipeline("finetune")(finetune_args(synthetic_shards, out, "data.labels_per_class=50"))
    assert str(e.value).startswith("error: data.labels_per_class=50: class ")
    assert not (out / "config.yaml").exists()


def _keys_seen(out) -> list[str]:
    return [k for f in sorted(out.glob("keys_rank*.txt")) for k in f.read_text().split()]


@pytest.mark.system
def test_finetune_trains_only_on_the_subset_and_records_it(synthetic_shards, tmp_path):
    out = tmp_path / "ft"
    run = ["data.labels_per_class=4", "data.record_keys=true", "data.num_workers=2"]
    results = pipeline("finetune")(finetune_args(synthetic_shards, out, *run))
    subset = choose_labelled(str(synthetic_shards), 4, 0)
    record = json.loads((out / "labelled.json").read_text())
    assert record["keys"] == subset.keys and record["counts"] == dict.fromkeys(subset.keys, 4)
    assert record["label_names"] == list(SYNTHETIC_LABELS) and record["num_labelled"] == 40
    assert results["labels_per_class"] == 4 and results["num_labelled"] == 40
    assert results["num_classes"] == 10
    assert json.loads((out / "results.json").read_text())["num_labelled"] == 40
    seen = _keys_seen(out)
    assert len(seen) == 20 * 32  # 20 steps of 32
    chosen = {k for keys in subset.keys.values() for k in keys}
    assert set(seen) == chosen  # only the subset's images, and all of them (16 epochs)
    # The config keeps the source's name; the copy lives in the run directory.
    assert f"train: {synthetic_shards}" in (out / "config.yaml").read_text()
    assert open_source(str(out / "labelled")).sample_keys() != []


@pytest.mark.system
def test_finetune_without_a_budget_records_every_label(synthetic_shards, tmp_path):
    results = pipeline("finetune")(finetune_args(synthetic_shards, tmp_path / "ft"))
    assert results["labels_per_class"] == 0 and results["num_labelled"] == 96
    assert not (tmp_path / "ft" / "labelled.json").exists()


@pytest.mark.system
def test_same_subset_across_seeds_inits_workers_and_resume(synthetic_shards, tmp_path, monkeypatch):
    """Every run trains on the same keys, whatever its seed, init or worker count; a stopped and
    resumed run continues exactly (same losses) and refuses another budget on resume."""
    main = pipeline("finetune")
    base = ["data.labels_per_class=4", "train.steps=10", "train.log_every=1"]
    runs = {
        "seed1": ["seed=1", "data.num_workers=1"],
        "workers2": ["data.num_workers=2"],
        "workers0": ["data.num_workers=0"],
    }
    for name, extra in runs.items():
        main(finetune_args(synthetic_shards, tmp_path / name, *base, *extra))
    records = [json.loads((tmp_path / n / "labelled.json").read_text()) for n in runs]
    assert records[0] == records[1] == records[2]

    ref, out = tmp_path / "ref", tmp_path / "stopped"
    # (a random-init encoder is built before start_run seeds the RNGs: seed it here)
    torch.manual_seed(0)
    main(finetune_args(synthetic_shards, ref, *base, "data.num_workers=2"))
    torch.manual_seed(0)
    stop_after_step(monkeypatch, 5)
    main(finetune_args(synthetic_shards, out, *base, "data.num_workers=2"))
    monkeypatch.undo()
    config = (out / "config.yaml").read_text()
    with pytest.raises(SystemExit, match="another labelled subset"):
        main(finetune_args(synthetic_shards, out, "data.labels_per_class=3", *base[1:], "--resume"))
    assert (out / "config.yaml").read_text() == config  # the refused start changed nothing
    main(finetune_args(synthetic_shards, out, *base, "data.num_workers=2", "--resume"))
    losses = [
        [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").open())] for d in (ref, out)
    ]
    assert losses[0] == losses[1]  # within this process: resumed == uninterrupted


@pytest.mark.system
def test_two_processes_train_on_the_same_subset(tmp_path):
    shards = tmp_path / "shards"
    make_synthetic_shards(shards, n=96, image_size=32, seed=0, shard_size=12)
    out = tmp_path / "ft"
    cmd = [
        *LAUNCH,
        *("--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/finetune.py"),
        *finetune_args(shards, out, "data.labels_per_class=4", "data.record_keys=true"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    subset = choose_labelled(str(shards), 4, 0)
    assert json.loads((out / "labelled.json").read_text())["keys"] == subset.keys
    per_rank = [(out / f"keys_rank{r}.txt").read_text().split() for r in range(2)]
    chosen = {k for keys in subset.keys.values() for k in keys}
    assert all(set(keys) <= chosen for keys in per_rank) and set(sum(per_rank, [])) == chosen
    assert json.loads((out / "results.json").read_text())["num_labelled"] == 40


@pytest.mark.system
def test_drawn_keys_are_spread_over_the_sorted_keys(synthetic_shards):
    """The draw is a permutation of each class's sorted keys: over many seeds, every key of a
    class is chosen about equally often (a sorted prefix or a fixed stride would not be)."""
    spec = str(synthetic_shards)
    counts = Counter(k for s in range(400) for k in choose_labelled(spec, 2, s).keys["disc"])
    n = Counter(_label_of(spec).values())["disc"]
    assert len(counts) == n
    expected = 400 * 2 / n
    assert max(abs(c - expected) for c in counts.values()) < 5 * np.sqrt(expected)
