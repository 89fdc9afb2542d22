"""The docs cannot go stale: README.md and docs/*.md are checked against the code.

- every relative link resolves (the file, and a `#anchor` to a heading of a Markdown file, by
  GitHub's anchor rules);
- every command shown in a code block (`ssl-vit SUB`, `python pipelines/X.py`, `scripts/...`)
  exists with every `--flag` it uses, and every `key.sub=value` after it is a key of that
  job's schema (pretrain, finetune, fewshot or study, decided by the command);
- every config key named in prose or tables (`train.lr`, `pool=gap`) and every key of a YAML
  block exists in some job's schema;
- docs/config-reference.md is what `python -m ssl_vit.config.reference` writes today;
- the reference generator reads a field's meaning from the comment next to it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from ssl_vit import cli
from ssl_vit.config import reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FILE_SUFFIXES = (".safetensors", ".json", ".jsonl", ".yaml", ".md", ".py", ".html", ".txt")
FILE_SUFFIXES += (".tar", ".bin", ".pth", ".sh", ".png", ".log")
PLACEHOLDER_KEYS = {"key.sub", "k"}  # `[key.sub=value ...]`, `[k=v ...]` in usage lines
JOB_SCRIPTS = {f"pipelines/{job}.py": job for job in cli.JOBS}
JOB_SCRIPTS.update({f"ssl_vit.pipelines.{job}": job for job in cli.JOBS})


# --- Markdown -------------------------------------------------------------------------------


@dataclass
class Block:
    lang: str
    text: str
    line: int  # 1-based line of the opening fence


def split_markdown(text: str) -> tuple[list[Block], str]:
    """Fenced code blocks, and the prose with them blanked out (line numbers kept)."""
    blocks, prose, fence, lines = [], [], None, []
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and m:
            fence, lang, start, lines = m.group(1), m.group(2).lower(), i, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence):
            blocks.append(Block(lang, "\n".join(lines), start))
            fence = None
            prose.append("")
        elif fence is not None:
            lines.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, "an unclosed code fence"
    return blocks, "\n".join(prose)


def code_spans(prose: str) -> list[str]:
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: formatting dropped, lower case, punctuation removed
    (letters, digits, `_`, `-` and spaces kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, prose = split_markdown(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(prose: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)


# --- what the code defines -------------------------------------------------------------------


def schema_keys() -> dict[str, set[str]]:
    """Job -> every dotted key of its schema (sections included, list items as `[]`)."""
    return {
        job: {r.key for r in reference.rows(cls)} for job, (cls, _) in reference.JOB_SCHEMAS.items()
    }


KEYS = schema_keys()
ALL_KEYS = set().union(*KEYS.values())
TOP_LEVEL = {key.split(".")[0].split("[")[0] for key in ALL_KEYS}
FIELD_NAMES = {part.removesuffix("[]") for key in ALL_KEYS for part in key.split(".")}


class _ParserBuiltError(Exception):
    pass


def _grab(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _ParserBuiltError(self)


def built_parser(build) -> argparse.ArgumentParser:
    """The parser a `parse_args(argv)` function builds, caught when it starts parsing."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("parse_args", "parse_known_args", "parse_intermixed_args"):
            mp.setattr(argparse.ArgumentParser, name, _grab)
        try:
            build()
        except _ParserBuiltError as caught:
            return caught.args[0]
    raise AssertionError(f"{build} built no parser")


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def script_options(path: Path) -> set[str]:
    """The option strings of every `add_argument` call in a script (read, not imported: the
    scripts import timm, transformers and torch at the top)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("-"):
                    out.add(arg.value)
    return out | {"-h", "--help"}


SUBCOMMANDS = subcommands()


def job_options(job: str) -> set[str]:
    module = cli.pipeline_module(job)
    return options(built_parser(lambda: module.parse_args([])))


JOB_OPTIONS = {job: job_options(job) for job in cli.JOBS}


# --- commands in code blocks -----------------------------------------------------------------


@dataclass
class Command:
    page: str
    line: int
    program: str  # `ssl-vit make-shards`, `pipelines/pretrain.py`, `scripts/study.py`, ...
    args: list[str]


SEPARATORS = {";", "&&", "||", "|", "&", ">", ">>", "<", "(", ")", "do", "then", "done"}


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(offset, logical line) of a shell block, `\\` continuations joined."""
    pending, start = "", 0
    for i, line in enumerate(text.splitlines()):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def commands_in(tokens: list[str], page: str, line: int) -> Iterator[Command]:
    """Each command of a tokenized shell line we know how to check."""
    i = 0
    while i < len(tokens):
        tok = tokens[i].removeprefix(".venv/bin/")
        program = None
        if tok == "ssl-vit" and (i + 1 == len(tokens) or tokens[i + 1].startswith("-")):
            program = "ssl-vit"  # `ssl-vit --help`
        elif tok == "ssl-vit":
            program, i = f"ssl-vit {tokens[i + 1]}", i + 1
        elif tok == "-m" and tokens[i + 1 : i + 2] and tokens[i + 1] in JOB_SCRIPTS:
            program, i = tokens[i + 1], i + 1
        elif re.fullmatch(r"(pipelines|scripts)/[\w-]+\.(py|sh)|\.ci/run", tok):
            program = tok
        if program is None:
            i += 1
            continue
        args = []
        i += 1
        while i < len(tokens) and tokens[i] not in SEPARATORS:
            args.append(tokens[i])
            i += 1
        yield Command(page, line, program, args)


def page_commands() -> Iterator[Command]:
    for page in PAGES:
        blocks, prose = split_markdown(page.read_text())
        name = page.relative_to(ROOT).as_posix()
        for block in blocks:
            if block.lang not in SHELL_LANGS:
                continue
            for offset, line in shell_lines(block.text):
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split, lexer.commenters = True, "#"
                tokens = list(lexer)
                yield from commands_in(tokens, name, block.line + 1 + offset)
        for span in code_spans(prose):  # `ssl-vit export ...` written inline
            if re.match(r"(ssl-vit|python (pipelines|scripts)/)", span):
                yield from commands_in(shlex.split(span, comments=True), name, 0)


def schema_of(program: str) -> str | None:
    if program.startswith("ssl-vit "):
        return program.split()[1] if program.split()[1] in cli.JOBS else None
    if program in JOB_SCRIPTS:
        return JOB_SCRIPTS[program]
    if program in ("scripts/study.py", "scripts/quickstart.sh"):
        return "study"
    return None


def allowed_options(program: str) -> set[str] | None:
    """The flags `program` takes; None when it takes none we can know (a shell script)."""
    job = schema_of(program)
    if program == "ssl-vit":
        return options(cli.build_parser())
    if program.startswith("ssl-vit "):
        sub = program.split()[1]
        if sub not in SUBCOMMANDS:
            raise LookupError(f"no `ssl-vit {sub}` (known: {sorted(SUBCOMMANDS)})")
        return JOB_OPTIONS[sub] if sub in cli.JOBS else options(SUBCOMMANDS[sub])
    if job is not None and program != "scripts/quickstart.sh":
        return JOB_OPTIONS[job] if job in cli.JOBS else script_options(ROOT / program)
    if program.endswith(".py"):
        return script_options(ROOT / program)
    return None


def problems(cmd: Command) -> Iterator[str]:
    where = f"{cmd.page}:{cmd.line}: {cmd.program}"
    if not cmd.program.startswith(("ssl-vit", "ssl_vit.")) and not (ROOT / cmd.program).exists():
        yield f"{where}: no such file"
        return
    try:
        allowed = allowed_options(cmd.program)
    except LookupError as e:
        yield f"{where}: {e.args[0]}"
        return
    job = schema_of(cmd.program)
    for raw in cmd.args:
        arg = raw.strip("[]")
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", arg):
            flag = arg.split("=")[0]
            if allowed is not None and flag not in allowed:
                yield f"{where}: unknown option {flag} (known: {sorted(allowed)})"
        elif m := re.fullmatch(r"([A-Za-z_][\w]*(?:\.\w+)*)=.*", arg):
            key = m.group(1)
            if job is not None and key not in PLACEHOLDER_KEYS and key not in KEYS[job]:
                yield f"{where}: {key} is not a key of the {job} config"
        elif re.fullmatch(r"configs/[\w/.-]+\.yaml", arg) and not (ROOT / arg).is_file():
            yield f"{where}: no config file {arg}"


@pytest.mark.system
def test_every_command_flag_and_override_in_the_docs_exists():
    cmds = list(page_commands())
    programs = {c.program.split()[0] for c in cmds}
    # The scan sees the commands (an empty scan would pass everything).
    assert {"ssl-vit", "pipelines/pretrain.py", "scripts/study.py"} <= programs
    assert sum(len(c.args) for c in cmds) > 100
    found = [p for cmd in cmds for p in problems(cmd)]
    assert not found, "\n".join(found)


def test_the_command_check_catches_what_it_should():
    def check(line: str) -> list[str]:
        tokens = shlex.split(line, comments=True)
        return [p for c in commands_in(tokens, "x.md", 1) for p in problems(c)]

    assert check("python pipelines/pretrain.py --config x.yaml train.steps=5 --resume") == []
    assert check("ssl-vit finetune --config y init.checkpoint=none train.lr=0.1") == []
    assert check("python scripts/study.py --config c --preset gpu quick.output_dir=x") == []
    assert check("ssl-vit make-shards --source a --output b [--shard-size 10]") == []
    assert "train.stepz" in check("python pipelines/pretrain.py train.stepz=5")[0]
    assert "init.checkpoint" in check("python pipelines/pretrain.py init.checkpoint=x")[0]
    assert "--resume" in check("python pipelines/fewshot.py --resume")[0]
    assert "--frobnicate" in check("ssl-vit export ck --to hf out --frobnicate")[0]
    assert "no `ssl-vit frob`" in check("ssl-vit frob --x")[0]
    assert "no such file" in check("bash scripts/nothing.sh")[0]
    assert "--bogus" in check("python scripts/bench.py --bogus")[0]
    assert check("ssl-vit --help") == []


# --- config keys in prose, tables and YAML blocks ---------------------------------------------


def prose_keys(span: str) -> str | None:
    """The config key an inline code span names (`train.lr`, `pool=gap`), else None."""
    m = re.fullmatch(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)(=\S*)?", span)
    if not m or m.group(1).endswith(FILE_SUFFIXES):
        return None
    key = m.group(1)
    if "." in key and key.split(".")[0] in TOP_LEVEL:
        return key
    # `pool=gap`: a top-level override, if it is a name our schemas use anywhere (`lr=5e-5` is
    # one, and wrong: `train.lr`); other libraries' `img_size=48` are not.
    if "." not in key and m.group(2) is not None and key in FIELD_NAMES | PLACEHOLDER_KEYS:
        return key
    return None


def yaml_keys(data: object, prefix: str = "") -> Iterator[str]:
    if isinstance(data, dict):
        for k, v in data.items():
            yield f"{prefix}{k}"
            yield from yaml_keys(v, f"{prefix}{k}.")
    elif isinstance(data, list) and prefix:
        for item in data:
            yield from yaml_keys(item, f"{prefix[:-1]}[].")


def test_every_config_key_named_in_the_docs_exists():
    found, named = [], 0
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        blocks, prose = split_markdown(page.read_text())
        for span in code_spans(prose):
            words = span.split()
            # `train.lr`, `pool=gap`, or a run of overrides `layers=all concat_last=2`
            overrides = len(words) > 1 and all("=" in w for w in words)
            for word in words if overrides else [span]:
                key = prose_keys(word)
                if key is not None:
                    named += 1
                    known = ALL_KEYS | PLACEHOLDER_KEYS
                    if key not in known:
                        found.append(f"{name}: `{span}`: {key} is not a config key")
        for block in blocks:
            if block.lang != "yaml":
                continue
            keys = set(yaml_keys(yaml.safe_load(block.text)))
            if not any(keys <= job_keys for job_keys in KEYS.values()):
                best = min(KEYS.values(), key=lambda job_keys: len(keys - job_keys))
                found.append(f"{name}:{block.line}: YAML keys {sorted(keys - best)} unknown")
    assert named > 50
    assert not found, "\n".join(found)


def test_prose_key_rules():
    assert prose_keys("train.lr") == "train.lr"
    assert prose_keys("data.eval=hf://uoft-cs/cifar10:test") == "data.eval"
    assert prose_keys("pool=gap") == "pool"
    assert prose_keys("model.safetensors") is None  # a file
    assert prose_keys("ssl_vit.pipelines") is None  # a module
    assert prose_keys("pool") is None  # a word
    assert prose_keys("lr=5e-5") == "lr"  # one of ours, written wrong (train.lr)
    assert prose_keys("img_size=48") is None  # timm's
    assert list(yaml_keys({"variants": [{"name": "a"}], "data": {"train": "x"}})) == [
        "variants", "variants[].name", "data", "data.train",
    ]  # fmt: skip


# --- links and anchors ------------------------------------------------------------------------


def test_every_relative_link_and_anchor_resolves():
    found, checked = [], 0
    for page in PAGES:
        _, prose = split_markdown(page.read_text())
        for target in links(prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                found.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                found.append(f"{page.name}: {target}: no heading #{anchor} in {dest.name}")
    assert checked > 20
    assert not found, "\n".join(found)


def test_github_slugs():
    assert github_slug("Scaling out, resuming, surviving faults") == (
        "scaling-out-resuming-surviving-faults"
    )
    assert github_slug("5. The study: every variant") == "5-the-study-every-variant"
    assert github_slug("Export to `timm` and [HF](x.md)") == "export-to-timm-and-hf"
    assert github_slug("config_reference & more") == "config_reference--more"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    text = "\n".join(lines)
    # The quick start's two commands, exactly as scripts/ and .ci/ run them.
    assert "bash scripts/quickstart.sh" in text and "bash scripts/test.sh" in text
    for page in sorted((ROOT / "docs").glob("*.md")):  # the map names every page
        assert f"docs/{page.name}" in text, f"README does not link docs/{page.name}"


# --- the generated configuration reference ----------------------------------------------------


def test_config_reference_is_up_to_date(tmp_path):
    page = ROOT / "docs/config-reference.md"
    assert page.read_text() == reference.render(), (
        "docs/config-reference.md is stale: python -m ssl_vit.config.reference > "
        "docs/config-reference.md"
    )
    assert reference.main(["--check", str(page)]) == 0
    stale = tmp_path / "ref.md"
    stale.write_text(page.read_text().replace("| `train.lr` |", "| `train.lr_old` |"))
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.render() == reference.render()  # deterministic


def test_config_reference_lists_every_key_with_the_jobs_defaults():
    text = reference.render()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.split("\n")[0] for s in sections] == list(reference.JOB_SCHEMAS)
    for section, (job, keys) in zip(sections, KEYS.items(), strict=True):
        rows = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
        assert sorted(rows) == sorted(keys), job
    pretrain, finetune = sections[0], sections[1]
    # Each job's own defaults: fine-tuning's train section is built with lr 0.01.
    assert "| `train.lr` | `float` | `0.0002` |" in pretrain
    assert "| `train.lr` | `float` | `0.01` |" in finetune
    assert "| `train.grad_clip` | `float` | `1.0` | global norm; 0 disables |" in pretrain
    assert "| `model.patch_size` | `int or null` | `null` |" in pretrain
    assert "`'mean_color' or 'color_4x4' or 'pixels_l2'` | `mean_color` |" in pretrain


FIXTURE = '''\
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Inner:
    """An inner section."""

    depth: int = 2  # how deep


@dataclass
class Outer:
    # Above, line one;
    # above, line two.
    sep: str = "#"  # the separator (a '#' in a string is no comment)
    bare: float = 1e-6

    inner: Inner = field(  # the inner part
        default_factory=Inner
    )
    mode: Literal["a", "b"] | None = None
    """Below, as an attribute docstring."""
    items: list[int] = field(default_factory=lambda: [1, 2])  # trailing
'''


def test_field_meanings_come_from_the_comments_next_to_them(tmp_path, monkeypatch):
    path = tmp_path / "fixture_schema.py"
    path.write_text(FIXTURE)
    spec = importlib.util.spec_from_file_location("fixture_schema", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fixture_schema", module)
    spec.loader.exec_module(module)
    assert reference.field_comments(module.Outer) == {
        "sep": "Above, line one; above, line two. the separator (a '#' in a string is no comment)",
        "inner": "the inner part",
        "mode": "Below, as an attribute docstring.",
        "items": "trailing",
    }
    got = list(reference.rows(module.Outer))
    assert [(r.key, r.type, r.default) for r in got] == [
        ("sep", "str", "#"),
        ("bare", "float", "1e-06"),
        ("inner", "section", ""),
        ("inner.depth", "int", "2"),
        ("mode", "'a' or 'b' or null", "null"),
        ("items", "list[int]", "[1, 2]"),
    ]
    assert got[1].meaning == ""  # no comment: still listed, with type and default
    assert got[2].meaning == "the inner part. An inner section."


def test_type_names():
    assert reference.type_name(int | None) == "int or null"
    assert reference.type_name(Literal["cls", "gap"]) == "'cls' or 'gap'"
    assert reference.type_name(tuple[float, float]) == "tuple[float, float]"
    assert reference.type_name(str | list[int]) == "str or list[int]"
