"""Ending the process from anywhere, and the data-stall watchdog that needs it.

`hard_exit(code)` leaves with `os._exit` once `kill_children` is done: it works from any thread
(a timer thread cannot raise into the main thread, and `signal.signal` works only in the main
thread, which may be blocked in a read that never returns).

`watched` / `waiting_for`: one daemon thread ends the job (one `error: ...` line, exit 1) when
a batch takes longer than `timeouts.data_s` (a `pipe:` command or a FIFO that stalls, a hung
network mount, a worker that never starts). The check costs two attribute writes per batch,
and the thread wakes at most 4 times a second.

`stops_raise()` is for a job with nothing to checkpoint (predict): a stop signal raises where
the job is, its own `except BaseException` paths remove what it was writing, and the job ends
in one line instead of dying by the signal.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn, TypeVar

__all__ = [
    "Stopped",
    "data_wait",
    "dead_workers",
    "exiting",
    "hard_exit",
    "kill_children",
    "set_data_timeout",
    "stops_raise",
    "track_loader",
    "track_pipe",
    "waiting_for",
    "watched",
]

T = TypeVar("T")
EXIT_ERROR = 1
DEFAULT_DATA_TIMEOUT_S = 600.0


def kill_children(timeout: float = 10.0) -> None:
    """SIGKILL this process's multiprocessing children (loader workers) and reap them, and the
    whole process group of every `pipe:` command this process or a worker of it started."""
    if threading.current_thread() is threading.main_thread():
        # DataLoader's SIGCHLD handler would raise for every worker killed here. (Elsewhere
        # `signal.signal` raises; the thread then exits the process before the handler runs.)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Before the workers die: a pipe command a worker started is found as the worker's child.
    groups = _descendant_groups() | _pipe_groups
    children = multiprocessing.active_children()
    for p in children:
        p.kill()
    for pgid in groups:
        with suppress(OSError):  # already gone
            os.killpg(pgid, signal.SIGKILL)
    for p in children:
        p.join(timeout)


# Process groups of the `pipe:` commands started in this process (each in its own session, so
# that its children - `cat`, `sleep` - are killed with it, whatever signals they ignore).
_pipe_groups: set[int] = set()


def track_pipe(pgid: int) -> None:
    """Remember the process group of a `pipe:` command: `kill_children` kills it whole."""
    _pipe_groups.add(pgid)


def _descendant_groups() -> set[int]:
    """Process groups led by a descendant of this process (a pipe command a loader worker
    started in its own session); read from /proc, empty where there is none."""
    parent, leads = {}, set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        pid, ppid, pgid = int(name), int(fields[1]), int(fields[2])
        parent[pid] = ppid
        if pgid == pid:
            leads.add(pid)
    me, groups = os.getpid(), set()
    for pid in leads - {me, os.getpgid(0)}:
        p, hops = parent.get(pid), 0
        while p and p != me and hops < 64:
            p, hops = parent.get(p), hops + 1
        if p == me:
            groups.add(pid)
    return groups


_loaders: weakref.WeakSet = weakref.WeakSet()


def track_loader(iterator: object) -> None:
    """Remember a DataLoader iterator: its workers are checked by `dead_workers` even after
    DataLoader itself noticed one dead (which drops it from multiprocessing's registry)."""
    with suppress(TypeError):  # not weak-referenceable: multiprocessing's registry still covers it
        _loaders.add(iterator)


def dead_workers(grace_s: float = 0.0) -> list[str]:
    """'pid N (SIGKILL)' for each child process that a signal ended (a loader worker killed by
    the OOM killer): to be named whatever error surfaced first. A killed process closes its
    sockets a moment before it can be seen dead: `grace_s` is how long to look for one."""
    end = time.monotonic() + grace_s
    while True:
        procs = set(getattr(multiprocessing.process, "_children", ()))
        for it in list(_loaders):
            procs.update(getattr(it, "_workers", ()))
        dead = []
        for p in sorted(procs, key=lambda p: p.pid or 0):
            code = p.exitcode  # polls without blocking
            if code is not None and code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                dead.append(f"pid {p.pid} ({name})")
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.05)


_EXITING = threading.Event()


def exiting() -> bool:
    """Whether a watchdog thread is ending the process (the main thread then only waits:
    an error it sees meanwhile, e.g. a worker killed by the watchdog, is not the cause)."""
    return _EXITING.is_set()


def hard_exit(code: int) -> NoReturn:
    """Leave now: children killed, logs flushed, no exit handler that could wait on anything."""
    if threading.current_thread() is not threading.main_thread():
        _EXITING.set()
    kill_children()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


class _StallWatch:
    """One daemon thread; `deadline` is set while a batch is awaited, None otherwise."""

    def __init__(self) -> None:
        self.timeout_s = DEFAULT_DATA_TIMEOUT_S
        self.deadline: float | None = None
        self.what = ""
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="data-watchdog", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(min(0.25, self.timeout_s / 4))
            deadline, what = self.deadline, self.what
            if deadline is not None and time.monotonic() > deadline and self.deadline == deadline:
                print(
                    f"error: no batch from {what} for {self.timeout_s:.0f}s: the data source "
                    "stalled (a hung pipe: command, FIFO or network mount?); exiting. If it is "
                    "only slow, raise timeouts.data_s",
                    file=sys.stderr,
                )
                hard_exit(EXIT_ERROR)


_WATCH = _StallWatch()


def set_data_timeout(seconds: float) -> None:
    """The longest wait for one batch before the job ends (per process; default 600 s)."""
    _WATCH.timeout_s = float(seconds)


def data_wait() -> tuple[str, float] | None:
    """(what, its `time.monotonic()` start) of the wait for data under way (`waiting_for`), or
    None: what a stop signal cannot finish its step without (`guard.StopRequest`)."""
    deadline, what = _WATCH.deadline, _WATCH.what
    return None if deadline is None else (what, deadline - _WATCH.timeout_s)


@contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """The block (one wait for data) must end within the data timeout, or the process ends
    with an error line naming `what`."""
    _WATCH.start()
    _WATCH.what, _WATCH.deadline = what, time.monotonic() + _WATCH.timeout_s
    try:
        yield
    finally:
        _WATCH.deadline = None


def watched(iterable: Iterable[T], what: str) -> Iterator[T]:
    """`iterable`'s items; creating its iterator (worker start-up) and each `next` must take
    less than the data timeout, or the process ends with an error line naming `what`."""
    with waiting_for(what):
        it = iter(iterable)
    while True:
        with waiting_for(what):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


class Stopped(BaseException):
    """A stop signal inside `stops_raise()`, by name (a BaseException: no `except Exception` on
    the way holds it)."""


@contextmanager
def stops_raise() -> Iterator[None]:
    """Inside the block the first SIGTERM / SIGINT raises `Stopped` (a repeat while it unwinds,
    a launcher's relayed copy, is the same request); the handlers before are back after it. A
    signal ignored before stays ignored; outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped: list[int] = []

    def handle(signum: int, _frame: Any) -> None:
        if not stopped:
            stopped.append(signum)
            raise Stopped(signal.Signals(signum).name)

    previous = {
        sig: signal.signal(sig, handle)
        for sig in (signal.SIGTERM, signal.SIGINT)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
