"""The study's summary (`scripts/study.py`): one row per variant (and the random-init baseline,
and each self-trained encoder) from the jobs' results.json, written as summary.json and a
markdown table summary.md."""

from __future__ import annotations

from pathlib import Path

from ssl_vit.config import ConfigError, to_dict
from ssl_vit.config.study import StudyBudget, StudyConfig
from ssl_vit.eval.shots import shot_order
from ssl_vit.jobs import STAGES
from ssl_vit.jsonfile import dump_json
from ssl_vit.report.runs import fewshot_table, read_results
from ssl_vit.study.jobs import budget_of, finetunes, labels_tag, self_trainings

__all__ = [
    "BASELINE",
    "check_controls",
    "labels_columns",
    "markdown_table",
    "picked_rows",
    "seeds_cell",
    "summarize",
]

BASELINE = "random init"  # the random-init row's name


def summarize(cfg: StudyConfig, budget: StudyBudget, out: Path, preset: str) -> dict:
    """Collect the jobs' results.json into summary.json and a markdown table summary.md."""
    rows, jobs = [], finetunes(cfg)
    labelled = bool(cfg.labels or cfg.finetune_seeds)
    pre_dir, few_dir, ft_dir = (out / stage.name for stage in STAGES)
    for v in [None, *cfg.variants]:
        name = v.name if v else BASELINE
        pre = read_results(pre_dir / name) if v else {}
        few = read_results(few_dir / (name if v else "random"))
        ft_name = name if v else "scratch"
        ft = read_results(ft_dir / ft_name)
        # One fine-tune per recipe: top-1 and wall time by recipe name.
        by_recipe = {r.name: read_results(ft_dir / f"{ft_name}-{r.name}")
                     for r in cfg.recipes} if not labelled else {}  # fmt: skip
        # Label budgets and seeds: one column per recipe x budget, its seeds' top-1 values.
        runs = {tag: read_results(ft_dir / (ft_name + tag)) for tag, _ in jobs}
        by_labels = labels_columns(cfg, runs) if labelled else {}
        rows.append({
            "variant": name,
            "objective": to_dict(v.objective) if v else None,
            "pretrain_steps": pre.get("step", 0) if v else 0,
            "pretrain_loss": pre.get("loss"),
            "color_acc": pre.get("color_acc"),
            "color_acc_majority": pre.get("color_acc_majority"),
            # string keys, as they read back from summary.json
            "fewshot": {str(k): t for k, t in fewshot_table(few).items()},
            "finetune_top1": ft.get("top1"),
            "finetune_steps": ft.get("step"),
            "finetune_image_size": ft.get("image_size"),
            "finetune_by_recipe": {k: r.get("top1") for k, r in by_recipe.items()},
            "finetune_by_labels": by_labels,
            "wall_time_s": _by_stage(
                pre.get("wall_time_s"),
                few.get("wall_time_s"),
                _total([r.get("wall_time_s") for r in runs.values()]),
            ),
        })  # fmt: skip
        encoder = rows[-1]
        if v is not None:  # its fine-tunes on images picked without their labels
            rows += picked_rows(cfg, encoder, ft_dir, ft_name)
        if v is not None and v.self_train and self_trainings(cfg):
            rows += self_trained_rows(cfg, encoder, ft_dir, ft_name)
    check_controls(rows)
    walls = [w for r in rows for w in r["wall_time_s"].values() if w is not None]
    summary = {
        "preset": preset,
        "output_dir": str(out),
        "jobs_wall_time_s": sum(walls),
        "rows": rows,
    }
    summary_json = dump_json(summary, str(out / "summary.json"), indent=2, nan_as_null=True)
    (out / "summary.json").write_text(summary_json + "\n")
    (out / "summary.md").write_text(markdown_table(rows) + "\n")
    return summary


def _by_stage(pretrain: float | None, fewshot: float | None, finetune: float | None) -> dict:
    """A row's wall times by stage name (`jobs.STAGES`: pretrain, fewshot, finetune)."""
    return {stage.name: t for stage, t in zip(STAGES, (pretrain, fewshot, finetune), strict=True)}


def _method_row(cfg: StudyConfig, encoder_row: dict, method: str, runs: dict[str, dict]) -> dict:
    """`encoder_row` as the row "<variant> + <method>": the label-budget columns and fine-tuning
    wall time of `runs` (its fine-tunes by run-name suffix)."""
    walls = _total([r.get("wall_time_s") for r in runs.values()])
    return {
        **encoder_row,
        "variant": f"{encoder_row['variant']} + {method}",
        "finetune_by_labels": labels_columns(cfg, runs),
        "wall_time_s": _by_stage(None, None, walls),
    }


def self_trained_rows(cfg: StudyConfig, encoder_row: dict, finetunes_dir: Path, name: str):
    """An encoder's rows of the fine-tunes on the unlabelled images too, each after its
    equal-compute control's (the same fine-tunes without them): "self-trained" (offline),
    "semi-supervised" (online), each with the encoder's pretraining and few-shot figures and
    its label-budget columns (those with the method filled), naming its control: "control",
    or "control of <method>" where the two methods' differ (schedules of their own)."""
    trainings = self_trainings(cfg)
    methods = [(m, [st for st in trainings if st.online == online])
               for m, online in (("self-trained", False), ("semi-supervised", True))]  # fmt: skip
    methods = [(m, mine) for m, mine in methods if mine]

    def runs(mine: list, suffix: str) -> dict[str, dict]:
        return {st.teacher: read_results(finetunes_dir / (name + getattr(st, suffix)))
                for st in mine}  # fmt: skip

    controls = {m: tuple(st.control for st in mine) for m, mine in methods}
    shared = len(set(controls.values())) == 1
    rows, named = [], {}
    for method, mine in methods:
        control = "control" if shared else f"control of {method}"
        if controls[method] not in named:
            rows.append(_method_row(cfg, encoder_row, control, runs(mine, "control")))
            named[controls[method]] = rows[-1]["variant"]
        rows.append(_method_row(cfg, encoder_row, method, runs(mine, "name")))
        rows[-1]["control"] = named[controls[method]]
    return rows


PICKED = {"random": "{n} random labels", "typiclust": "{n} labels chosen by typiclust"}


def picked_rows(cfg: StudyConfig, encoder_row: dict, finetunes_dir: Path, name: str):
    """An encoder's rows of the label entries that pick their images without labels (`select`),
    one per entry, as the study lists them: the encoder's pretraining and few-shot figures,
    the fine-tunes' top-1 in the column of their budget ("100 labels"). A typiclust row names
    its control, the random row of its budget (`check_selected` makes sure there is one)."""
    recipes = [f"-{r.name}" for r in cfg.recipes] or [""]
    seeds = [f"-s{s}" for s in cfg.finetune_seeds] or [""]
    rows = []
    for b in (b for b in cfg.labels if b.select != "balanced"):
        tag = budget_of(b)[0]
        runs = {r + f"-n{b.budget}" + s: read_results(finetunes_dir / (name + r + tag + s))
                for r in recipes for s in seeds}  # fmt: skip
        row = _method_row(cfg, encoder_row, PICKED[b.select].format(n=b.budget), runs)
        if b.select == "typiclust":
            row["control"] = f"{encoder_row['variant']} + {PICKED['random'].format(n=b.budget)}"
        rows.append(row)
    return rows


def check_controls(rows: list[dict]) -> None:
    """Every row of a method beyond the paper (one that names a `control`) stands beside its
    equal-compute control: a gain is only read against it."""
    names = {r["variant"] for r in rows}
    for r in rows:
        if "control" in r and r["control"] not in names:
            raise ConfigError(
                f"summary: row {r['variant']!r} names control {r['control']!r}, which is not "
                "in the study: a method's gain is only reported beside its control"
            )


def labels_columns(cfg: StudyConfig, runs: dict[str, dict]) -> dict[str, dict]:
    """{column: {"recipe", "labels_per_class", "num_labelled", "top1": [per seed],
    "top1_ema": [per seed that averaged its weights]}} from one encoder's fine-tunes by run-name
    suffix; a column is a recipe x label budget (K per class, or "N labels", with
    "labels_budget", for the images picked without labels)."""
    columns: dict[str, dict] = {}
    seeds = [f"-s{s}" for s in cfg.finetune_seeds] or [""]
    budgets = [  # (column, run-name suffix, what it is)
        ("" if k is None else ("all labels" if k == 0 else f"{k}/class"),
         "" if k is None else f"-l{labels_tag(k)}", {"labels_per_class": k})
        for k in [b.per_class for b in cfg.labels if b.select == "balanced"] or [None]
    ]  # fmt: skip
    # A picked budget's runs come keyed -nN (`picked_rows`): -lN is N per class's, and a study
    # may have both (10 labels picked and 10 per class).
    picked = sorted({b.budget for b in cfg.labels if b.select != "balanced"})
    budgets += [(f"{n} labels", f"-n{n}", {"labels_per_class": None, "labels_budget": n})
                for n in picked]  # fmt: skip
    for recipe in [r.name for r in cfg.recipes] or [""]:
        for budget, tag, what in budgets:
            col = " ".join(x for x in (recipe, budget) if x)
            found = [runs.get((f"-{recipe}" if recipe else "") + tag + s, {}) for s in seeds]
            done = [r for r in found if r.get("top1") is not None]
            columns[col or "fine-tune"] = {
                "recipe": recipe or None,
                **what,
                "num_labelled": done[0].get("num_labelled") if done else None,
                "top1": [r["top1"] for r in done],
                "top1_ema": [r["top1_ema"] for r in done if r.get("top1_ema") is not None],
            }
    return columns


def _total(values: list[float | None]) -> float | None:
    """The sum of the values known (None if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def markdown_table(rows: list[dict]) -> str:
    shots = sorted({k for r in rows for k in r["fewshot"]}, key=shot_order)  # 1, 5, ..., all
    recipes = list(rows[0]["finetune_by_recipe"]) if rows else []
    labels = list(rows[0].get("finetune_by_labels") or {}) if rows else []
    head = ["variant", "pretraining steps", "colour acc"] + [f"{k}-shot (%)" for k in shots]
    # Rows that average their weights (`ema`) are judged on them (docs/results.md): a column each.
    averaged = [c for c in labels if any(r["finetune_by_labels"][c]["top1_ema"] for r in rows)]
    if labels:  # mean over the fine-tuning seeds, then each seed's value
        head += [f"fine-tune {c} (%)" for c in labels]
        head += [f"fine-tune {c}, averaged weights (%)" for c in averaged]
    else:
        head += [f"fine-tune top-1 ({r}) (%)" for r in recipes] or ["fine-tune top-1 (%)"]
    head += ["wall: pretrain / few-shot / fine-tune (min)"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        few = [r["fewshot"].get(str(k)) for k in shots]
        cells = [
            r["variant"],
            str(r["pretrain_steps"]),
            "-" if r["color_acc"] is None else f"{r['color_acc']:.3f}",
        ]
        cells += [f"{pct(f['mean'])} ± {pct(f['std'])}" if f else "-" for f in few]
        if labels:
            cells += [seeds_cell(c["top1"]) for c in r["finetune_by_labels"].values()]
            cells += [seeds_cell(r["finetune_by_labels"][c]["top1_ema"]) for c in averaged]
        else:
            by_recipe = [pct(t) for t in r["finetune_by_recipe"].values()]
            cells += by_recipe or [pct(r["finetune_top1"])]
        cells.append(
            " / ".join("-" if w is None else f"{w / 60:.1f}" for w in r["wall_time_s"].values())
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_cell(top1: list[float]) -> str:
    """'36.3 (35.1 / 37.5)': the mean over seeds in %, then each seed's; '-' if none ran."""
    if not top1:
        return "-"
    mean = f"{100 * sum(top1) / len(top1):.1f}"
    return mean if len(top1) == 1 else f"{mean} ({' / '.join(f'{100 * t:.1f}' for t in top1)})"
