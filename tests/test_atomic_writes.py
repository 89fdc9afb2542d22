"""Nothing a failed or killed job leaves behind breaks the next one (ssl_vit/atomic.py,
watchdog.py): datasets and exports are renamed into place, logs survive a torn last line,
every checkpoint read is verified, a stalled source or a stuck stop ends the job."""

import errno
import hashlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import pipeline
from PIL import Image
from test_guard import _alive, _exit_within, _launch, _log, _pipeline, _wait_until
from test_pipelines import pretrain_args

import ssl_vit.atomic as ssl_atomic
from ssl_vit.atomic import WriteError, read_jsonl
from ssl_vit.cli import main as cli
from ssl_vit.config import ConfigError
from ssl_vit.datasets.synthetic import make_synthetic_shards
from ssl_vit.train import preflight
from ssl_vit.train.checkpoint import load_checkpoint
from ssl_vit.train.metrics import MetricsWriter

SSL_VIT = [sys.executable, "-m", "ssl_vit.cli"]


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(target: Path) -> list[str]:
    return [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def trained(synthetic_shards, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("trained") / "run"
    args = pretrain_args(synthetic_shards, out, "train.steps=4", "train.checkpoint_every=2")
    pipeline("pretrain")([*args, "train.log_every=1"])
    return out


# --- make-shards ------------------------------------------------------------------------


def test_failed_make_shards_keeps_the_dataset(tmp_path, capsys):
    data = tmp_path / "data"
    make_synthetic_shards(data, n=8, image_size=16, seed=0, shard_size=4)
    before = _snapshot(data)
    bad = tmp_path / "bad" / "cls"
    bad.mkdir(parents=True)
    for i in range(3):
        (bad / f"{i}.png").write_bytes(b"not a png")
    argv = ["make-shards", "--source", str(bad.parent), "--output", str(data), "--overwrite"]
    assert cli(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssl-vit make-shards: error: all 3 images"), err
    assert _snapshot(data) == before and _leftovers(data) == []


# `ssl-vit` whose read of the image file zzz.png never returns (a stalled network file
# system; a FIFO no longer does it: make-shards skips what is not a regular file).
STALLED_READ = """import sys, threading
from ssl_vit.cli import main
from ssl_vit.data import sources
read = sources.FolderSource.__getitem__
def stalled(self, i):
    if self.files[i].endswith("zzz.png"):
        threading.Event().wait()
    return read(self, i)
sources.FolderSource.__getitem__ = stalled
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.system
def test_killed_make_shards_keeps_the_dataset(tmp_path):
    data = tmp_path / "data"
    make_synthetic_shards(data, n=8, image_size=16, seed=0, shard_size=4)
    before = _snapshot(data)
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(7):  # zzz.png, read last (--no-shuffle): make-shards blocks there
        (src / ("zzz.png" if i == 6 else f"img{i}.png")).write_bytes(_png((40 * i, 0, 0)))
    args = ["make-shards", "--source", str(src.parent), "--output", str(data), "--overwrite"]
    stalled = [sys.executable, "-c", STALLED_READ, *args, "--shard-size", "1", "--no-shuffle"]
    proc = subprocess.Popen(stalled, start_new_session=True)
    try:
        _wait_until(
            lambda: len(list(tmp_path.glob(".data.staging-*/shard-*.tar"))) >= 5, proc, data
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _snapshot(data) == before  # not one old shard replaced, no new one mixed in
    assert _leftovers(data)  # the killed run's staging directory ...
    os.unlink(src / "zzz.png")
    subprocess.run([*SSL_VIT, *args, "--shard-size", "4"], check=True, capture_output=True)
    assert _leftovers(data) == []  # ... is removed by the next run
    index = json.loads((data / "index.json").read_text())
    assert index["num_samples"] == 6
    assert sorted(p.name for p in data.glob("*.tar")) == [s["name"] for s in index["shards"]]


# --- export and checkpoint reads ---------------------------------------------------------


def test_export_needs_overwrite_and_replaces_whole(trained, tmp_path, capsys):
    ckpt = trained / "checkpoints" / "step_00000004"
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli(["export", str(ckpt), "--to", "timm", str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert cli(["export", str(ckpt), "--to", "hf", str(out), "--overwrite"]) == 0
    hf = {p.name for p in out.iterdir()}
    assert hf == {"model.safetensors", "config.json", "preprocessor_config.json", "README.md"}
    assert cli(["export", str(ckpt), "--to", "timm", str(out), "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "README.md"}
    assert _leftovers(out) == []


@pytest.mark.system
def test_export_that_fails_writing_keeps_the_folder(trained, tmp_path):
    """A full disk mid-export (a file-size limit: writes fail with EFBIG) leaves the old
    export as it was, with one error line naming the folder."""
    ckpt = trained / "checkpoints" / "step_00000004"
    out = tmp_path / "export"
    assert cli(["export", str(ckpt), "--to", "timm", str(out)]) == 0  # here; the full disk not
    before = _snapshot(out)
    limit = 20_000  # bytes: config and card fit, the weights do not

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        [*SSL_VIT, "export", str(ckpt), "--to", "hf", str(out), "--overwrite"],
        capture_output=True,
        text=True,
        preexec_fn=small_disk,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ssl-vit export: error: cannot write") and str(out) in last, last
    assert _snapshot(out) == before and _leftovers(out) == []


@pytest.mark.system
def test_corrupt_checkpoint_is_refused_everywhere(trained, tmp_path, capsys):
    ckpt = tmp_path / "step_00000004"
    subprocess.run(["cp", "-r", str(trained / "checkpoints" / "step_00000004"), str(ckpt)])
    weights = ckpt / "encoder.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit in a weight: safetensors still reads it
    weights.write_bytes(bytes(data))
    # export, named by directory and by file
    for named in (ckpt, weights):
        assert cli(["export", str(named), "--to", "timm", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "checksum mismatch" in err and str(ckpt) in err, err
    assert not (tmp_path / "x").exists()
    # few-shot and fine-tuning load through the same check
    from ssl_vit.config.schema import ModelConfig

    for named in (ckpt, weights):
        with pytest.raises(ConfigError, match="checksum mismatch"):
            preflight.load_init_encoder(
                "init.checkpoint", str(named), ModelConfig(), "bicubic", "auto"
            )


# --- append-only logs --------------------------------------------------------------------


@pytest.mark.system
def test_torn_last_metrics_line_is_dropped_on_resume(synthetic_shards, trained, tmp_path, capfd):
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(run)], check=True)
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "loss": 0.1')  # the disk filled mid-line
    args = pretrain_args(synthetic_shards, run, "--resume", "train.checkpoint_every=2")
    pipeline("pretrain")([*args, "train.log_every=1", "train.steps=6"])
    assert f"{metrics}: dropping its torn last line 5" in capfd.readouterr().err
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]
    # A corrupt line in the middle is corruption, not a torn write: one line naming file:line.
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:10]
    metrics.write_text("\n".join(lines) + "\n")
    # (a ValueError: guard.run_and_exit prints it as the job's one error line)
    with pytest.raises(ValueError, match=f"^{metrics}:2: corrupt line"):
        pipeline("pretrain")([*args, "train.steps=8"])


def test_metrics_write_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path)
    real_open = open

    def full_disk(path, *a, **k):
        if str(path).endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(WriteError, match=f"cannot write {tmp_path / 'metrics.jsonl'}: No space"):
        writer.log({"step": 1, "loss": 0.5})


@pytest.mark.system
def test_checkpoint_on_a_full_disk_is_one_line(synthetic_shards, tmp_path):
    out = tmp_path / "run"
    limit = 40_000  # bytes: config and metrics fit, the checkpoint's files do not

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = pretrain_args(synthetic_shards, out, "train.steps=2", "train.checkpoint_every=1")
    proc = subprocess.run(
        _pipeline("pretrain", *args), capture_output=True, text=True, preexec_fn=small_disk
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("error: WriteError: cannot write") and "step_00000001" in last, last
    assert "Traceback" not in proc.stderr
    assert list((out / "checkpoints").iterdir()) == []  # no partial checkpoint left


@pytest.mark.system
@pytest.mark.parametrize("limit", [10_000, 200_000])  # bytes: the RNG file / the state fails
def test_torch_save_on_a_full_disk_keeps_the_last_checkpoint(synthetic_shards, tmp_path, limit):
    """torch.save's own failure ("[enforce fail at inline_container.cc]") is one line too,
    and the checkpoint before it is untouched."""
    out = tmp_path / "run"
    args = pretrain_args(synthetic_shards, out, "train.checkpoint_every=1")
    pipeline("pretrain")([*args, "train.steps=1"])  # here; the full disk in a process of its own
    kept = out / "checkpoints" / "step_00000001"
    before = _snapshot(kept)

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        _pipeline("pretrain", *args, "train.steps=2", "--resume"),
        capture_output=True,
        text=True,
        preexec_fn=small_disk,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert last.startswith("error: WriteError:"), last
    assert f"cannot write {out / 'checkpoints' / 'step_00000002'}:" in last, last
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr, proc.stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == [kept.name]
    assert _snapshot(kept) == before
    assert load_checkpoint(kept)["step"] == 1


# --- stalls and stuck stops --------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to: reading it blocks forever (a stalled source)."""
    path = tmp_path / "stalled.fifo"
    os.mkfifo(path)
    yield path
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # lets a reader left blocked on it go
    os.close(fd)


def _stalled_source(args: list[str], fifo: Path, opened: Path) -> list[str]:
    """`args` reading the training data from `fifo`, which nobody writes: the source's command
    first creates `opened` (the job is reading the source now), then blocks forever."""
    source = f"data.train_shards=pipe:touch {opened}; cat {fifo}"
    return [source if a.startswith("data.train_shards=") else a for a in args]


@pytest.mark.system
@pytest.mark.parametrize("workers", [0, 2])
def test_stalled_source_ends_the_job(synthetic_shards, fifo, tmp_path, workers):
    """The 3 s are the watchdog under test, not a guess at how long anything takes: the read
    never returns, so on any machine the job can only end by the watchdog."""
    out, opened = tmp_path / "run", tmp_path / "source_opened"
    args = _stalled_source(pretrain_args(synthetic_shards, out, "timeouts.data_s=3"), fifo, opened)
    t0 = time.time()
    proc = _launch(_pipeline("pretrain", *args, f"data.num_workers={workers}"), out)
    rc, _ = _exit_within(proc, out, 60)
    last = _log(out).rstrip().splitlines()[-1]
    assert rc == 1, _log(out)[-3000:]
    assert last.startswith("error: no batch from the training data for 3s"), last
    assert opened.exists()  # it was the source that stalled (not, say, a worker's start-up)
    assert not _alive(str(out))
    print(f"stalled source, {workers} workers -> exit {rc} in {time.time() - t0:.1f}s")


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.system
@pytest.mark.parametrize("workers", [0, 2])
def test_stalled_pipe_command_dies_with_the_job(synthetic_shards, tmp_path, workers):
    """A `pipe:` command's own child (here `sleep`, which would outlive its shell) is killed
    with the command's whole process group when the stalled job ends."""
    out, pidfile = tmp_path / "run", tmp_path / "child.pid"
    source = f"data.train_shards=pipe:sh -c 'sleep 600 & echo $! > {pidfile}; wait'"
    args = pretrain_args(synthetic_shards, out, "timeouts.data_s=3")
    args = [source if a.startswith("data.train_shards=") else a for a in args]
    proc = _launch(_pipeline("pretrain", *args, f"data.num_workers={workers}"), out)
    rc, _ = _exit_within(proc, out, 60)  # a failure limit, not a timing claim
    assert rc == 1, _log(out)[-3000:]
    assert _log(out).rstrip().splitlines()[-1].startswith("error: no batch"), _log(out)[-3000:]
    pid = int(pidfile.read_text())
    end = time.time() + 10  # SIGKILLed before the job exited; this only lets it be delivered
    while _running(pid) and time.time() < end:
        time.sleep(0.05)
    left = _running(pid)
    if left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the pipe command's child {pid} outlived the job"


def _catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGTERM (the training loop's StopRequest)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.system
def test_stop_that_times_out_exits(synthetic_shards, fifo, tmp_path):
    """The 2 s are the stop timeout under test: the step waits on a read that never returns,
    so on any machine the graceful stop can only be cut short."""
    out, opened = tmp_path / "run", tmp_path / "source_opened"
    args = pretrain_args(synthetic_shards, out, "timeouts.stop_s=2", "data.num_workers=2")
    proc = _launch(_pipeline("pretrain", *_stalled_source(args, fifo, opened)), out)
    # A worker reads the source: the loop's block, entered after its stop handler, is running.
    _wait_until(opened.exists, proc, out)
    assert _catches_sigterm(proc.pid)  # the loop's handler is in
    proc.send_signal(signal.SIGTERM)
    rc, seconds = _exit_within(proc, out, 60)
    log = _log(out)
    assert rc == 1, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("error: the job did not stop within 2s"), log
    assert "signal only works in main thread" not in log
    assert not _alive(str(out))
    print(f"stuck stop -> exit {rc} {seconds:.1f}s after SIGTERM")


DEAD_WORKER = """
import multiprocessing, os, signal, time
from ssl_vit.train.guard import run_and_exit

def main(argv):
    p = multiprocessing.Process(target=time.sleep, args=(60,), daemon=True)
    p.start()
    print(p.pid, flush=True)
    os.kill(p.pid, signal.SIGKILL)
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
    raise ConnectionResetError(104, "Connection reset by peer")

run_and_exit(main)
"""


@pytest.mark.system
def test_error_line_names_a_dead_worker_whatever_surfaced():
    """The worker-killed race of test_guard made deterministic: the main process sees a reset
    connection before DataLoader's own check; the error line still names the dead worker."""
    proc = subprocess.run([sys.executable, "-c", DEAD_WORKER], capture_output=True, text=True)
    pid = proc.stdout.split()[0]
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1
    assert last.startswith("error: ConnectionResetError:") and f"pid {pid} (SIGKILL)" in last, last


# --- the building blocks, in-process ---------------------------------------------------


def test_staged_dir_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "t"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), ssl_atomic.staged_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError("failed half way")
    assert [p.name for p in target.iterdir()] == ["old.txt"] and _leftovers(target) == []
    # Without renameat2 (two renames): both ways give the new contents only.
    for exchange in (True, False):
        if not exchange:
            monkeypatch.setattr(ssl_atomic, "_exchange", lambda a, b: False)
        with ssl_atomic.staged_dir(target) as tmp:
            (tmp / f"new{exchange}.txt").write_text("new")
        assert [p.name for p in target.iterdir()] == [f"new{exchange}.txt"]
        assert _leftovers(target) == []


@pytest.mark.system
def test_a_swap_cut_short_is_undone(tmp_path):
    """Killed between the two renames: the old directory is set aside, the target is gone;
    the next writer puts the old one back before anything else."""
    target = tmp_path / "t"
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = tmp_path / f".t.old-{dead.pid}"
    old.mkdir()
    (old / "index.json").write_text("{}")
    staging = tmp_path / f".t.staging-{dead.pid}"
    staging.mkdir()
    ssl_atomic.clean_staging(target)
    assert (target / "index.json").read_text() == "{}" and _leftovers(target) == []


def test_read_jsonl_torn_last_line_and_corrupt_middle(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert f"{path}: dropping its torn last line 3" in caplog.text
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"^{path}:2: corrupt line"):
        read_jsonl(path)
