"""Progress off a terminal: log lines with percent done, rate and ETA (tqdm on a terminal)."""

import logging

import pytest

from ssl_vit import progress
from ssl_vit.progress import LogProgress, format_eta, progress_bar, progress_iter


def test_format_eta():
    assert [format_eta(s) for s in (0, 42.4, 185, 3720, float("nan"), -1)] == [
        "0s",
        "42s",
        "3m05s",
        "1h02m",
        "?",
        "?",
    ]


def test_metric_lines_carry_percent_and_eta(monkeypatch, capsys):
    clock = iter([100.0, 110.0, 0.0])  # created at 100 s; the line is written at 110 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress_bar(100, initial=20, enabled=True)  # resumed at step 20; not a terminal
    assert isinstance(bar, LogProgress)
    bar.update(20)  # 20 steps in 10 s -> the 60 left take 30 s
    bar.write("step 40 | loss 2.5")
    assert capsys.readouterr().out == "step 40 | loss 2.5 | 40% | eta 30s\n"
    progress_bar(100, 0, enabled=False).write("other ranks print nothing")
    assert capsys.readouterr().out == ""


def test_jobs_without_metric_lines_log_status_lines(caplog):
    with caplog.at_level(logging.INFO, logger="ssl_vit.progress"):
        items = list(progress_iter(range(4), 4, desc="make-shards", unit="img", every_s=0))
    assert items == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and lines[-1].startswith("make-shards: 100% (4/4 img), ")
    assert lines[1].startswith("make-shards: 50% (2/4 img)") and "eta " in lines[1]


@pytest.mark.parametrize("count", [None, len])
def test_progress_iter_counts_items_or_their_size(count, caplog):
    batches = [[1, 2], [3, 4, 5]]
    total = 2 if count is None else 5
    with caplog.at_level(logging.INFO, logger="ssl_vit.progress"):
        list(progress_iter(batches, total, desc="x", every_s=0, count=count))
    assert caplog.records[-1].getMessage().startswith(f"x: 100% ({total}/{total} it)")
