"""Which N images to label (issue 49): `data.labels_select` random or typiclust picks
`data.labels_budget` images of data.train without reading a label (the same picks from a
source whose labels are shuffled), the same for a seed whatever the loader workers, through
`ssl-vit select`'s code (typiclust: its picks); checked in one line naming the key; recorded in
labelled.json and refused on --resume with another method, budget or seed; and a fine-tune on
them trains on exactly those N images."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, pipeline
from test_pipelines import init_args

from ssl_vit.config import ConfigError, FinetuneConfig, load_config
from ssl_vit.data import open_source
from ssl_vit.data.labelled import (
    check_recorded,
    choose_labelled,
    choose_random,
    choose_typiclust,
    use_labelled,
)
from ssl_vit.data.write.writer import ShardWriter
from ssl_vit.train.label_picks import pick_typiclust

N = 12  # of the 96 fixture images


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


@pytest.fixture(scope="module")
def shuffled(synthetic_shards, tmp_path_factory) -> Path:
    """The fixture's images under the same keys, with their labels shuffled and in 5 shards."""
    out = tmp_path_factory.mktemp("shuffled") / "shards"
    source = open_source(str(synthetic_shards))
    records = list(source.iter_records())
    labels = np.random.default_rng(0).permutation([r.label for r in records])
    assert (labels != [r.label for r in records]).any()
    with ShardWriter(out, 20) as writer:
        for rec, label in zip(records, labels.tolist(), strict=True):
            writer.write(rec.key, rec.ext or "png", rec.data, label)
        writer.close(label_names=list(source.label_names), source=str(synthetic_shards))
    return out


def _picks(subset) -> set[str]:
    return {k for keys in subset.keys.values() for k in keys}


def _typiclust(spec, run_dir: Path, encoder_run, workers: int, seed: int = 0):
    """The typiclust subset of `spec` as one process with `workers` loader workers picks it."""
    subset = choose_typiclust(str(spec), N, seed, None)
    assert not subset.picked
    acc = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                          device="cpu", mixed_precision="no")  # fmt: skip
    plan = SimpleNamespace(num_workers=workers, rank=0, world=1)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = SimpleNamespace(init=SimpleNamespace(checkpoint=str(encoder_run)),
                          model=SimpleNamespace(image_size=16))  # fmt: skip
    pick_typiclust(subset, cfg, SimpleNamespace(acc=acc, plan=plan, run_dir=run_dir))
    assert list(run_dir.iterdir()) == []  # its features file is gone
    return subset


def test_random_picks_are_keys_only_seeded_and_never_read_a_label(synthetic_shards, shuffled):
    a = choose_random(str(synthetic_shards), N, 0)
    assert len(_picks(a)) == a.num_labelled == N and a.labels_per_class == 0
    assert (a.labels_select, a.labels_budget, a.labels_seed) == ("random", N, 0)
    assert _picks(choose_random(str(shuffled), N, 0)) == _picks(a)  # the labels are not read
    assert choose_random(str(synthetic_shards), N, 0).keys == a.keys  # a function of the seed
    assert _picks(choose_random(str(synthetic_shards), N, 1)) != _picks(a)
    # Each pick under the class it has in its source; a class with no pick is still named.
    label_of = dict(zip(open_source(str(shuffled)).sample_keys(),
                        open_source(str(shuffled)).labels().tolist(), strict=True))  # fmt: skip
    b = choose_random(str(shuffled), N, 0)
    names = b.label_names
    assert all(label_of[k] == names.index(n) for n, keys in b.keys.items() for k in keys)
    assert list(b.keys) == names and b.available == {}


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_typiclust_picks_are_selects_whatever_the_labels_and_workers(
    synthetic_shards, shuffled, encoder_run, tmp_path
):
    """The picks of `ssl-vit select --method typiclust` on the same encoder, budget and seed;
    the same from the source with shuffled labels and with 1 or 2 loader workers."""
    one = _typiclust(synthetic_shards, tmp_path / "w1", encoder_run, 1)
    assert len(_picks(one)) == one.num_labelled == N and one.picked
    two = _typiclust(synthetic_shards, tmp_path / "w2", encoder_run, 2)
    assert two.keys == one.keys and two.indices == one.indices
    assert _picks(_typiclust(shuffled, tmp_path / "shuffled", encoder_run, 1)) == _picks(one)
    assert _picks(_typiclust(synthetic_shards, tmp_path / "s1", encoder_run, 1, 1)) != _picks(one)
    out = tmp_path / "select"
    pipeline("selection")(["--checkpoint", str(encoder_run), "--source", str(synthetic_shards),
                           "--output", str(out), "--budget", str(N), "--no-copy"])  # fmt: skip
    chosen = [json.loads(line)["key"] for line in (out / "selection.jsonl").open()]
    assert set(chosen) == _picks(one)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.labels_budget=5"], "data.labels_budget=5: with data.labels_select=random"),
        (["data.labels_select=random", "data.labels_budget=5", "data.labels_per_class=2"],
         "data.labels_per_class=2: with data.labels_select=random"),
        (["data.labels_select=random"], "data.labels_budget: the number of images"),
        (["data.labels_select=typiclust"], "data.labels_budget: the number of images"),
        (["data.labels_select=typiclust", "data.labels_budget=-1"], "data.labels_budget: must"),
        (["data.labels_select=typiclust", "data.labels_budget=5", "init.checkpoint=none"],
         "data.labels_select=typiclust: picks by the init encoder's features"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(FinetuneConfig, ROOT / "configs/finetune/smoke.yaml",
                    ["data.train=x", "init.checkpoint=runs/x", *overrides])  # fmt: skip
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_a_budget_larger_than_the_source_is_one_line_before_compute(synthetic_shards, tmp_path):
    for choose in (choose_random, lambda *a: choose_typiclust(*a, None)):
        with pytest.raises(ConfigError, match=r"^data.labels_budget=97: more than the 96 images"):
            choose(str(synthetic_shards), 97, 0)
    out = tmp_path / "ft"
    with pytest.raises(SystemExit) as e:
        pipeline("finetune")(
            [*init_args("none", synthetic_shards, out), "data.labels_select=random",
             "data.labels_budget=97"]
        )  # fmt: skip
    assert str(e.value).startswith("error: data.labels_budget=97: more than the 96 images")
    assert not (out / "config.yaml").exists()


def test_the_record_names_the_picks_and_resume_refuses_another_method(synthetic_shards, tmp_path):
    spec, run_dir = str(synthetic_shards), tmp_path / "run"
    subset = choose_random(spec, N, 0)
    use_labelled(subset, run_dir, write=True)
    record = json.loads((run_dir / "labelled.json").read_text())
    assert (record["labels_select"], record["labels_budget"], record["labels_seed"]) == (
        "random", N, 0)  # fmt: skip
    assert record["keys"] == subset.keys and record["num_labelled"] == N
    assert sorted(open_source(str(run_dir / "labelled")).sample_keys()) == sorted(_picks(subset))
    check_recorded(choose_random(spec, N, 0), run_dir)  # the same: continues
    asked = [
        (choose_random(spec, N + 1, 0), f"data.labels_budget {N} -> {N + 1}"),
        (choose_random(spec, N, 1), "data.labels_seed 0 -> 1"),
        (choose_typiclust(spec, N, 0, str(run_dir)), "data.labels_select random -> typiclust"),
        (choose_labelled(spec, 2, 0), "data.labels_select random -> balanced"),
        (None, "data.labels_select random -> balanced"),
    ]
    for other, change in asked:
        with pytest.raises(ConfigError) as e:
            check_recorded(other, run_dir)
        line = str(e.value)
        assert line.startswith("--resume: ") and change in line and "\n" not in line, line
        assert f"{N} images by random, seed 0" in line
    # The copy's index.json says the same when labelled.json is lost.
    (run_dir / "labelled.json").unlink()
    with pytest.raises(ConfigError, match="data.labels_select random -> typiclust"):
        check_recorded(choose_typiclust(spec, N, 0, str(run_dir)), run_dir)


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_finetune_trains_on_exactly_the_typiclust_picks(synthetic_shards, encoder_run, tmp_path):
    """A fine-tune with labels_select=typiclust trains on its N picks only (all of them),
    records them and its method, and resumes on its recorded picks without a feature pass."""
    out = tmp_path / "ft"
    run = ["data.labels_select=typiclust", f"data.labels_budget={N}", "data.record_keys=true",
           "data.num_workers=2", "train.steps=4", "model.image_size=16"]  # fmt: skip
    results = pipeline("finetune")([*init_args(encoder_run, synthetic_shards, out), *run])
    record = json.loads((out / "labelled.json").read_text())
    picks = {k for keys in record["keys"].values() for k in keys}
    assert len(picks) == record["num_labelled"] == N and record["labels_select"] == "typiclust"
    seen = [k for f in sorted(out.glob("keys_rank*.txt")) for k in f.read_text().split()]
    assert len(seen) == 4 * 32 and set(seen) == picks  # only the picks, and all of them
    assert (results["labels_select"], results["labels_budget"]) == ("typiclust", N)
    assert results["labels_per_class"] == 0 and results["num_labelled"] == N
    expected = _typiclust(synthetic_shards, tmp_path / "again", encoder_run, 0)
    assert picks == _picks(expected)  # select's picks, at model.image_size
    resumed = choose_typiclust(str(synthetic_shards), N, 0, str(out))
    assert resumed.picked and resumed.keys == record["keys"]  # from the record


@pytest.mark.system
def test_two_processes_train_on_the_typiclust_picks_of_one(synthetic_shards, encoder_run, tmp_path):
    """2 processes (`accelerate launch`): each embeds its share, the main process picks and
    gives the picks to the other; both train on them, the picks of one process."""
    import os
    import subprocess

    from test_distributed import LAUNCH, _free_port

    out = tmp_path / "ft"
    run = ["data.labels_select=typiclust", f"data.labels_budget={N}", "data.record_keys=true",
           "train.steps=2", "model.image_size=16"]  # fmt: skip
    cmd = [
        *LAUNCH,
        *("--num_machines", "1", "--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/finetune.py"),
        *init_args(encoder_run, synthetic_shards, out),
        *run,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "labelled.json").read_text())
    picks = {k for keys in record["keys"].values() for k in keys}
    assert picks == _picks(_typiclust(synthetic_shards, tmp_path / "one", encoder_run, 0))
    per_rank = [(out / f"keys_rank{r}.txt").read_text().split() for r in range(2)]
    assert all(keys and set(keys) <= picks for keys in per_rank)
