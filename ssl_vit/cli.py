"""The `ssl-vit` command: one argparse sub-command per job.

To add a sub-command, write `_add_<name>(subparsers)` that registers its parser with
`set_defaults(func=cmd_<name>)` and a `cmd_<name>(args) -> int` that runs it, and list it in
`build_parser`. Exit status, as the jobs': 0 done, 1 an error (a missing source, a bad value: one
line on stderr, no traceback), 2 a command line argparse cannot parse (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from ssl_vit import jobs
from ssl_vit.cli_data import add_make_shards, add_make_synthetic
from ssl_vit.errors import ConfigError, UserError
from ssl_vit.progress import LOG_LINE

__all__ = ["JOBS", "build_parser", "entry", "job_parser", "main", "training_args"]


# Sub-commands import their modules when run, so that `ssl-vit --help` does not load torch.


def cmd_export(args: argparse.Namespace) -> int:
    """`ssl-vit export`: a checkpoint's encoder, or a fine-tuned classifier, -> timm or
    transformers directory with a model card."""
    from ssl_vit.publish import export_model

    # A classifier or an encoder, from the file's contents (`export_source`).
    info = export_model(args.checkpoint, args.to, args.outdir, args.keep_head, args.overwrite)
    what = f"{info['num_classes']}-class classifier" if "num_classes" in info else "model"
    print(
        f"wrote {info['format']} {what} ({info['parameters']:,} parameters) with config.json "
        f"and README.md to {info['outdir']}"
    )
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(jobs.EXPORT.name, help=jobs.EXPORT.help)
    p.add_argument(
        "checkpoint",
        help="checkpoint directory, encoder.safetensors, or a run directory (its newest valid "
        "checkpoint); a fine-tuning run directory or its model.safetensors: the whole classifier",
    )
    p.add_argument("--to", required=True, choices=["timm", "hf"], help="target library")
    p.add_argument("outdir", help="output directory (model.safetensors, config.json, README.md)")
    p.add_argument(
        "--keep-head",
        action="store_true",
        help="also write the masked-prediction head (ssl-vit names) as "
        "masked_patch_head.safetensors",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (never a run directory, checkpoint or "
        "dataset, nor the source)",
    )
    p.set_defaults(func=cmd_export)


def cmd_import(args: argparse.Namespace) -> int:
    """`ssl-vit import`: timm or transformers ViT weights -> an ssl-vit encoder directory."""
    from ssl_vit.publish import import_weights

    info = import_weights(
        args.source, args.format, args.outdir, heads=args.heads, overwrite=args.overwrite
    )
    c = info["model_config"]
    print(
        f"wrote encoder.safetensors (width {c['width']}, depth {c['depth']}, heads {c['heads']}, "
        f"patch {c['patch_size']}, {c['image_size']} px) to {info['outdir']}"
    )
    return 0


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="turn timm or transformers ViT weights into an encoder")
    p.add_argument("source", help="timm weights file / directory, or transformers directory")
    p.add_argument(
        "--from",
        dest="format",
        default="auto",
        choices=["auto", "timm", "hf"],
        help="source library (auto: detected from config.json / the key names)",
    )
    p.add_argument("outdir", help="output directory (encoder.safetensors)")
    p.add_argument("--heads", type=int, help="attention heads of a bare timm state dict")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (never a checkpoint or run directory)",
    )
    p.set_defaults(func=cmd_import)


def cmd_report(args: argparse.Namespace) -> int:
    """`ssl-vit report`: run directories -> self-contained report.html + report.md."""
    try:
        import matplotlib  # noqa: F401  (checked here: the figure modules import it late)
    except ImportError as e:  # matplotlib is the `report` extra
        raise UserError(f"{e}; install it with: pip install 'ssl-vit[report]'") from None
    from ssl_vit.report import build_report

    paths = build_report(args.runs, args.output, num_examples=args.examples, seed=args.seed)
    print(f"wrote {paths['html']} and {paths['md']}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="HTML + Markdown report of run directories")
    p.add_argument("runs", nargs="+", help="run directories (or folders of run directories)")
    p.add_argument("--output", default="report", help="directory for report.html / report.md")
    p.add_argument("--examples", type=int, default=8, help="images in the example strip")
    p.add_argument("--seed", type=int, default=0, help="seed of the examples' corruption")
    p.set_defaults(func=cmd_report)


JOBS = jobs.PIPELINES  # `ssl-vit <name>`: the job's pipeline parses its own arguments


def job_parser(job: jobs.Job, doc: str) -> argparse.ArgumentParser:
    """The command line of `job`'s pipeline, `doc` its --help text. Its usage line names the
    command it was started as: a script by its name (`python pipelines/pretrain.py`,
    `accelerate launch -m ...`), else `ssl-vit <job>`."""
    prog = None if sys.argv[0].endswith(".py") else f"ssl-vit {job.name}"
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawTextHelpFormatter
    )


def training_args(job: jobs.Job, doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line of a training job (pretrain, finetune)."""
    p = job_parser(job, doc)
    p.add_argument("--config", help=f"YAML config (see configs/{job.name}/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run in output_dir")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_intermixed_args(argv)


def pipeline_module(name: str) -> ModuleType:
    """The pipeline of job `name` (its `jobs.Job.module`): `ssl_vit.pipelines.<module>` in an
    installed package (the wheel ships pipelines/ there), else `pipelines/<module>.py`."""
    name = JOBS[name].module
    try:
        return importlib.import_module(f"ssl_vit.pipelines.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("ssl_vit.pipelines", f"ssl_vit.pipelines.{name}"):
            raise  # a missing dependency of the pipeline itself
    path = Path(__file__).resolve().parents[1] / "pipelines" / f"{name}.py"
    if not path.is_file():
        raise OSError(f"pipeline {name} not found (neither ssl_vit.pipelines nor {path})")
    spec = importlib.util.spec_from_file_location(f"ssl_vit_pipeline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cmd_configs(args: argparse.Namespace) -> int:
    """`ssl-vit configs`: list the shipped configs, or copy them (`--copy DIR [NAME ...]`)."""
    from ssl_vit.config.shipped import configs_dir, shipped_configs

    root, names = configs_dir(), shipped_configs()
    if root is None:
        raise OSError("no shipped configs found (neither ssl_vit/configs nor a checkout)")
    unknown = sorted(set(args.names) - set(names))
    if unknown:
        raise ConfigError(f"unknown config(s) {unknown}; `ssl-vit configs` lists them")
    if args.copy is None:
        for name in args.names or names:
            print(f"{name:32s} {root / name}.yaml")
        return 0
    copied = 0
    for name in args.names or names:
        dest = Path(args.copy) / f"{name}.yaml"
        if dest.exists():
            print(f"exists, kept: {dest}")
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f"{name}.yaml", dest)
        copied += 1
    print(f"copied {copied} config(s) to {args.copy}")
    return 0


def _add_configs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("configs", help="list the shipped configs, or copy them to edit")
    p.add_argument("names", nargs="*", help="config names, e.g. pretrain/smoke (default: all)")
    p.add_argument("--copy", metavar="DIR", help="copy them to DIR/<name>.yaml (kept if there)")
    p.set_defaults(func=cmd_configs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-vit", description="Masked patch prediction pretraining for ViTs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in JOBS:  # listed for --help only: main() hands a job's arguments to it as they are
        sub.add_parser(name, help=f"{JOBS[name].help}; `ssl-vit {name} --help` for its arguments")
    _add_configs(sub)
    add_make_shards(sub)
    add_make_synthetic(sub)
    _add_export(sub)
    _add_import(sub)
    _add_report(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ssl-vit` with `argv` (default: sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in JOBS:  # the job parses its own arguments (and exits on errors)
        pipeline_module(argv[0]).main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, **LOG_LINE)
    try:
        return args.func(args)
    except BrokenPipeError:  # `ssl-vit configs | head`: the reader has gone, nothing to say
        # (Python's own advice: stdout to /dev/null, so that the exit's flush raises no more)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # User errors: one line, no traceback (an OSError of a command names the path it could not
    # read or write). Anything else, a bare ValueError included, is a bug: its traceback.
    except (UserError, OSError) as e:
        print(f"ssl-vit {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ssl-vit {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `ssl-vit` console script: a job runs under `guard.run_and_exit`, which ends the process
    on every path in bounded time (an exception, a dead loader worker, a signal)."""
    argv = sys.argv[1:]
    if argv and argv[0] in JOBS:
        from ssl_vit.train.guard import run_and_exit

        run_and_exit(pipeline_module(argv[0]).main, argv[1:])
    sys.exit(main(argv))


if __name__ == "__main__":
    entry()
