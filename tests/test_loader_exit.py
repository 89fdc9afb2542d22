"""Every loader the library returns ends with the interpreter (issue 38): its workers ignore
SIGTERM (the main process handles a stop), so a loader left alive when a plain script ends made
multiprocessing's exit handler wait on them forever. The workers also end on `close()`, in a
`with` block and on `del`, whatever the worker count. Real subprocesses, the synthetic shards."""

import multiprocessing
import subprocess
import sys
import textwrap
import time

import pytest

from ssl_vit.config.schema import PretrainDataConfig
from ssl_vit.data import StreamArgs, pretrain_loader

# Loaders left alive in every way a user's script leaves them: a `for` loop left by `break`,
# `next(iter(loader))` three times, an evaluation iterator held in a variable; then the end.
SCRIPT = """
import sys, time
from ssl_vit.config.schema import PretrainDataConfig
from ssl_vit.data import StreamArgs, eval_loader, pretrain_loader

shards, workers = sys.argv[1], int(sys.argv[2])
data = PretrainDataConfig(train_shards=shards)
first = pretrain_loader(data, StreamArgs(8, workers, 16))
for batch in first:
    break
second = pretrain_loader(data, StreamArgs(8, workers, 16, seed=1))
for _ in range(3):
    next(iter(second))
held = iter(eval_loader(shards, 8, 16, num_workers=workers))
next(held)
print("END", time.monotonic(), flush=True)
"""


@pytest.mark.system
@pytest.mark.parametrize("workers", [1, 2])
def test_a_script_with_live_loaders_exits(workers, synthetic_shards, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    argv = [sys.executable, str(script), str(synthetic_shards), str(workers)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)  # a hang is forever; a loaded CPU is slow
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the script never exited: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    ended = float(out.split("END ")[1])
    print(f"{workers} worker(s): exited {time.monotonic() - ended:.1f}s after its last line")


def _workers_alive() -> int:
    return len(multiprocessing.active_children())


@pytest.mark.parametrize("workers", [0, 2])
def test_close_with_and_del_end_the_workers(workers, synthetic_shards):
    data = PretrainDataConfig(train_shards=str(synthetic_shards))
    before = _workers_alive()
    with pretrain_loader(data, StreamArgs(8, workers, 16)) as loader:
        next(iter(loader))
        assert _workers_alive() == before + workers
    assert _workers_alive() == before
    next(iter(loader))  # a closed loader starts new workers when iterated again
    assert _workers_alive() == before + workers
    del loader
    assert _workers_alive() == before


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_a_loop_ends_a_blocked_worker_in_bounded_time(synthetic_shards):
    """The training loop's `Batches.close` ends its iterator's workers the one way the data
    layer does (`stages.end_workers`): a worker that does not answer DataLoader's orderly
    shutdown (here: stopped, as if blocked in a read) is killed once DataLoader's own waits
    (5 s, a SIGTERM the workers ignore, 5 s) are over, not left alive."""
    import os
    import signal

    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL as WAIT_S  # DataLoader's

    from ssl_vit.data.stages import REAP_S
    from ssl_vit.train.loop import Batches, new_counters
    from ssl_vit.train.metrics import Stopwatch

    data = PretrainDataConfig(train_shards=str(synthetic_shards))
    before = _workers_alive()
    loader = pretrain_loader(data, StreamArgs(8, 2, 16))
    with Batches(loader, new_counters(), 1, Stopwatch()) as batches:
        batches.next()
        workers = list(batches.it._workers)
        os.kill(workers[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2 * WAIT_S + REAP_S + 2.0
    assert not any(w.is_alive() for w in workers)
    assert _workers_alive() == before


def test_ending_the_workers_of_an_iterator_without_any_is_a_no_op():
    from ssl_vit.data.stages import end_workers

    end_workers(None)  # a loop closed before it started
    end_workers(iter([]))  # no workers, no weak reference
