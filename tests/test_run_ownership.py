"""A run directory belongs to one job at a time and holds one run (ssl_vit/train/rundir.py):
real jobs on one output_dir, exit codes and the files they leave asserted."""

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import pipeline
from test_distributed import LAUNCH, _free_port
from test_guard import _alive, _exit_within, _launch, _log, _pipeline, _wait_until
from test_pipelines import ROOT, finetune_args, pretrain_args

from ssl_vit.cli import main as cli
from ssl_vit.runs.lock import LOCK_NAME


def _snapshot(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file below `folder` except the lock file."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
    }


def _refused(main, argv, capsys) -> str:
    """The one error line of an in-process job that must not start."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line, line
    return line


@pytest.mark.system
def test_one_job_per_run_dir_and_no_silent_restart(synthetic_shards, tmp_path, capsys):
    out = tmp_path / "run"
    pretrain = pipeline("pretrain")
    base = pretrain_args(synthetic_shards, out, "train.log_every=1", "train.checkpoint_every=2")
    # Job A (width 32) runs; a second job on the same directory fails at once, naming it.
    job_a = _launch(_pipeline("pretrain", *base, "train.steps=100000"), out)
    _wait_until(lambda: (out / "checkpoints" / "step_00000002").is_dir(), job_a, out)
    line = _refused(pretrain, [*base, "model.width=64"], capsys)
    assert "in use by another job" in line and str(out) in line and f"pid {job_a.pid}" in line
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["width"] == 32
    # A SIGKILLed job leaves no lock held; its run is not restarted by accident.
    os.kill(job_a.pid, signal.SIGKILL)
    assert job_a.wait(30) == -signal.SIGKILL
    before = _snapshot(out)
    line = _refused(pretrain, [*base, "train.steps=4"], capsys)
    assert "holds a run" in line and "--resume" in line and "--overwrite" in line, line
    # A failed --resume (another shape) changes nothing a later --resume reads.
    line = _refused(pretrain, [*base, "--resume", "model.width=16"], capsys)
    assert "model.width 32 -> 16" in line, line
    assert _snapshot(out) == before
    # --overwrite starts over: nothing of job A is left to be mixed in.
    assert pretrain([*base, "--overwrite", "train.steps=2"])["step"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((out / "results.json").read_text())["step"] == 2
    # A resume with another lr and length: accepted, each changed key named in a warning.
    capsys.readouterr()
    res = pretrain([*base, "--resume", "train.steps=3", "train.lr=5e-4"])
    err = capsys.readouterr().err
    assert res["step"] == 3
    for key in ("train.steps", "train.lr"):
        assert f"--resume with a changed {key}" in err, err[-2000:]


def test_empty_output_dir_is_refused(synthetic_shards, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _refused(
        pipeline("pretrain"), pretrain_args(synthetic_shards, "", "train.steps=1"), capsys
    )
    assert "output_dir" in line and "empty" in line, line
    assert list(tmp_path.iterdir()) == []


def test_fewshot_and_finetune_dirs_need_overwrite(synthetic_shards, tmp_path, capsys):
    few = tmp_path / "few"
    few.mkdir()
    (few / "results.json").write_text("{}\n")
    argv = [
        "--checkpoint",
        "random",
        "--config",
        str(ROOT / "configs/fewshot/smoke.yaml"),
        f"fewshot.train={synthetic_shards}",
        f"fewshot.eval={synthetic_shards}",
        f"output_dir={few}",
    ]
    line = _refused(pipeline("fewshot"), argv, capsys)
    assert "holds a run" in line and "--overwrite" in line
    assert (few / "results.json").read_text() == "{}\n"
    fine = tmp_path / "fine"
    (fine / "checkpoints" / "step_00000001").mkdir(parents=True)
    ft_argv = [
        *("--config", str(ROOT / "configs/finetune/smoke.yaml")),
        *(f"data.train={synthetic_shards}", f"data.eval={synthetic_shards}"),
        *(f"output_dir={fine}", "init.checkpoint=none"),
    ]
    line = _refused(pipeline("finetune"), ft_argv, capsys)
    assert "holds a run" in line and "--resume" in line


@pytest.mark.system
def test_locked_dir_stops_every_rank(synthetic_shards, tmp_path):
    """With several processes only the main one locks; the others learn it could not and
    exit too (no rank trains, none hangs)."""
    out = tmp_path / "run"
    out.mkdir()
    # (relative path: the holder's command line must not name the run, see _alive)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, LOCK_NAME], stdout=subprocess.PIPE, cwd=out
    )
    assert holder.stdout.readline().strip() == b"locked"
    try:
        argv = [
            *LAUNCH,
            *("--main_process_port", str(_free_port())),
            str(ROOT / "pipelines/pretrain.py"),
            *pretrain_args(synthetic_shards, out, "train.steps=2"),
        ]
        t0 = time.time()
        proc = _launch(argv, out)
        rc, _ = _exit_within(proc, out, 120)
        log = _log(out)
        assert rc != 0, log[-3000:]
        assert "in use by another job" in log and "error: main process: " in log, log[-3000:]
        assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()
        assert not _alive(str(out)), "a rank is still alive"
        print(f"2 ranks on a locked dir -> exit {rc} in {time.time() - t0:.1f}s")
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"pid %d (test holder)" % os.getpid())
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.system
def test_lock_is_released_by_a_dead_process(tmp_path):
    """flock is dropped by the OS when its holder dies, however it died."""
    path = tmp_path / LOCK_NAME
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"locked"
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.kill()
        holder.wait()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once
    finally:
        os.close(fd)


# --- issue 29: no command writes into, replaces or removes what another job owns or reads ------


@pytest.fixture(scope="module")
def pre_run(synthetic_shards, tmp_path_factory) -> Path:
    """A finished 2-step smoke pretraining run (config.yaml, checkpoints/step_00000002, ...)."""
    out = tmp_path_factory.mktemp("pre") / "run"
    pipeline("pretrain")(pretrain_args(synthetic_shards, out, "train.steps=2"))
    return out


def _copy_run(pre_run: Path, dest: Path) -> Path:
    shutil.copytree(pre_run, dest, ignore=shutil.ignore_patterns(LOCK_NAME))
    return dest


def _last_err(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_fewshot_overwrite_never_removes_the_run_it_evaluates(
    pre_run, synthetic_shards, tmp_path, capsys
):
    run = _copy_run(pre_run, tmp_path / "runs" / "x")
    before = _snapshot(run)
    fewshot = pipeline("fewshot")
    for out, how in ((run, "is"), (run / "few", "is inside"), (tmp_path / "runs", "contains")):
        argv = [
            *("--checkpoint", str(run), "--config", str(ROOT / "configs/fewshot/smoke.yaml")),
            *(f"fewshot.train={synthetic_shards}", f"fewshot.eval={synthetic_shards}"),
            *(f"output_dir={out}", "--overwrite"),
        ]
        line = _refused(fewshot, argv, capsys)
        assert f"output_dir={str(out)!r}: {how} --checkpoint=" in line, line
        assert str(run) in line, line
        assert _snapshot(run) == before


def test_resume_into_another_kind_or_shape_writes_nothing(
    pre_run, synthetic_shards, tmp_path, capsys
):
    run = _copy_run(pre_run, tmp_path / "run")
    before = _snapshot(run)
    # A fine-tuning --resume of a pretraining run (same model shape): refused before writing.
    ft_argv = [
        *("--config", str(ROOT / "configs/finetune/smoke.yaml"), "model.image_size=16"),
        *(f"data.train={synthetic_shards}", f"data.eval={synthetic_shards}"),
        *(f"output_dir={run}", "init.checkpoint=none", "--resume"),
    ]
    finetune = pipeline("finetune")
    line = _refused(finetune, ft_argv, capsys)
    assert "holds a pretraining run, not a fine-tuning run" in line and str(run) in line, line
    assert _snapshot(run) == before
    # Fine-tuning a run into its own directory: --overwrite would delete the encoder it reads.
    ft_argv = [*ft_argv[:-2], f"init.checkpoint={run}", "--overwrite"]
    line = _refused(finetune, ft_argv, capsys)
    assert f"output_dir={str(run)!r}: is init.checkpoint=" in line, line
    assert _snapshot(run) == before
    # config.yaml missing: another shape than the checkpoint's is refused and writes nothing,
    # so the right --resume still works afterwards.
    (run / "config.yaml").unlink()
    pretrain = pipeline("pretrain")
    base = pretrain_args(synthetic_shards, run, "--resume")
    line = _refused(pretrain, [*base, "model.width=64"], capsys)
    assert "model.width 32 -> 64" in line and "step_00000002" in line, line
    assert not (run / "config.yaml").exists()
    assert pretrain([*base, "train.steps=3"])["step"] == 3


@pytest.mark.system
def test_export_never_replaces_its_source_a_run_or_a_dataset(
    pre_run, synthetic_shards, tmp_path, capsys
):
    run = _copy_run(pre_run, tmp_path / "run")
    other = _copy_run(pre_run, tmp_path / "other")
    data = Path(shutil.copytree(synthetic_shards, tmp_path / "data"))
    live = tmp_path / "live"  # only a lock, held by a live process
    live.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(live / LOCK_NAME)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        kept = {d: _snapshot(d) for d in (run, other, data)}
        refused = {
            run: f"outdir={str(run)!r}: is checkpoint=",
            run / "hf": f"outdir={str(run / 'hf')!r}: is inside checkpoint=",
            tmp_path: f"outdir={str(tmp_path)!r}: contains checkpoint=",
            other / "checkpoints": "the checkpoints of a run",
            other: "is a run directory",
            data: "is a shard dataset",
            live: "is a run directory",
        }
        for out, message in refused.items():
            assert cli(["export", str(run), "--to", "hf", str(out), "--overwrite"]) == 1, out
            line = _last_err(capsys)
            assert line.startswith("ssl-vit export: error: ") and message in line, line
        assert {d: _snapshot(d) for d in kept} == kept
        assert (live / LOCK_NAME).is_file()
    finally:
        holder.kill()
        holder.wait()
    # An earlier export is still replaced with --overwrite.
    for _ in range(2):
        assert cli(["export", str(run), "--to", "timm", str(tmp_path / "t"), "--overwrite"]) == 0


def test_import_never_writes_into_a_checkpoint_or_run(pre_run, tmp_path, capsys):
    run = _copy_run(pre_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000002"
    weights = tmp_path / "timm"
    assert cli(["export", str(ckpt), "--to", "timm", str(weights)]) == 0
    before = _snapshot(run)
    refused = {
        (ckpt, ""): "is a training checkpoint",
        (ckpt, "--overwrite"): "is a training checkpoint",
        (run, "--overwrite"): "is a run directory",
        (run / "checkpoints" / "step_00000009", ""): "the checkpoints of a run",
        (weights, "--overwrite"): f"outdir={str(weights)!r}: is source=",
    }
    for (out, flag), message in refused.items():
        argv = ["import", str(weights), "--from", "timm", str(out), *([flag] if flag else [])]
        assert cli(argv) == 1, (out, flag)
        line = _last_err(capsys)
        assert line.startswith("ssl-vit import: error: ") and message in line, line
    assert _snapshot(run) == before
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]
    # A new directory; replaced only with --overwrite, staged beside it and renamed.
    out = tmp_path / "imported"
    assert cli(["import", str(weights), "--from", "timm", str(out)]) == 0
    assert cli(["import", str(weights), "--from", "timm", str(out)]) == 1
    assert "pass --overwrite" in _last_err(capsys)
    assert cli(["import", str(weights), "--from", "timm", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["encoder.safetensors", "source.json"]
    assert not list(tmp_path.glob(".imported.*"))


# --- issue 47: --resume of a finished run (a requeued job that had ended) changes nothing ------


def _stamped(folder: Path) -> dict[str, tuple[str, int]]:
    """{relative path: (sha256, mtime in ns)} of every file and folder below `folder`."""
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder",
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
    }


def _resume_finished(main, argv: list[str], run: Path, capsys) -> dict:
    """--resume of the finished run in `run`: its saved results, every file byte-identical and
    untouched, one line saying so."""
    before = _stamped(run)
    capsys.readouterr()
    res = main([*argv, "--resume"])
    assert res == json.loads((run / "results.json").read_text())
    assert _stamped(run) == before
    n = res["step"]
    line = f"{run}: finished at step {n}/{n}; nothing to resume (results.json kept)"
    assert capsys.readouterr().err.count(line) == 1
    return res


def test_resume_of_a_finished_pretraining_changes_nothing(
    pre_run, synthetic_shards, tmp_path, capsys
):
    run = _copy_run(pre_run, tmp_path / "run")
    argv = pretrain_args(synthetic_shards, run, "train.steps=2")
    res = _resume_finished(pipeline("pretrain"), argv, run, capsys)
    assert res["loss"] is not None and res["color_acc"] is not None


@pytest.mark.system
def test_every_rank_ends_a_resume_of_a_finished_run_alike(pre_run, synthetic_shards, tmp_path):
    """2 processes (a requeued `slurm_pretrain.sh`): each reads results.json before any
    collective, all exit 0 at once, one line, nothing written."""
    run = _copy_run(pre_run, tmp_path / "run")
    before = _stamped(run)
    job = [str(ROOT / "pipelines/pretrain.py"), *pretrain_args(synthetic_shards, run), "--resume"]
    argv = [*LAUNCH, "--main_process_port", str(_free_port()), *job, "train.steps=2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("finished at step 2/2; nothing to resume") == 1, proc.stderr[-3000:]
    assert _stamped(run) == before


@pytest.fixture(scope="module")
def ft_runs(pre_run, synthetic_shards, tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """Finished 2-step smoke fine-tunes, {name: (run directory, its arguments)}: one of the
    pretrained encoder with an evaluation split ("ft", its shape left to the checkpoint), a
    self-training one taught by it ("st")."""
    root, shards = tmp_path_factory.mktemp("ft"), synthetic_shards
    short = ("train.steps=2", "train.log_every=1", "eval_every=0")
    ft = (f"init.checkpoint={pre_run}", f"data.eval={shards}")
    taught = (f"distill.teacher={root / 'ft'}", f"distill.unlabelled={shards}")
    runs = {}
    for name, more in (("ft", ft), ("st", taught)):
        runs[name] = root / name, finetune_args(shards, root / name, *short, *more)
        pipeline("finetune")(runs[name][1])
    return runs


@pytest.mark.parametrize("name", ["ft", "st"])
def test_resume_of_a_finished_fine_tune_changes_nothing(ft_runs, name, tmp_path, capsys):
    src, argv = ft_runs[name]
    run = _copy_run(src, tmp_path / name)
    argv = [*argv, f"output_dir={run}"]  # (the last value of a key wins)
    res = _resume_finished(pipeline("finetune"), argv, run, capsys)
    assert res["train_loss"] is not None and ("distill" in res) == (name == "st")


def _selection_folder(folder: Path) -> None:
    """What `ssl-vit select` leaves (eval/select_output.py), with a label the user sorted."""
    from ssl_vit.config.loader import save_config
    from ssl_vit.config.select import SelectConfig

    folder.mkdir()
    cfg = SelectConfig(checkpoint="runs/x", source="images", output_dir=str(folder), budget=2)
    save_config(cfg, folder / "config.yaml")
    (folder / "selection.jsonl").write_text('{"rank": 1, "key": "a"}\n{"rank": 2, "key": "b"}\n')
    (folder / "metrics.jsonl").write_text('{"picked": 2}\n')
    (folder / "results.json").write_text('{"budget": 2}\n')
    (folder / "to-label" / "cat").mkdir(parents=True)
    (folder / "to-label" / "cat" / "0001-a.png").write_bytes(b"sorted by the user")


def test_a_selection_is_never_resumed_or_overwritten_by_a_run(synthetic_shards, tmp_path, capsys):
    """A select folder holds the user's labelling (to-label/) and the picks a next round
    extends: --resume, --overwrite or neither of a training job all leave it as it was."""
    picks = tmp_path / "picks"
    _selection_folder(picks)
    before = _snapshot(picks)
    for flags in (["--resume"], ["--overwrite"], []):
        argv = pretrain_args(synthetic_shards, picks, "train.steps=1", *flags)
        line = _refused(pipeline("pretrain"), argv, capsys)
        assert f"output_dir='{picks}': holds a select run" in line, line
        assert "another output_dir" in line, line
        assert _snapshot(picks) == before


def test_another_jobs_run_is_not_offered_to_resume(synthetic_shards, tmp_path, capsys):
    """A fine-tune's run directory given to pretraining: the line names its kind and offers
    --overwrite or another folder, never --resume (which refuses another kind of run)."""
    fine = tmp_path / "fine"
    fine.mkdir()
    (fine / "config.yaml").write_text(yaml.safe_dump({"init": {"checkpoint": "none"}}))
    (fine / "results.json").write_text("{}\n")
    line = _refused(pipeline("pretrain"), pretrain_args(synthetic_shards, fine), capsys)
    assert "holds a fine-tuning run (config.yaml, results.json)" in line, line
    assert "--overwrite" in line and "another output_dir" in line and "--resume" not in line
    assert (fine / "results.json").read_text() == "{}\n"


def test_a_run_is_never_written_into_a_dataset(synthetic_shards, tmp_path, capsys):
    """A shard dataset as output_dir, or a folder inside a folder source: refused with or
    without --resume / --overwrite, nothing written (a run's files in an image folder would
    be read back as a class of it)."""
    from PIL import Image

    before = _snapshot(synthetic_shards)
    for flags in ([], ["--resume"], ["--overwrite"]):
        argv = pretrain_args(synthetic_shards, synthetic_shards, "train.steps=1", *flags)
        line = _refused(pipeline("pretrain"), argv, capsys)
        assert f"output_dir='{synthetic_shards}': holds a shard dataset" in line, line
        assert _snapshot(synthetic_shards) == before
    photos = tmp_path / "photos"
    for k, cls in enumerate(("cat", "dog")):
        (photos / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (16, 16), (90 * k, 40 * i, 9)).save(photos / cls / f"{i}.png")
    before = _snapshot(photos)
    for flags in ([], ["--resume"], ["--overwrite"]):
        argv = finetune_args(photos, photos / "run", "train.steps=1", *flags)
        line = _refused(pipeline("finetune"), argv, capsys)
        assert f"output_dir='{photos / 'run'}': is inside data.train='{photos}'" in line, line
        assert _snapshot(photos) == before and not (photos / "run").exists()
    # Beside the data, or in a folder that holds it, a run starts as before.
    assert pipeline("finetune")(finetune_args(photos, tmp_path / "run", "train.steps=1"))
