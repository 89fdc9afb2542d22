"""Every way out of a job ends the process, in bounded time, with a status that says how.

A job that hangs burns its allocation and never reports failure, so the entry points run their
`main` under `run_and_exit`, and the training loops take stop signals through `StopRequest`:

- An exception, anywhere (a missing source, a dead loader worker, a failed rank, a bug), prints
  one line `error: ...` naming the last good checkpoint, and the process exits 1. An error of
  the user's making (`ssl_vit.errors.UserError`, a missing path) is that line alone; any other
  (a bug) has its traceback first.
- SIGTERM / SIGINT during training: the step finishes, every rank agrees, a checkpoint is
  written and the job exits 0 with `"preempted": true` in results.json (resume with --resume).
  During the final evaluation (the final checkpoint already written): exit 0 at once, without
  results.json; --resume repeats only the evaluation.
- More stop signals are the same request: a wrapper (`timeout`) or launcher (torchrun) relays
  the one the process group got, a scheduler signals every process of the job. Only an explicit
  second Ctrl-C (SIGINT more than `REPEAT_WINDOW_S` after the first signal) exits 1 at once.
- A graceful stop that has not ended `timeouts.stop_s` after the signal (a rank gone, a stuck
  collective, a read that never returns) is cut short: exit 1, the last complete checkpoint
  stays the resume point. The timer thread ends the process itself (`watchdog.hard_exit`).
  Sooner if the step waits for a batch: one not there `STOP_DATA_GRACE_S` after the signal (a
  stalled source, a batch too large to assemble) ends the job the same way; the step cannot end,
  nor be checkpointed, without it.
- A data source that stalls (no batch for `timeouts.data_s`) ends the job: exit 1
  (`watchdog.watched`). A loader worker found dead is named in the error line, whichever
  error surfaced first. DataLoader's SIGCHLD handler raises its "worker killed" error wherever
  the main process is, a finalizer (`__del__`) included; Python prints one raised there as
  "Exception ignored in ..." with a traceback and goes on, so the job says it in one line
  (`_quiet_dead_worker`) and ends on its next read with the error line above.

Why the teardown kills the loader workers: they ignore SIGTERM / SIGINT (a preemption signal
sent to the process group must not kill them before the main process has checkpointed), so
multiprocessing's exit handler, which terminates daemonic children with SIGTERM and then joins
them, would wait forever when the loader iterator was not shut down first (an exception keeps
it alive in the traceback). That was the hang.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from ssl_vit.errors import JobError, UserError
from ssl_vit.train.checkpoint import latest_valid_checkpoint
from ssl_vit.watchdog import data_wait, dead_workers, exiting, hard_exit, kill_children

__all__ = [
    "JobError",
    "Preempted",
    "StopRequest",
    "note_checkpoints",
    "one_line_errors",
    "run_and_exit",
]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR = 0, 1
# A stop signal this soon after the first is a copy of it (relayed by a launcher; Ctrl-C also
# reaches the launcher, which passes it on); a Ctrl-C after it is the user's second one.
REPEAT_WINDOW_S = 2.0
# After a stop signal, the longest wait for a batch (from the signal, or from the wait's start
# if later). A healthy loader has the step's batches ready or within a step's time; one still
# missing after this will not come in time: 10 s leaves most of a scheduler's grace (SLURM's
# KillWait, Kubernetes' termination grace: 30 s) to exit in, where `timeouts.stop_s` would not.
STOP_DATA_GRACE_S = 10.0
# Errors of the user's making: one line, no traceback. Besides the project's own (`errors`:
# a bad config, input, checkpoint, a failed write), the OS's errors about a path: raised by an
# open / stat / listdir of a path the user named (a data folder, --checkpoint, output_dir), and
# their message names it; a bug almost never raises them, and wrapping every open() would not
# say more. Anything else (a bare ValueError, KeyError, TypeError: a bug) prints its traceback.
USER_ERRORS = (
    UserError,
    *(FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError),
)

_checkpoint_root: Path | None = None


class Preempted(BaseException):
    """A stop signal outside the training loop (the final evaluation): the final checkpoint is
    complete, so the job ends now and --resume repeats only what came after it."""


def note_checkpoints(root: str | Path) -> None:
    """Where this job's checkpoints go: named in the error line if the job fails."""
    global _checkpoint_root
    _checkpoint_root = Path(root)


def _last_good_checkpoint() -> str:
    if _checkpoint_root is None:
        return ""
    try:
        path = latest_valid_checkpoint(_checkpoint_root)
    except OSError:
        path = None
    return f" (last good checkpoint: {path or 'none'})"


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Errors of the user's making (a bad key, a missing path, a checkpoint of another shape)
    as `SystemExit("error: ...")`: one line, no traceback, for in-process callers too."""
    try:
        yield
    except USER_ERRORS as e:
        raise SystemExit(f"error: {e}") from None


def run_and_exit(
    main: Callable[[list[str] | None], Any], argv: list[str] | None = None
) -> NoReturn:
    """Run a job's `main(argv)` and end the process on every path (see the module docstring)."""
    sys.unraisablehook = _quiet_dead_worker(sys.unraisablehook)
    try:
        main(argv)
    except BaseException as e:  # noqa: BLE001 - every failure must end the process
        if exiting():  # a watchdog thread is ending the job and has said why
            threading.Event().wait(60)
        # Before they are killed below: a worker a signal ended (the OOM killer) is named
        # whichever error surfaced first (DataLoader's own, or a reset connection to it).
        # A reset connection to a worker is seen a moment before the worker is seen dead.
        dead = dead_workers(grace_s=1.0 if isinstance(e, (ConnectionError, EOFError)) else 0.0)
        # First: the traceback keeps loader iterators alive, and their finalizers would wait
        # (5 s a worker, then a SIGTERM the workers ignore) for workers that may be blocked.
        kill_children()
        hard_exit(_report(e, dead))
    hard_exit(EXIT_OK)


def _quiet_dead_worker(previous: Callable[[Any], object]) -> Callable[[Any], object]:
    """`sys.unraisablehook` saying DataLoader's "worker killed" error, raised by its SIGCHLD
    handler inside a finalizer, in one line (the module docstring); anything else ignored
    there (a bug in a `__del__`) goes to `previous`, with its traceback."""

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e).startswith("DataLoader worker (pid"):
            log.warning("%s (seen during cleanup: the job ends at its next read)", _one_line(e))
            return
        previous(unraisable)

    return hook


def _one_line(e: BaseException) -> str:
    """The error's message, its first line; for one a loader worker raised, the worker's own
    message: DataLoader re-raises it in the job's process as the same type with "Caught X in
    DataLoader worker process N." first and the worker's traceback after it, whose last line
    is "module.X: <the message>"."""
    lines = str(e).splitlines()
    if not lines:
        return ""
    if lines[0].startswith("Caught ") and " in DataLoader worker process " in lines[0]:
        kind = type(e)
        for name in (f"{kind.__module__}.{kind.__qualname__}: ", f"{kind.__qualname__}: "):
            if lines[-1].startswith(name):
                return lines[-1][len(name) :]
    return lines[0]


def _report(e: BaseException, dead: list[str] = ()) -> int:
    """Print what ended the job (one line last) and return the exit status."""
    if isinstance(e, SystemExit):
        if e.code is None or isinstance(e.code, int):
            return e.code or EXIT_OK
        print(e.code, file=sys.stderr)  # sys.exit("error: ...") carries its own line
        return EXIT_ERROR
    if isinstance(e, Preempted):
        log.warning("%s; the final checkpoint is complete: --resume finishes the job", e)
        return EXIT_OK
    if isinstance(e, JobError):
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if isinstance(e, KeyboardInterrupt):
        print(f"error: interrupted{_last_good_checkpoint()}", file=sys.stderr)
        return EXIT_ERROR
    if not isinstance(e, USER_ERRORS) and not dead:  # a dead worker is named: no bug to trace
        traceback.print_exception(e)
    message = _one_line(e)
    if dead:
        message += f" [dead loader worker(s): {', '.join(dead)}]"
    print(f"error: {type(e).__name__}: {message}{_last_good_checkpoint()}", file=sys.stderr)
    return EXIT_ERROR


class StopRequest:
    """SIGTERM / SIGINT (preemption, Ctrl-C) -> a flag; `agreed()` tells every rank at once.

    During the loop (`graceful`, the default) the handler only sets the flag: the loop finishes
    its step, then all ranks agree on the OR of their flags (one tiny all-reduce per step, on a
    CPU gloo group so the GPU stream is never synchronized). After `finish_loop()` a signal
    raises `Preempted` where the job is. Further signals and the stop's deadlines: the module
    docstring.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        self.flag = 0
        self.since = 0.0  # time.monotonic() of the first stop signal
        self.repeats = 0  # stop signals after it taken as the same request
        self.graceful = True
        self.timeout_s = timeout_s
        self.group = None
        if world_size > 1:
            import torch.distributed as dist

            # Every rank creates the group at the same point (a collective).
            is_gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if is_gloo else dist.new_group(backend="gloo")
        self.watchdog: threading.Thread | None = None  # the stop's deadlines, from the signal
        self.closed = threading.Event()
        stop_signals = (signal.SIGTERM, signal.SIGINT)
        self.previous = {sig: signal.signal(sig, self._handle) for sig in stop_signals}

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Restore the handlers that were there before (the job may run inside a bigger one)."""
        self.closed.set()  # the watchdog thread ends
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def finish_loop(self) -> None:
        """From here on (the final evaluation) a stop signal ends the job where it is."""
        self.graceful = False
        if self.flag:
            raise Preempted(f"{signal.Signals(self.flag).name} received after the last step")

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.flag:
            self._again(signum, name)
            return
        self.flag, self.since = signum, time.monotonic()
        self.watchdog = threading.Thread(
            target=self._deadlines, args=(name,), name="stop-watchdog", daemon=True
        )
        self.watchdog.start()
        if not self.graceful:
            raise Preempted(f"{name} received during the final evaluation")
        log.warning("%s received: stopping after this step (checkpoint, exit 0)", name)

    def _again(self, signum: int, name: str) -> None:
        """A stop signal after the first: a second Ctrl-C exits now, anything else (a relayed
        copy, the scheduler's signal to every process) is the stop already under way."""
        if signum == signal.SIGINT and time.monotonic() - self.since > REPEAT_WINDOW_S:
            raise SystemExit(f"error: second {name}: exiting without checkpoint")
        self.repeats += 1
        if self.repeats == 1:
            log.warning(
                "%s again: the same stop request (a relayed copy), already under way; a second "
                "Ctrl-C exits without checkpoint",
                name,
            )

    def _deadlines(self, name: str) -> None:
        """Until `close()`, 4 times a second: the stop has not run past `timeout_s`, and no
        wait for a batch past `STOP_DATA_GRACE_S` (else one error line, exit 1)."""
        while not self.closed.wait(0.25):
            now, wait = time.monotonic(), data_wait()
            if wait is not None and now - max(wait[1], self.since) > STOP_DATA_GRACE_S:
                self._exit(
                    f"no batch from {wait[0]} {STOP_DATA_GRACE_S:.0f}s after {name} (a stalled "
                    "source, or a batch too large to assemble?): no step to checkpoint"
                )
            if now - self.since > self.timeout_s:
                self._exit(
                    f"the job did not stop within {self.timeout_s:.0f}s of {name} (a rank gone "
                    "or a stuck collective?)"
                )

    @staticmethod
    def _exit(why: str) -> None:
        print(f"error: {why}; exiting{_last_good_checkpoint()}", file=sys.stderr)
        hard_exit(EXIT_ERROR)  # (ssl_vit.watchdog: works from any thread)

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (all ranks call this at the same step)."""
        if self.group is None:
            return bool(self.flag)
        import torch.distributed as dist

        flag = torch.tensor([self.flag], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
