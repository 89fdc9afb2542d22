"""A parent that dies takes its children (ssl_vit.children): a job the study started in its own
session dies when the study is SIGKILLed (PR_SET_PDEATHSIG), and the study kills a running job
on every way out of `run_jobs` that it sees itself. Real subprocesses."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_study import REPO, load_study

from ssl_vit import jobs

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl: Linux"),
]

# A job that runs until killed, writing its pid first (it ignores SIGTERM, as a stuck job might).
LONG_JOB = "import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
LONG_JOB += "open(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n"


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie nobody reaped yet (a container's init may not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _wait_for(path: Path, proc: subprocess.Popen | None, timeout: float = 120.0) -> int:
    end = time.monotonic() + timeout
    while not (path.is_file() and path.read_text().strip()):
        assert proc is None or proc.poll() is None, "the parent ended before its job started"
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.02)
    return int(path.read_text())


def _study_parent(tmp_path: Path, job: Path, pid_file: Path) -> str:
    """A study-like parent (`python -c`, one thread): scripts/study.py's `run_jobs` runs `job`,
    then the parent prints the stops it noted and how the study ended (its exit, or None)."""
    return textwrap.dedent(f"""
        import importlib.util, sys
        from pathlib import Path
        from ssl_vit import jobs
        spec = importlib.util.spec_from_file_location("study", {str(REPO / "scripts/study.py")!r})
        study = importlib.util.module_from_spec(spec)
        sys.modules["study"] = study
        spec.loader.exec_module(study)
        job = study.Job(jobs.FINETUNE, "x", Path({str(tmp_path / "run")!r}),
                        lambda: [sys.executable, {str(job)!r}, {str(pid_file)!r}])
        code = None
        try:
            study.run_jobs([job], 1, Path({str(tmp_path)!r}), study.StudyProgress([job], False))
        except SystemExit as e:
            code = e.code
        print(study.STOPPED)
        print(code)
    """)


def test_a_killed_study_takes_its_job(tmp_path):
    """SIGKILL of a study-like parent's process group while its job (own session, deaf to
    SIGTERM) runs: the job is gone within seconds, not an orphan holding its run."""
    job, pid_file = tmp_path / "job.py", tmp_path / "job.pid"
    job.write_text(LONG_JOB)
    parent = _study_parent(tmp_path, job, pid_file)
    study = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    child = None
    try:
        child = _wait_for(pid_file, study)
        assert os.getsid(child) == child  # its own session: the group's signal misses it
        os.killpg(study.pid, signal.SIGKILL)
        study.wait(10)
        end = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < end:
            time.sleep(0.02)
        assert _gone(child), "the study's job outlived the study"
    finally:
        for pid in (study.pid, child):
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stop_reaches_the_forked_job_once(tmp_path):
    """SIGTERM to a study-like parent (one thread: its jobs are forked) while its job runs: the
    study relays it to the job once, notes the stop, and the job's exit (-15 here: it does not
    handle the signal) comes back as from a process it had started by exec."""
    job, pid_file = tmp_path / "job.py", tmp_path / "job.pid"
    job.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
                   "time.sleep(600)\n")  # fmt: skip
    parent = _study_parent(tmp_path, job, pid_file)
    study = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = _wait_for(pid_file, study)
    assert os.getsid(child) == child  # its own session
    with open(f"/proc/{child}/cmdline", "rb") as f:  # a fork: the parent's command line
        assert b"-c" in f.read().split(b"\0")
    study.send_signal(signal.SIGTERM)
    out, _ = study.communicate(timeout=60)
    stopped, code = out.split("\n", 1)
    assert stopped == "['SIGTERM']"  # the job ended on it (-15, not a checkpoint): a failure
    assert "error: finetune/x failed (exit -15)" in code


def test_leaving_the_study_kills_the_running_job(tmp_path, monkeypatch):
    """An exception while a job runs (here from the progress tick) kills the job before it
    propagates: the study never leaves a job behind on a way out it sees."""
    study = load_study()
    monkeypatch.setattr(study, "POLL_S", 0.05)
    job, pid_file = tmp_path / "job.py", tmp_path / "job.pid"
    job.write_text(LONG_JOB)

    def job_fraction(run_dir):
        if pid_file.is_file() and pid_file.read_text():
            raise RuntimeError("a bug in the study")

    monkeypatch.setattr(study, "job_fraction", job_fraction)
    argv = [sys.executable, str(job), str(pid_file)]
    planned = [study.Job(jobs.FINETUNE, "x", tmp_path / "run", lambda: argv)]
    with pytest.raises(RuntimeError, match="a bug"):
        study.run_jobs(planned, 1, tmp_path, study.StudyProgress(planned, enabled=False))
    assert _gone(int(pid_file.read_text()))
    assert study.RUNNING == []


def test_children_get_sigkill_when_their_parent_dies(tmp_path):
    """`start_child` asks the kernel for SIGKILL at the parent's death (PR_GET_PDEATHSIG)."""
    from ssl_vit.children import start_child

    probe = "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v))\n"
    probe += "print(v.value)"
    proc = start_child([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert int(out) == signal.SIGKILL


SCRIPT = """import os, sys
print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(__file__))
print("session", os.getsid(0) == os.getpid(), flush=True)
import ctypes
v = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(v))
print("pdeath", v.value)
what = sys.argv[1]
if what == "code":
    sys.exit(3)
if what == "message":
    sys.exit("a one-line error")
if what == "raise":
    raise ValueError("boom")
"""


# A parent with one thread (a fresh interpreter: pytest's own may run threads, xdist's does).
DRIVER = """import sys
from ssl_vit.children import fork_script
with open(sys.argv[1], "w") as log:
    proc = fork_script([sys.executable, *sys.argv[2:]], log)
    print(type(proc).__name__, proc.wait(60))
"""


def _fork(tmp_path: Path, *argv: str) -> tuple[str, str]:
    """(what the one-thread parent printed, the job's log) of `fork_script(argv)`."""
    log = tmp_path / "job.log"
    cmd = [sys.executable, "-c", DRIVER, str(log), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), log.read_text()


@pytest.mark.parametrize(
    "what, code, says",
    [("ok", 0, ""), ("code", 3, ""), ("message", 1, "a one-line error"), ("raise", 1, "boom")],
)
def test_a_forked_script_runs_as_python_would(tmp_path, what, code, says):
    """`fork_script` from a parent with one thread forks (no new interpreter) and runs the
    script as `python script args` would (its `__main__`, argv, folder on sys.path, exit
    status, output in the log), in its own session, killed with its parent."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    parent, out = _fork(tmp_path, str(script), what, "x=1")
    assert parent == f"ForkedScript {code}"
    assert f"name __main__ argv ['{what}', 'x=1'] path0 True" in out
    assert "session True" in out and f"pdeath {int(signal.SIGKILL)}" in out
    assert says in out


def test_a_parent_with_threads_starts_its_script_by_exec(tmp_path):
    """A fork copies only the calling thread: with another thread running, the script is started
    by exec (a `subprocess.Popen`), with the same result."""
    import threading

    from ssl_vit.children import fork_script

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with open(tmp_path / "job.log", "w") as log:
            proc = fork_script([sys.executable, str(script), "code"], log)
            assert isinstance(proc, subprocess.Popen)
            assert proc.wait(60) == 3
    finally:
        stop.set()
        thread.join()
    assert "name __main__ argv ['code'] path0 True" in (tmp_path / "job.log").read_text()


def test_preload_imports_without_running_main(tmp_path):
    from ssl_vit.children import preload

    script = tmp_path / "job.py"
    script.write_text("import json\nif __name__ == '__main__':\n    raise SystemExit('ran')\n")
    preload(str(script))  # no SystemExit
