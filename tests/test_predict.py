"""`ssl-vit predict`: a fine-tuned classifier labels a source. Its top-1 on the fine-tune's
evaluation split is the fine-tune's; rows come out in source order whatever the batch, worker
and process count; unreadable images are named, counted skips; bad input is one line before
any image is read."""

import csv
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import pipeline, record_timeouts
from PIL import Image
from test_distributed import LAUNCH
from test_pipelines import ROOT

from ssl_vit.datasets.synthetic import make_synthetic_shards
from ssl_vit.eval.confusion import add_confusion, confusion_summary
from ssl_vit.train.classifier_file import (
    ClassifierError,
    ClassifierSpec,
    load_classifier,
    read_classifier_spec,
    save_classifier,
)
from ssl_vit.train.guard import JobError


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> dict:
    """A fine-tuned smoke classifier (3 shards of train, 2 shards of 50 eval images)."""
    root = tmp_path_factory.mktemp("predict")
    train, test = root / "train", root / "test"
    make_synthetic_shards(train, n=240, image_size=16, seed=0, shard_size=80)
    make_synthetic_shards(test, n=100, image_size=16, seed=1, shard_size=50)
    run = root / "ft"
    pipeline("finetune")(
        ["--config", str(ROOT / "configs/finetune/smoke.yaml"), f"data.train={train}",
         f"data.eval={test}", f"output_dir={run}", "train.steps=30", "eval_every=0"]
    )  # fmt: skip
    return {"root": root, "train": train, "test": test, "run": run}


def predict(*args: str) -> dict:
    return pipeline("predict")(list(args))


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]


def test_top1_on_the_eval_split_is_the_fine_tunes(finetuned, tmp_path):
    res = predict("--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"]),
                  "--output", str(tmp_path / "p"))  # fmt: skip
    ft = json.loads((finetuned["run"] / "results.json").read_text())
    assert res["images"] == 100 and res["skipped"] == 0
    assert res["top1"] == ft["top1"]
    assert res["per_class_top1"] == ft["per_class_top1"]
    assert res["confusion_matrix"] == ft["confusion_matrix"]
    rows = read_rows(tmp_path / "p")
    assert len(rows) == 100
    correct = sum(r["label"] == r["true_label"] for r in rows)
    assert correct / 100 == pytest.approx(ft["top1"])
    for r in rows:  # top-k sorted, the first is the label, probabilities of a softmax
        ps = [p for _, p in r["top_k"]]
        assert r["top_k"][0] == [r["label"], r["score"]] and ps == sorted(ps, reverse=True)
        assert len(ps) == 5 and 0 < sum(ps) <= 1 + 1e-5


def same_predictions(a: list[dict], b: list[dict]) -> None:
    """The same keys in the same order with the same labels; probabilities equal up to the
    last bits that another batch size's matrix products may change."""
    assert [r["key"] for r in a] == [r["key"] for r in b]
    assert [[n for n, _ in r["top_k"]] for r in a] == [[n for n, _ in r["top_k"]] for r in b]
    pa = np.array([[p for _, p in r["top_k"]] for r in a])
    pb = np.array([[p for _, p in r["top_k"]] for r in b])
    np.testing.assert_allclose(pa, pb, rtol=0, atol=1e-5)


@pytest.mark.system
def test_rows_are_in_source_order_for_any_batch_and_worker_count(finetuned, tmp_path):
    runs = {}
    for batch, workers in ((9, 0), (9, 1), (9, 2), (256, 0), (1, 2)):
        out = tmp_path / f"b{batch}w{workers}"
        flags = ["--batch-size", str(batch), "--workers", str(workers)]
        predict("--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"]),
                "--output", str(out), *flags)  # fmt: skip
        runs[batch, workers] = (out / "predictions.jsonl").read_text()
    assert runs[9, 0] == runs[9, 1] == runs[9, 2]  # byte-identical for any worker count
    same_predictions(read_rows(tmp_path / "b9w0"), read_rows(tmp_path / "b256w0"))
    same_predictions(read_rows(tmp_path / "b9w0"), read_rows(tmp_path / "b1w2"))
    from ssl_vit.data import open_source

    keys = open_source(str(finetuned["test"])).sample_keys()
    assert [r["key"] for r in read_rows(tmp_path / "b9w2")] == keys


@pytest.mark.system
def test_two_processes_write_the_rows_of_one(finetuned, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"])]
    predict(*common, "--output", str(one), "--workers", "0", "--batch-size", "9")
    cmd = [*LAUNCH, str(ROOT / "pipelines/predict.py"), *common, "--output", str(two)]
    proc = subprocess.run(
        [*cmd, "--batch-size", "9", "--workers", "2"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_predictions(read_rows(one), read_rows(two))
    res = json.loads((two / "results.json").read_text())
    assert res["processes"] == 2 and res["images"] == 100
    assert res["top1"] == json.loads((one / "results.json").read_text())["top1"]


def _folder(root: Path, names: list[str], corrupt: str | None = None) -> Path:
    """Class sub-folders of PNG images of several sizes (some not square), one corrupt file."""
    rng = np.random.default_rng(0)
    for i in range(12):
        h, w = (16, 16) if i % 3 else (20 + i, 13 + i)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        folder = root / names[i % len(names)] / ("sub" if i == 5 else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"img.{i:02d}.png")
    if corrupt:
        (root / corrupt).write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def test_an_unreadable_image_is_a_named_skip_and_keys_are_relative_paths(finetuned, tmp_path):
    names = list(read_classifier_spec(finetuned["run"]).label_names)
    src = _folder(tmp_path / "imgs", names[:10], corrupt=f"{names[1]}/broken.png")
    out = str(tmp_path / "p")
    res = predict("--checkpoint", str(finetuned["run"]), "--source", str(src), "--output", out,
                  "--format", "csv", "--batch-size", "4")  # fmt: skip
    assert res["images"] == 12 and res["skipped"] == 1
    assert res["skipped_images"][0] == {  # the reason, without PIL's in-memory file's address
        "key": f"{names[1]}/broken.png",
        "reason": "UnidentifiedImageError: cannot identify image file",
    }
    with open(tmp_path / "p" / "predictions.csv", newline="") as f:
        table = list(csv.DictReader(f))
    keys = [r["key"] for r in table]
    assert len(keys) == 12 and f"{names[5]}/sub/img.05.png" in keys
    assert keys == sorted(keys)  # a folder's order: class folders by name, then paths
    assert all(json.loads(r["top_k"])[0][0] == r["label"] for r in table)
    # The folder's classes (sorted by name) are mapped to the classifier's by name.
    assert all(r["true_label"] == r["key"].split("/")[0] for r in table)
    assert res["num_labelled"] == 12  # the labels came from the class folders
    # One photo: `--source` the file itself, its row the folder's (as a file, without a class)
    one = next(r for r in table if r["key"] == f"{names[5]}/sub/img.05.png")
    alone = predict("--checkpoint", str(finetuned["run"]), "--source", str(src / one["key"]),
                    "--output", str(tmp_path / "p1"))  # fmt: skip
    (row,) = [json.loads(line) for line in (tmp_path / "p1/predictions.jsonl").open()]
    assert alone["images"] == 1 and row["key"] == "img.05.png" and "true_label" not in row
    assert (row["label"], f"{row['score']:.6f}") == (one["label"], one["score"])


def test_bad_input_is_one_line_before_any_image_is_read(finetuned, tmp_path, capsys):
    run, test = str(finetuned["run"]), str(finetuned["test"])
    pre = tmp_path / "pre"
    (pre / "checkpoints").mkdir(parents=True)
    other = _folder(tmp_path / "other", ["cat", "dog"])
    (tmp_path / "p").mkdir()
    cases = [
        (["--checkpoint", str(pre), "--source", test], "a pretraining run"),
        (["--checkpoint", str(tmp_path / "none"), "--source", test], "no such file"),
        (["--checkpoint", run, "--source", str(other)], r"its classes \[cat, dog\] are not among"),
        (["--checkpoint", run, "--source", str(tmp_path / "missing")], "--source"),
        (["--checkpoint", run, "--source", test, "--output", run], "holds a fine-tuning run"),
    ]
    for args, match in cases:
        with pytest.raises(SystemExit, match=match):
            predict(*args, *([] if "--output" in args else ["--output", str(tmp_path / "p")]))
    assert not any((tmp_path / "p").iterdir())  # nothing written
    # Earlier predictions: replaced only with --overwrite; never over a source.
    predict("--checkpoint", run, "--source", str(other), "--output", str(tmp_path / "p"),
            "--ignore-labels")  # fmt: skip
    with pytest.raises(SystemExit, match="holds predictions; pass --overwrite"):
        predict("--checkpoint", run, "--source", test, "--output", str(tmp_path / "p"))
    with pytest.raises(SystemExit, match="--output"):
        predict("--checkpoint", run, "--source", str(other), "--output", str(other / "cat"),
                "--overwrite", "--ignore-labels")  # fmt: skip


def test_a_file_whose_metadata_lies_is_refused_before_building(finetuned, tmp_path):
    spec = read_classifier_spec(finetuned["run"])
    assert spec.num_classes == 10 and spec.image_size == 24
    big = ClassifierSpec({**spec.model_config, "width": 32768, "depth": 48, "heads": 8},
                         spec.pool, spec.label_names, spec.mean, spec.std)  # fmt: skip
    model, _ = load_classifier(finetuned["run"])
    save_classifier(model, tmp_path / "model.safetensors", big)
    with pytest.raises(ClassifierError, match="metadata says width 32768 but pos_embed is 1x37x32"):
        load_classifier(tmp_path / "model.safetensors")
    encoder = tmp_path / "enc.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(encoder), metadata={"model_config": "{}"})
    with pytest.raises(ClassifierError, match="an encoder, not a fine-tuned classifier"):
        load_classifier(encoder)


def test_confusion_counts_by_hand():
    conf = torch.zeros(3, 3, dtype=torch.int64)
    add_confusion(conf, torch.tensor([0, 0, 1, 2, 2, -1]), torch.tensor([0, 1, 1, 2, 0, 2]))
    assert conf.tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 1]]
    s = confusion_summary(conf, ["a", "b", "c"])
    assert s["top1"] == 3 / 5 and s["num_labelled"] == 5
    assert s["per_class_top1"] == {"a": 0.5, "b": 1.0, "c": 0.5}


def test_predict_is_a_sub_command_of_the_cli(capsys):
    from ssl_vit.cli import JOBS, main

    assert "predict" in JOBS
    with pytest.raises(SystemExit) as e:
        main(["predict", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--checkpoint" in out and "--top-k" in out


# --- issue 47: a stopped or killed predict leaves nothing a rerun does not remove ---------------


def _files(out: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.iterdir())}


def test_a_rerun_removes_what_a_killed_predict_left(finetuned, tmp_path):
    out = tmp_path / "p"
    common = ["--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"])]
    predict(*common, "--output", str(out))
    # SIGKILLed writers' temporary files (predictions, results.json), and a file not ours
    left = [".predictions.jsonl.tmp-999999", ".results.json.tmp-4194000"]
    for name in [*left, ".notes.txt.tmp-12"]:
        (out / name).write_text("partial")
    before = _files(out)
    with pytest.raises(SystemExit) as e:  # predict has no --resume: nothing is rewritten
        predict(*common, "--output", str(out), "--resume")
    assert e.value.code == 2 and _files(out) == before
    res = predict(*common, "--output", str(out), "--overwrite", "--format", "csv")
    assert res["images"] == 100 and not any((out / name).exists() for name in left)
    assert (out / ".notes.txt.tmp-12").read_text() == "partial"


def _signalled_in_the_rounds(main, sig: int, out: Path, fmt: str):
    """`main`'s predict_batch, which first sends this process `sig` (the partial file open)."""
    real = main.__globals__["predict_batch"]

    def signalled(*args, **kwargs):
        assert list(out.glob(f".predictions.{fmt}.tmp-{os.getpid()}"))
        os.kill(os.getpid(), sig)  # handled before the next bytecode
        return real(*args, **kwargs)

    return signalled


def _not_handled(signum, _frame):
    raise AssertionError(f"{signal.Signals(signum).name} reached the test: predict took none")


@pytest.mark.parametrize("sig, fmt", [(signal.SIGTERM, "jsonl"), (signal.SIGINT, "csv")])
def test_a_stop_signal_ends_predict_in_one_line_leaving_no_partial_file(
    finetuned, tmp_path, monkeypatch, sig, fmt
):
    out, main = tmp_path / "p", pipeline("predict")
    monkeypatch.setitem(main.__globals__, "predict_batch", _signalled_in_the_rounds(
        main, sig, out, fmt))  # fmt: skip
    # As in a job started in the foreground: a shell's background job (a CI runner's `cmd &`)
    # starts with SIGINT ignored, and predict leaves an ignored signal alone.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    sigint = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, _not_handled)  # (the default would end pytest)
    try:
        with pytest.raises(BaseException) as e:
            main(["--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"]),
                  "--output", str(out), "--format", fmt, "--batch-size", "10"])  # fmt: skip
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, before)
    assert isinstance(e.value, JobError), repr(e.value)
    name = signal.Signals(sig).name
    assert str(e.value).startswith(f"{name} received: stopped before the predictions were")
    assert sorted(p.name for p in out.iterdir()) == [".lock", "config.yaml"]
    assert after is sigint  # the handlers before are back
    assert not multiprocessing.active_children()  # its loader workers ended with it


HELD_IN_THE_ROUNDS = """
import importlib.util, sys, time
from pathlib import Path
from ssl_vit.train.guard import run_and_exit
spec = importlib.util.spec_from_file_location("predict", sys.argv[1])
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)
def held(*args, **kwargs):  # in the rounds, the partial file open: wait for the signal
    Path(sys.argv[2]).touch()
    time.sleep(120)
job.predict_batch = held
run_and_exit(job.main, sys.argv[3:])
"""


@pytest.mark.system
def test_sigterm_ends_a_predict_process_with_its_error_line_and_exit_1(finetuned, tmp_path):
    out, inside = tmp_path / "p", tmp_path / "inside"
    argv = ["--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"]),
            "--output", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_IN_THE_ROUNDS, str(ROOT / "pipelines/predict.py"),
         str(inside), *argv], stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        end = time.time() + 120
        while not inside.exists() and proc.poll() is None and time.time() < end:
            time.sleep(0.05)
        assert list(out.glob(".predictions.jsonl.tmp-*")), proc.poll()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1, err[-3000:]
    assert last.startswith("error: SIGTERM received: stopped before the predictions"), last
    assert sorted(p.name for p in out.iterdir()) == [".lock", "config.yaml"]
    print(f"SIGTERM in the rounds -> exit {proc.returncode} in {time.time() - t0:.1f}s")


# --- issue 47, defect 5: every image of a folder is predicted or a named, counted skip ----------


def _root_and_classes(root: Path, classes: list[str]) -> list[str]:
    """Two class folders (the first with a deeper sub-folder), two images and a corrupt file at
    the root. -> the readable images' relative paths, in a folder's order (class by class,
    then the root's)."""
    rng = np.random.default_rng(1)
    first, second = sorted(classes)
    paths = [f"{first}/a.png", f"{first}/deep/er/b.png", f"{second}/c.png", "x.png", "y.png"]
    for path in paths:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / path)
    (root / "z.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return paths


def test_ignore_labels_predicts_the_images_at_the_root_too(finetuned, tmp_path):
    """--ignore-labels: every image under the folder (its sub-folders are not the classifier's
    classes) is predicted, in a fixed order, or is a skip results.json names."""
    readable = _root_and_classes(tmp_path / "imgs", ["not", "classes"])
    out = tmp_path / "p"
    res = predict("--checkpoint", str(finetuned["run"]), "--source", str(tmp_path / "imgs"),
                  "--output", str(out), "--ignore-labels", "--batch-size", "2")  # fmt: skip
    rows = read_rows(out)
    assert [r["key"] for r in rows] == readable and "true_label" not in rows[0]
    assert res["images"] == 5 and res["skipped"] == 1
    assert [s["key"] for s in res["skipped_images"]] == ["z.png"]
    assert json.loads((out / "results.json").read_text())["skipped"] == 1


def test_a_labelled_folder_predicts_its_root_images_without_a_true_label(finetuned, tmp_path):
    """Class folders named as the classifier's, and images beside them: those are predicted
    too, with no true label (out of top-1: `num_labelled` counts the others); the counts of
    results.json cover every file."""
    names = list(read_classifier_spec(finetuned["run"]).label_names)
    readable = _root_and_classes(tmp_path / "imgs", names[3:5])
    out = tmp_path / "p"
    res = predict("--checkpoint", str(finetuned["run"]), "--source", str(tmp_path / "imgs"),
                  "--output", str(out), "--batch-size", "4", "--workers", "1")  # fmt: skip
    rows = read_rows(out)
    assert [r["key"] for r in rows] == readable
    truth = [p.split("/")[0] if "/" in p else None for p in readable]
    assert [r["true_label"] for r in rows] == truth
    assert res["images"] == 5 and res["num_labelled"] == 3
    assert res["skipped"] == 1 and res["skipped_images"][0]["key"] == "z.png"
    assert sum(map(sum, res["confusion_matrix"])) == 3


# --- issue 48, defect 3: the collectives wait timeouts.dist_s, as the training jobs' ----------


def test_the_collectives_wait_dist_s_and_the_loaders_data_s(finetuned, tmp_path, monkeypatch):
    seen = record_timeouts(monkeypatch)
    common = ["--checkpoint", str(finetuned["run"]), "--source", str(finetuned["test"])]
    predict(*common, "--output", str(tmp_path / "p"), "timeouts.data_s=70", "timeouts.dist_s=990")
    assert seen["dist_s"] == 990 and seen["data_s"]() == 70  # before issue 48: 70 and 70
