"""Fine-tunes grouped by encoder and label budget (`data.labels_per_class`, issue 27), as data:
the groups the fine-tuning figure draws, the accuracy-vs-labels curves and their table.
matplotlib is not imported here: the figures are in finetune_figures.py, the sections that
put both together in finetune_section.py.

A fine-tune's results.json names its budget K (`labels_per_class`, 0: every label), the
images it trained on (`num_labelled`) and `num_classes`; K = 0 is drawn at num_labelled /
num_classes. Runs from before the budget existed count as K = 0 and are left out of the
curves when they do not say how many images they used.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ssl_vit.config.loader import flat_keys
from ssl_vit.jobs import FEWSHOT, FINETUNE
from ssl_vit.report.render import Table
from ssl_vit.report.runs import Run, fewshot_table, run_dir_of, source_checkpoint

__all__ = [
    "SCRATCH",
    "Groups",
    "all_labels_per_class",
    "budget_label",
    "budget_of",
    "budget_order",
    "budget_table",
    "encoder_name",
    "encoder_order",
    "fewshot_curves",
    "finetune_groups",
    "images_per_class",
    "is_picked",
    "labels_curves",
    "scored",
    "spread",
]

SCRATCH = "scratch"  # the random-init encoder's line
SELF_TRAINED = " + self-trained"  # its fine-tunes with a teacher on the unlabelled images
SEMI = " + semi-supervised"  # its fine-tunes with the online stage (distill.mode=online)
PICKED = ("random", "typiclust")  # data.labels_select that picks N images, no label read
Curves = dict[str, dict[int, list[float]]]  # {encoder: {K: [top1 of each seed]}}
Groups = dict[tuple[str, int], list[Run]]  # {(encoder, K): [fine-tunes, one per seed]}


def encoder_name(run: Run) -> str:
    """The encoder a fine-tune / few-shot run started from: "scratch" for random init, else
    the pretraining run directory holding its checkpoint (every step of one pretraining run is
    one encoder), else the checkpoint as written."""
    ckpt = source_checkpoint(run)
    if ckpt is None:
        return SCRATCH
    run_dir = run_dir_of(ckpt)
    if run_dir is None and (Path(ckpt) / "checkpoints").is_dir():  # init: a run directory
        run_dir = Path(ckpt)
    name = run_dir.name if run_dir is not None else ckpt
    # Self-training (distill.teacher) or the online stage from the same encoder is another
    # line of its own, and so is a tagged run (the study's equal-compute controls): never
    # averaged with the rest.
    distill = run.config.get("distill") or {}
    if distill.get("teacher"):
        name += SELF_TRAINED
    elif distill.get("unlabelled") and distill.get("mode") == "online":
        name += SEMI
    # Labels picked without their labels (data.labels_select, issue 49; K = 0): never averaged
    # with the encoder's fine-tunes on every label.
    if is_picked(run):
        data = run.config["data"]
        name += f" [{data.get('labels_budget')} labels by {data['labels_select']}]"
    tag = run.config.get("tag")
    return f"{name} [{tag}]" if tag else name


def budget_of(run: Run) -> int:
    """K of a fine-tune (0: every label; runs from before the budget: 0)."""
    k = run.results.get("labels_per_class")
    return int(k if k is not None else (run.config.get("data") or {}).get("labels_per_class", 0))


def budget_order(k: int) -> tuple[bool, int]:
    """Sort key of budgets: K ascending, then 0 (every label, the most)."""
    return k == 0, k


def encoder_order(name: str) -> tuple[bool, str]:
    """Sort key of encoders: by name, scratch last (as the summary's random-init row)."""
    return name.split(" (")[0] == SCRATCH, name


def scored(runs: list[Run]) -> list[Run]:
    """The finished fine-tunes with a top-1."""
    ok = (int, float)
    return [r for r in runs if r.job is FINETUNE and isinstance(r.results.get("top1"), ok)]


def images_per_class(run: Run) -> float | None:
    """num_labelled / num_classes of a run; None when either is unknown."""
    n, c = run.results.get("num_labelled"), run.results.get("num_classes")
    return n / c if n and c else None


def _recipe(run: Run) -> str | None:
    return run.results.get("recipe") or run.config.get("recipe")


def finetune_groups(runs: list[Run]) -> Groups:
    """The fine-tunes (finished or not) by (encoder, K): one group per encoder and label
    budget, its runs the seeds. Encoders by name with scratch last, K ascending with 0 (every
    label) last. Among several fine-tuning recipes, an encoder's name says its recipe; runs of
    one encoder and budget that differ in more than their seed (`_NOT_SETTINGS`), e.g. two
    lengths of one fine-tune, are groups of their own, named by what differs."""
    fts = [r for r in runs if r.job is FINETUNE]
    by_recipe = len({_recipe(r) for r in fts}) > 1
    groups: Groups = {}
    for r in fts:
        name = encoder_name(r)
        if by_recipe:
            name += f" ({_recipe(r) or 'recipe unknown'})"
        groups.setdefault((name, budget_of(r)), []).append(r)
    split: Groups = {}
    for (name, k), members in groups.items():
        for r, setting in _settings(members):
            split.setdefault((name + setting, k), []).append(r)
    keys = sorted(split, key=lambda g: (encoder_order(g[0]), budget_order(g[1])))
    return {g: split[g] for g in keys}


# Config keys in which the seeds of one setting differ, which say how a run ran rather than what
# it trained, or which its name already says (the label budget, the recipe): fine-tunes
# differing only in these are one group.
_NOT_SETTINGS = (
    *("seed", "output_dir", "tag", "init.checkpoint", "data.labels_", "distill.teacher"),
    *("data.num_workers", "data.record_keys", "compile.", "timeouts.", "trackers", "eval_every"),
    *("train.log_every", "train.checkpoint_every", "train.keep_checkpoints", "train.max_bad_"),
    *("recipe", "parts."),
)
_SHOWN_SETTINGS = 3  # differing keys named in a group's name


def _settings(members: list[Run]) -> list[tuple[Run, str]]:
    """Each run with ' (key=value, ...)': the settings its group's runs differ in beyond the
    seed ('' for all when they differ in none). A key only some have (a config written by
    another version) cannot be compared."""
    flat = [flat_keys(r.config) for r in members]
    shared = set.intersection(*(set(f) for f in flat))
    keys = sorted(k for k in shared if not k.startswith(_NOT_SETTINGS))
    differ = [k for k in keys if len({repr(f[k]) for f in flat}) > 1]
    if not differ:
        return [(r, "") for r in members]
    more = f", +{len(differ) - _SHOWN_SETTINGS} more" if len(differ) > _SHOWN_SETTINGS else ""
    return [
        (r, " (" + ", ".join(f"{k}={f[k]}" for k in differ[:_SHOWN_SETTINGS]) + more + ")")
        for r, f in zip(members, flat, strict=True)
    ]


def labels_curves(runs: list[Run]) -> Curves:
    """{encoder: {K: [top1, one per run (seed)]}} of the finished fine-tunes, K ascending and
    0 (every label) last; a K = 0 run whose num_labelled / num_classes is unknown is left out."""
    curves: Curves = {}
    for (name, k), members in finetune_groups(runs).items():
        top1 = [float(r.results["top1"]) for r in scored(members) if k or images_per_class(r)]
        if top1:
            curves.setdefault(name, {})[k] = top1
    return curves


def all_labels_per_class(runs: list[Run]) -> float | None:
    """Where K = 0 (every label) sits on the labels-per-class axis: the mean num_labelled /
    num_classes of those runs (one dataset: all equal); None without any."""
    xs = [x for r in scored(runs) if budget_of(r) == 0 and not is_picked(r)
          and (x := images_per_class(r)) is not None]  # fmt: skip
    return statistics.fmean(xs) if xs else None


def is_picked(run: Run) -> bool:
    """A fine-tune on labels picked without their labels (`data.labels_select`)."""
    return (run.config.get("data") or {}).get("labels_select") in PICKED


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, population std) of one budget's seeds, as the few-shot tables' mean ± std; with
    two seeds the std is half their range."""
    return statistics.fmean(values), statistics.pstdev(values)


def budget_label(k: int, x_all: float | None) -> str:
    """A budget's name: "10", or "all (600)" for K = 0 ("all" when the size is unknown)."""
    if k:
        return str(k)
    return "all" if x_all is None else f"all ({x_all:.0f})"


def budget_table(curves: Curves, x_all: float | None) -> Table:
    """Rows: encoders; columns: budgets (K ascending, every label last); cells: top-1 (%)
    "mean ± std (n seeds)", "-" where not run."""
    budgets = sorted({k for c in curves.values() for k in c}, key=budget_order)

    def cell(values: list[float] | None) -> str:
        if not values:
            return "-"
        mean, std = spread(values)
        n = len(values)
        return f"{100 * mean:.1f} ± {100 * std:.1f} ({n} seed{'s' if n > 1 else ''})"

    header = ["encoder", *[f"{budget_label(k, x_all)} / class" for k in budgets]]
    encoders = sorted(curves, key=encoder_order)
    rows = [[e, *[cell(curves[e].get(k)) for k in budgets]] for e in encoders]
    return Table(header, rows)


def fewshot_curves(runs: list[Run], encoders: set[str]) -> list[tuple[str, dict[int, float]]]:
    """(label, {k: mean accuracy}) of the finished few-shot runs of the fine-tuned encoders,
    numeric shots only (a frozen linear probe on k labels per class)."""
    out = []
    for r in runs:
        if r.job is not FEWSHOT or not r.finished or encoder_name(r) not in encoders:
            continue
        table = {k: e["mean"] for k, e in fewshot_table(r.results).items() if isinstance(k, int)}
        if table:
            out.append((encoder_name(r), table))
    return out
