"""Child jobs that die with the process that started them.

A launcher of ours (the study, the benchmark suites) starts each job in its own process, often
in a session of its own (so that a signal to the launcher's process group reaches the job once,
relayed by the launcher). Such a job does not receive what kills the launcher: after a SIGKILL
of the launcher it would train on as an orphan, holding its run directory's lock. So on Linux
every child started here asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`, set between fork and exec, kept across exec); elsewhere that is
not available and `start_child` behaves as `subprocess.Popen`. `stop_child` kills a child's
whole process group: the launcher calls it on every exit path it sees itself.

The kernel's notion of the parent is the thread that forked: start children from a thread that
lives as long as the launcher (the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["die_with_parent", "start_child", "stop_child"]

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


def die_with_parent(parent: int | None = None) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when the process that started it dies. `parent`:
    that process's pid (default: this one), to catch a parent that died before the call."""
    parent = os.getpid() if parent is None else parent

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


def stop_child(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Kill a child still running, with its process group when it leads one (its session's
    loader workers and `pipe:` commands), and reap it."""
    if proc.poll() is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:  # it ended meanwhile
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:  # in uninterruptible sleep (a hung mount): let it be
        pass
