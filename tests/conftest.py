"""Shared fixtures and helpers."""

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ssl_vit.datasets.synthetic import make_synthetic_shards


@pytest.fixture(autouse=True)
def _no_stream_handler_outlives_its_test():
    """A job run in the test's process sets up logging as a process of its own would
    (`runtime.setup_logging`: a handler on the sys.stderr of then, pytest's capture, closed
    once the test ends); a later `ssl-vit` command's `basicConfig` would keep that handler and
    print "Logging error" tracebacks. pytest's own handlers are subclasses: left alone."""
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler]:
        root.removeHandler(handler)


ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter that imports this checkout (text output; stdout and
    stderr captured unless `kwargs` route them elsewhere)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    streams = {} if "stdout" in kwargs else {"capture_output": True}
    return subprocess.run(
        [sys.executable, "-c", code], text=True, env=env, timeout=timeout, **streams, **kwargs
    )


def pipeline(name: str) -> Callable:
    """`pipelines/<name>.py`'s `main`, run in this process (a fresh module on every call, so
    no state from one run reaches the next)."""
    spec = importlib.util.spec_from_file_location(
        f"pipeline_{name}", ROOT / "pipelines" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with 2 shards of 48 synthetic 32px images (10 classes) and index.json."""
    out = tmp_path_factory.mktemp("synthetic_shards")
    make_synthetic_shards(out, n=96, image_size=32, seed=0, shard_size=48)
    return out


def record_timeouts(monkeypatch) -> dict:
    """The collective timeout the job gives its process group and the loaders' data timeout
    (read when the job ends; the watchdog's own is put back after the test)."""
    from accelerate.utils import InitProcessGroupKwargs

    from ssl_vit import watchdog
    from ssl_vit.train import runtime

    seen: dict = {}

    def recording(timeout):
        seen["dist_s"] = timeout.total_seconds()
        return InitProcessGroupKwargs(timeout=timeout)

    monkeypatch.setattr(runtime, "InitProcessGroupKwargs", recording)
    monkeypatch.setattr(watchdog._WATCH, "timeout_s", watchdog._WATCH.timeout_s)
    seen["data_s"] = lambda: watchdog._WATCH.timeout_s
    return seen
