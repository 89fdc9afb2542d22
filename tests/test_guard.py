"""No job ever hangs: real subprocesses hit by real faults must exit, non-zero where they
failed, within a bound, leaving no process behind; bad inputs stop them before step 1."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_python
from test_distributed import LAUNCH
from test_pipelines import ROOT, pretrain_args

from ssl_vit import errors
from ssl_vit.train.checkpoint import latest_valid_checkpoint

BOUND_S = 60  # the bound for a dead loader worker; every fault here must meet it


def _launch(argv: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    # Output to files, not pipes: a grandchild left running must not keep the test waiting.
    log = open(out.parent / f"{out.name}.log", "wb")  # noqa: SIM115 - closed by the process end
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def _log(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")


def _pipeline(name: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "pipelines" / f"{name}.py"), *args]


def _finetune_args(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs/finetune/smoke.yaml"),
        f"data.train={shards}",
        f"data.eval={shards}",
        f"output_dir={out}",
        *extra,
    ]


def _wait_until(cond, proc: subprocess.Popen, out: Path, timeout: float = 120) -> None:
    end = time.time() + timeout
    while not cond():
        assert proc.poll() is None, _log(out)[-3000:]
        assert time.time() < end, "timed out waiting: " + _log(out)[-3000:]
        time.sleep(0.05)


def _exit_within(proc: subprocess.Popen, out: Path, bound: float = BOUND_S) -> tuple[int, float]:
    t0 = time.time()
    try:
        rc = proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {bound}s after the fault (a hang): {_log(out)[-3000:]}")
    return rc, time.time() - t0


def _alive(marker: str) -> list[int]:
    """Pids of processes whose command line mentions `marker` (a run's unique directory)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.system
@pytest.mark.parametrize("job", ["pretrain", "finetune"])
def test_killed_loader_worker_ends_the_job(job, synthetic_shards, tmp_path):
    out = tmp_path / "run"
    common = ["train.steps=100000", "train.log_every=1", "data.num_workers=2"]
    if job == "pretrain":
        argv = _pipeline(job, *pretrain_args(synthetic_shards, out, *common))
    else:
        argv = _pipeline(job, *_finetune_args(synthetic_shards, out, *common, "eval_every=0"))
    proc = _launch(argv, out)
    _wait_until(lambda: _steps_logged(out) >= 2, proc, out)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)  # as the OOM killer would
    rc, seconds = _exit_within(proc, out)
    log = _log(out)
    assert rc == 1, log[-3000:]
    # Whichever error the main process sees first (DataLoader's worker check, or a reset
    # connection to the dead worker), the one error line names the dead worker by pid.
    last = log.rstrip().splitlines()[-1]
    assert last.startswith("error: "), log[-3000:]
    names_worker = (
        f"DataLoader worker (pid(s) {workers[0]}) exited unexpectedly",
        f"DataLoader worker (pid {workers[0]}) is killed by signal",
        f"pid {workers[0]} (SIGKILL)",
    )
    assert any(n in last for n in names_worker), log[-3000:]
    assert "Traceback" not in log, log[-3000:]  # the cause is named: one line, no trace
    assert not _alive(str(out)), "a process of the run is still alive"
    print(f"{job}: killed worker -> exit {rc} in {seconds:.1f}s")


@pytest.mark.system
def test_a_worker_is_quiet_about_the_main_process_gone_and_prints_anything_else():
    """With a worker killed, the main process ends while another worker's fd-sharing thread
    (multiprocessing.resource_sharer) hands it a batch: that thread printed a
    ConnectionResetError traceback above the job's one error line (seen once in CI). In a real
    loader worker, the report of such an error is quiet; any other is printed as before."""
    code = (
        "import sys, torch\n"
        "from ssl_vit.data.stages import _init_worker\n"
        "class Reports(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        for e in (ConnectionResetError(104, 'reset by peer'), BrokenPipeError(32, 'pipe'),"
        " ValueError('a bug')):\n"
        "            try:\n"
        "                raise e\n"
        "            except Exception:\n"
        "                sys.excepthook(*sys.exc_info())  # as resource_sharer._serve does\n"
        "        yield 1\n"
        "loader = torch.utils.data.DataLoader(Reports(), batch_size=None, num_workers=1,"
        " worker_init_fn=_init_worker)\n"
        "print(list(loader))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0 and proc.stdout == "[1]\n", proc.stderr
    assert "ValueError: a bug" in proc.stderr and "Traceback" in proc.stderr
    assert "ConnectionResetError" not in proc.stderr and "BrokenPipeError" not in proc.stderr


@pytest.mark.system
def test_exception_after_the_last_step_exits_with_checkpoint_named(synthetic_shards, tmp_path):
    out = tmp_path / "run"
    (out / "results.json").mkdir(parents=True)  # writing the results fails after the last step
    args = pretrain_args(synthetic_shards, out, "train.steps=6", "data.num_workers=2")
    t0 = time.time()
    proc = _launch(_pipeline("pretrain", *args), out)
    rc, _ = _exit_within(proc, out, 120)
    last = _log(out).rstrip().splitlines()[-1]
    assert rc == 1
    assert last.startswith("error: IsADirectoryError:") and "step_00000006" in last, last
    assert not _alive(str(out))
    print(f"exception after the last step -> exit {rc} in {time.time() - t0:.1f}s in all")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.system
def test_failing_rank_ends_every_rank(synthetic_shards, tmp_path):
    out = tmp_path / "run"
    (out / "keys_rank1.txt").mkdir(parents=True)  # rank 1 fails at its first batch, rank 0 not
    argv = [
        *LAUNCH,  # the venv's `accelerate launch`, 2 processes, no mixed precision
        *("--main_process_port", str(_free_port())),
        str(ROOT / "pipelines/pretrain.py"),
        *pretrain_args(synthetic_shards, out, "train.steps=1000", "data.record_keys=true"),
    ]
    t0 = time.time()
    proc = _launch(argv, out)
    rc, _ = _exit_within(proc, out, 120)
    seconds = time.time() - t0
    assert rc != 0
    assert "IsADirectoryError" in _log(out)
    assert not _alive(str(out)), "a rank is still alive"
    print(f"one rank raising -> launcher exit {rc} in {seconds:.1f}s from the start")


@pytest.mark.system
def test_sigterm_during_final_evaluation(synthetic_shards, tmp_path):
    out = tmp_path / "run"
    shard = sorted(synthetic_shards.glob("*.tar"))[0]
    # The evaluation split is read only by the final evaluation: its command first leaves a
    # marker (the job is inside the evaluation, the final checkpoint written), then holds the
    # data back, far longer than the test waits (the sleep dies with the process group).
    opened = tmp_path / "eval_opened"
    slow_eval = f"pipe:touch {opened}; sleep 600; cat {shard}"
    few = [f"fewshot.train={synthetic_shards}", f"fewshot.eval={slow_eval}", "fewshot.shots=[1]"]
    args = pretrain_args(synthetic_shards, out, "train.steps=4", *few)
    proc = _launch(_pipeline("pretrain", *args), out)
    try:
        _wait_until(opened.exists, proc, out)  # inside the evaluation: an event, not a delay
        assert _final(out), _log(out)[-3000:]
        os.killpg(proc.pid, signal.SIGTERM)  # the whole process group, as a scheduler does
        rc, seconds = _exit_within(proc, out, 30)
    finally:  # a failure above leaves neither the job nor its sleep behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, _log(out)[-3000:]  # preempted after the final checkpoint: resumable
    assert "SIGTERM received" in _log(out) and not (out / "results.json").exists()
    assert latest_valid_checkpoint(out / "checkpoints").name == "step_00000004"
    print(f"SIGTERM during the final evaluation -> exit {rc} in {seconds:.1f}s")
    # --resume repeats only the final evaluation (now with a fast eval split).
    fast = [f"fewshot.eval={synthetic_shards}", "--resume"]
    proc = _launch(_pipeline("pretrain", *args, *fast), out)
    rc, _ = _exit_within(proc, out, 120)
    results = json.loads((out / "results.json").read_text())
    assert rc == 0 and results["step"] == 4 and "1shot" in results["fewshot"]["summary"]


def _final(out: Path) -> bool:
    return (out / "checkpoints/step_00000004/manifest.json").is_file()


@pytest.mark.parametrize(
    "job, key",
    [("pretrain", "fewshot.train"), ("pretrain", "fewshot.eval"), ("finetune", "data.eval")],
)
def test_missing_source_stops_before_step_one(job, key, synthetic_shards, tmp_path):
    """In this process (the one line a launched job prints is its SystemExit's message: the
    launched-job tests above and tests/test_bad_inputs.py check that path)."""
    from test_pipelines import pipeline

    out, missing = tmp_path / "run", str(tmp_path / "nowhere")
    if job == "pretrain":
        few = [f"fewshot.train={synthetic_shards}", f"fewshot.eval={synthetic_shards}"]
        args = pretrain_args(synthetic_shards, out, *few, f"{key}={missing}")
    else:
        args = _finetune_args(synthetic_shards, out, f"{key}={missing}")
    with pytest.raises(SystemExit) as stop:
        pipeline(job)(args)
    assert str(stop.value) == f"error: {key}={missing!r}: image source not found: {missing}"
    assert not (out / "metrics.jsonl").exists()  # no step was taken


@pytest.mark.parametrize("value", ["", "nowhere", "empty_dir"])
def test_finetune_init_checkpoint_must_exist(value, synthetic_shards, tmp_path):
    """An empty value (a failed shell substitution) or a path without a valid checkpoint is an
    error, never a silent run from random init (that is `init.checkpoint=none`)."""
    from test_pipelines import pipeline

    if value:
        value = str(tmp_path / value)
    if value.endswith("empty_dir"):
        Path(value).mkdir()
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^error: init\.checkpoint"):
        pipeline("finetune")(_finetune_args(synthetic_shards, out, f"init.checkpoint={value}"))
    assert not (out / "metrics.jsonl").exists()


def test_a_library_stop_is_the_jobs_one_error_line_and_exit_1(capsys):
    """Library code raises (TooManyBadStepsError), it does not exit: the guard maps it."""
    from ssl_vit.train import guard
    from ssl_vit.train.loop import TooManyBadStepsError

    e = TooManyBadStepsError("at least 3 steps in a row ...; Last good checkpoint: ck/step_4")
    assert guard._report(e) == guard.EXIT_ERROR
    err = capsys.readouterr().err
    assert err == "error: at least 3 steps in a row ...; Last good checkpoint: ck/step_4\n"


def _raise(exc: BaseException) -> None:
    raise exc  # the line a traceback names


def _reported(exc: BaseException, capsys, monkeypatch) -> tuple[int, str]:
    """What `run_and_exit` prints and exits with for a job that raised `exc` (its `_report`,
    in this process: the decision between one line and a traceback is made there), for a job
    with no checkpoint folder (another test in this process may have noted one)."""
    from ssl_vit.train import guard

    monkeypatch.setattr(guard, "_checkpoint_root", None)
    try:
        _raise(exc)
    except BaseException as e:  # noqa: BLE001
        code = guard._report(e)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "exc, last",
    [
        (ValueError("boom"), "error: ValueError: boom"),
        (KeyError("k"), "error: KeyError: 'k'"),
        (TypeError("bad call"), "error: TypeError: bad call"),
    ],
)
def test_a_bug_in_a_job_prints_its_traceback_then_one_line(exc, last, capsys, monkeypatch):
    """A builtin ValueError / KeyError / TypeError is a programming error, not a bad input: its
    traceback (naming the raising line) comes first, then the one error line, exit 1."""
    code, err = _reported(exc, capsys, monkeypatch)
    assert code == 1
    assert "Traceback (most recent call last)" in err, err
    assert "raise exc  # the line a traceback names" in err, err
    assert err.rstrip().splitlines()[-1] == last, err


@pytest.mark.parametrize(
    "exc, line",
    [
        (errors.ConfigError("train.steps: expected int"), "ConfigError: train.steps: expected"),
        (errors.InputError("photos/: no images found"), "InputError: photos/: no images found"),
        (errors.CheckpointError("no encoder at x"), "CheckpointError: no encoder at x"),
        (FileNotFoundError(2, "No such file", "x.yaml"), "FileNotFoundError: [Errno 2]"),
    ],
)
def test_a_user_error_in_a_job_is_one_line_and_exit_1(exc, line, capsys, monkeypatch):
    code, err = _reported(exc, capsys, monkeypatch)
    assert code == 1
    assert err.startswith(f"error: {line}") and err.count("\n") == 1, err


def test_one_line_errors_passes_a_bug_through():
    """`one_line_errors` turns a user error into its one line and leaves a bug's exception (and
    traceback) as it is."""
    from ssl_vit.errors import InputError
    from ssl_vit.train.guard import one_line_errors

    with pytest.raises(SystemExit, match=r"^error: photos/: no images$"), one_line_errors():
        raise InputError("photos/: no images")
    with pytest.raises(ValueError, match="^boom$"), one_line_errors():
        raise ValueError("boom")


class _Endless(torch.utils.data.IterableDataset):
    """0, 1, 2, ... from each worker, slowly: a loader still running when a worker is killed."""

    def __iter__(self):
        i = 0
        while True:
            time.sleep(0.01)
            yield i
            i += 1


@pytest.mark.system
def test_a_killed_worker_of_any_loader_is_named_after_the_loader_closed():
    """Every WorkerLoader (predict's, select's, the eval stream's, not only training's) is
    known to the watchdog: a worker a signal ended is named in the job's error line even once
    the loader has closed and joined its workers (predict printed a traceback instead)."""
    from ssl_vit.data.stages import WorkerLoader
    from ssl_vit.watchdog import dead_workers

    loader = WorkerLoader(_Endless(), batch_size=None, num_workers=2)
    it = iter(loader)
    next(it)
    victim = it._workers[0]
    # DataLoader's SIGCHLD handler raises here, in the main thread, as it does in a job.
    with contextlib.suppress(RuntimeError):
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        time.sleep(0.5)  # the pending handler runs inside this block
    loader.close()  # as predict's `finally` does before the error reaches the guard
    assert f"pid {victim.pid} (SIGKILL)" in dead_workers()


class _Finalized:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __del__(self) -> None:
        raise self.exc  # as DataLoader's SIGCHLD handler does when it runs inside a finalizer


def test_a_dead_worker_seen_inside_a_finalizer_is_one_line_and_a_bug_there_keeps_its_trace(
    capsys, caplog, monkeypatch
):
    """The CI failure of 2026-11-29: the SIGCHLD handler fired inside a tempfile's `__del__`,
    and Python printed "Exception ignored in ..." with a traceback before the job's error line.
    """
    from ssl_vit.train import guard

    monkeypatch.setattr(sys, "unraisablehook", guard._quiet_dead_worker(sys.__unraisablehook__))
    killed = RuntimeError("DataLoader worker (pid 28929) is killed by signal: Killed. ")
    _Finalized(killed)  # dropped at once: its __del__ raises
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    (warning,) = [r.getMessage() for r in caplog.records if r.name == guard.__name__]
    assert warning.startswith("DataLoader worker (pid 28929) is killed by signal: Killed."), warning
    _Finalized(ValueError("a bug in a finalizer"))
    err = capsys.readouterr().err
    assert "Exception ignored" in err and "Traceback" in err and "a bug in a finalizer" in err
