"""Child jobs that die with the process that started them.

A launcher of ours (the study, the benchmark suites) starts each job in its own process, often
in a session of its own (so that a signal to the launcher's process group reaches the job once,
relayed by the launcher). Such a job does not receive what kills the launcher: after a SIGKILL
of the launcher it would train on as an orphan, holding its run directory's lock. So on Linux
every child started here asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`, set between fork and exec, kept across exec); elsewhere that is
not available and `start_child` behaves as `subprocess.Popen`. The launcher calls `stop_child`
on every exit path it sees itself.

The kernel's notion of the parent is the thread that forked: start children from a thread that
lives as long as the launcher (the main thread).

`fork_script` starts a Python script the same way but by fork alone, without exec: for the
study, about 5 s of a new interpreter's imports saved per job on 2 cores.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

__all__ = ["ForkedScript", "die_with_parent", "fork_script", "preload", "start_child", "stop_child"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent (the child must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when the process that started it (this one) dies."""
    parent = os.getpid()

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def start_child(argv: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen)`, the child killed when this process dies."""
    return subprocess.Popen(argv, preexec_fn=die_with_parent(), **popen)


def stop_child(proc: subprocess.Popen | ForkedScript, timeout: float = 10.0) -> None:
    """Kill a child still running, with its process group when it leads one (its session's
    loader workers and `pipe:` commands), and reap it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):  # it ended meanwhile
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    # Still there after `timeout`: in uninterruptible sleep (a hung mount), let it be.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


def fork_script(argv: list[str], log: IO, threads: int = 0) -> subprocess.Popen | ForkedScript:
    """Start `argv` (`[python, script, *args]`) as `start_child(argv, stdout=log, stderr=log,
    start_new_session=True)` would, but forked from this process where that is safe: the child
    already has every module the parent imported (`preload`), so it skips the seconds a new
    interpreter spends importing torch. Safe means Linux, no Python thread but the main one (a
    fork copies only the calling thread: another one's work and locks would be dead in the
    child), and no torch op run here, so torch's OpenMP pool, which does not survive a fork, was
    never started (the launchers only import torch). The one native pool an import starts,
    numpy's OpenBLAS, re-creates its threads in the child itself (pthread_atfork). Anywhere
    else the script is started by exec as before.

    `threads` (> 0): the job's intra-op threads (OMP_NUM_THREADS), for jobs that share the
    cores: a launcher running N jobs at once gives each its share."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return start_child(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    preexec = die_with_parent()
    for stream in (sys.stdout, sys.stderr, log):  # else the child writes the parent's buffer too
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedScript(pid, argv)
    code = 1
    try:
        os.setsid()  # as start_new_session: the launcher relays signals to it
        preexec()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        # New streams on the new descriptors: the parent's may write elsewhere (a test's capture).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if env is not None:  # torch read OMP_NUM_THREADS at its import, in the parent
            os.environ.update(env)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(threads)
        code = _run_script(argv[1], argv[2:])
    finally:
        os._exit(code)


def _run_script(script: str, args: list[str]) -> int:
    """Run `script` as `python script args` does (its `__main__`, its folder first on sys.path,
    the default signal handlers); its exit status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    atexit._clear()  # the parent's exit handlers are the parent's
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def preload(script: str) -> None:
    """Import what `script` imports (its top level, not its `__main__` block), in this process,
    so that `fork_script` children start with it."""
    runpy.run_path(script, run_name="__preload__")


class ForkedScript:
    """The `subprocess.Popen` calls the launchers use (poll, wait, send_signal, kill), on a
    forked child."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
