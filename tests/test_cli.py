"""The installed `ssl-vit` command: the three jobs, shipped configs by name, and a real wheel
that carries pipelines/ and configs/ (run from outside the checkout)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run_python

from ssl_vit.cli import JOBS, main
from ssl_vit.config.shipped import find_config, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def test_a_job_runs_from_the_cli_with_a_shipped_config_name(
    synthetic_shards, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # not the checkout: the config is found by name
    argv = ["pretrain", "--config", "pretrain/smoke", f"data.train_shards={synthetic_shards}"]
    assert main([*argv, "output_dir=run", "train.steps=2", "train.checkpoint_every=0"]) == 0
    assert json.loads((tmp_path / "run/results.json").read_text())["step"] == 2
    with pytest.raises(SystemExit, match="config file not found: pretrain/nope"):
        main(["pretrain", "--config", "pretrain/nope"])


def test_configs_lists_and_copies(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = shipped_configs()
    assert {"pretrain/smoke", "study/quickstart", "finetune/smoke"} <= set(names)
    assert find_config("pretrain/smoke") == ROOT / "configs/pretrain/smoke.yaml"
    assert find_config("configs/fewshot/smoke.yaml") == ROOT / "configs/fewshot/smoke.yaml"
    assert main(["configs"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(names)
    assert main(["configs", "pretrain/smoke", "--copy", "mine"]) == 0
    copied = tmp_path / "mine/pretrain/smoke.yaml"
    assert copied.read_text() == (ROOT / "configs/pretrain/smoke.yaml").read_text()
    assert main(["configs", "nope/x"]) == 1


@pytest.mark.system
def test_the_wheel_runs_the_jobs_outside_the_checkout(synthetic_shards, tmp_path):
    """Build the wheel, install it into a folder, run `ssl-vit configs` and the pretraining
    job as `python -m ssl_vit.pipelines.pretrain` (what `accelerate launch -m` runs)."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT], check=True
    )
    (wheel,) = wheels.glob("ssl_vit-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("ssl_vit/**/__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= files  # pyproject lists every package
    for kind in ("pipelines", "configs"):
        ext = "py" if kind == "pipelines" else "yaml"
        shipped = {
            f"ssl_vit/{kind}/{p.relative_to(ROOT / kind).as_posix()}"
            for p in (ROOT / kind).rglob(f"*.{ext}")
        }
        assert shipped and shipped <= files, kind

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    work = tmp_path / "work"
    work.mkdir()

    def run(*args):
        return subprocess.run(
            [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True
        )

    listed = run("-m", "ssl_vit.cli", "configs", "pretrain/smoke")
    assert (
        listed.returncode == 0
        and str(site / "ssl_vit/configs/pretrain/smoke.yaml") in listed.stdout
    )
    job = run(
        "-m", "ssl_vit.pipelines.pretrain", "--config", "pretrain/smoke",
        f"data.train_shards={synthetic_shards}", "output_dir=run", "train.steps=2",
        "train.checkpoint_every=0",
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-2000:]
    assert json.loads((work / "run/results.json").read_text())["step"] == 2


@pytest.mark.system
def test_help_and_configs_do_not_import_torch():
    """`ssl-vit --help` and `ssl-vit configs` answer without loading torch (seconds of CPU);
    the public API still imports on first use."""
    code = (
        "import sys\n"
        "from ssl_vit.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert main(['configs']) == 0\n"
        "heavy = sorted({'torch', 'numpy', 'accelerate', 'PIL'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "from ssl_vit import ViT, ridge_accuracies\n"
        "assert 'torch' in sys.modules and ViT.__name__ == 'ViT'\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_a_jobs_usage_line_names_its_command(name, capsys, monkeypatch):
    """`ssl-vit <job> --help` shows `usage: ssl-vit <job>`; the script, its file's name."""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/ssl-vit", name, "--help"])
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: ssl-vit {name} [-h]")
    script = f"{JOBS[name].module}.py"
    # an example command continued with `\` is shown as written, not run into the next line
    doc = (ROOT / "pipelines" / script).read_text().split('"""')[1]
    continued = [line.strip() for line in doc.splitlines() if line.endswith("\\")]
    assert all(line in out for line in continued), continued
    monkeypatch.setattr(sys, "argv", [f"pipelines/{script}", "--help"])
    with pytest.raises(SystemExit):
        main([name, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: {script} [-h]")


def test_a_closed_pipe_ends_a_command_quietly():
    """`ssl-vit configs | head -1`: the reader gone before the listing is written ends the
    command with status 1 and nothing on stderr (it printed 'error: [Errno 32] Broken pipe')."""
    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first line
    code = "import sys; from ssl_vit.cli import main; sys.exit(main(['configs']))"
    proc = run_python(code, timeout=60, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    assert (proc.returncode, proc.stderr) == (1, "")
