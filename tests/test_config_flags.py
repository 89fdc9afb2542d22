"""A job's flag and a `key=value` override of the same key (issue 48, defect 4): predict let the
override win, few-shot the flag. Now one rule for every job that has both (`flag_overrides`):
equal values are one setting, different ones one error line naming both, in either order."""

import pytest

from ssl_vit.cli import main as cli
from ssl_vit.config import ConfigError
from ssl_vit.config.flags import flag_overrides


def test_equal_values_pass_and_different_ones_name_both():
    flags = {"--batch-size 8": ("batch_size", 8), "--no-copy": ("copy", False)}
    assert flag_overrides(flags, ["batch_size=8", "copy=false", "seed=1"]) == [
        "batch_size=8", "copy=false", "batch_size=8", "copy=false", "seed=1"
    ]  # fmt: skip
    assert flag_overrides({"--source a b": ("source", "a b")}, []) == ['source="a b"']
    for overrides, error in (
        (["batch_size=16"], "--batch-size 8 and batch_size=16 disagree"),
        (["copy=true"], "--no-copy and copy=true disagree"),
    ):
        with pytest.raises(ConfigError) as e:
            flag_overrides(flags, overrides)
        assert str(e.value) == error


def _job_lines(tmp_path) -> dict[str, tuple[list[str], list[str], str]]:
    """job -> (the rest of its command line, a flag, the override it meets)."""
    nowhere, out = str(tmp_path / "nowhere"), str(tmp_path / "out")
    common = ["--checkpoint", nowhere, "--source", nowhere, "--output", out]
    return {
        "predict": (common, ["--batch-size", "8"], "batch_size"),
        "select": ([*common, "--budget", "2"], ["--batch-size", "8"], "batch_size"),
        "fewshot": ([f"output_dir={out}"], ["--checkpoint", nowhere], "init.checkpoint"),
    }


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli(argv)
    return str(e.value.code)


@pytest.mark.parametrize("job", ["predict", "select", "fewshot"])
def test_every_job_refuses_a_flag_and_an_override_that_disagree_in_either_order(job, tmp_path):
    rest, (flag, value), key = _job_lines(tmp_path)[job]
    other = f"{key}={value}0"  # 80, or another path
    for argv in ([job, *rest, flag, value, other], [job, *rest, other, flag, value]):
        assert _error(argv) == f"error: {flag} {value} and {other} disagree"
    # Equal: one setting; the job goes on to its next check (the missing checkpoint or the
    # few-shot sources), the same in either order.
    same = f"{key}={value}"
    first, last = _error([job, *rest, flag, value, same]), _error([job, *rest, same, flag, value])
    assert first == last and "disagree" not in first


@pytest.mark.parametrize(
    "job, switch, override",
    [("predict", "--ignore-labels", "ignore_labels=false"), ("select", "--no-copy", "copy=true")],
)
def test_a_switch_and_an_override_that_disagree_are_refused(job, switch, override, tmp_path):
    rest = _job_lines(tmp_path)[job][0]
    for argv in ([job, *rest, switch, override], [job, *rest, override, switch]):
        assert _error(argv) == f"error: {switch} and {override} disagree"


@pytest.mark.parametrize(
    "job, flag, value, line",
    [
        ("predict", "--top-k", "0", "top_k: must be > 0, got 0"),
        ("predict", "--batch-size", "0", "batch_size: must be > 0, got 0"),
        ("select", "--batch-size", "0", "batch_size: must be > 0, got 0"),
    ],
)
def test_a_bad_flag_value_is_refused_by_the_flag_the_user_typed(job, flag, value, line, tmp_path):
    """The user typed `--top-k 0`, not `top_k=0`: the refusal names the flag first, then the
    key the check knows (before any checkpoint or source is read: neither exists here)."""
    rest = _job_lines(tmp_path)[job][0]
    assert _error([job, *rest, flag, value]) == f"error: {flag} {value}: {line}"
    # The same value as an override names the key alone, as every other job's keys.
    key = line.split(":")[0]
    assert _error([job, *rest, f"{key}={value}"]) == f"error: {line}"
