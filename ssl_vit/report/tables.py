"""The report's tables: the summary (one row per pretraining run, plus random init /
scratch) and the list of runs. `groups` is `runs.link_runs`'s output."""

from __future__ import annotations

from ssl_vit.eval.shots import shot_order
from ssl_vit.jobs import FEWSHOT, FINETUNE, PREDICT, PRETRAIN, Job
from ssl_vit.report.render import Section, Table
from ssl_vit.report.runs import Run, fewshot_pool, fewshot_table

__all__ = ["origin", "summary_section", "runs_section"]

Groups = dict[str | None, list[tuple[Run, int | None]]]


def _pct(entry: dict | None) -> str:
    return "-" if not entry else f"{100 * entry['mean']:.1f} ± {100 * entry.get('std', 0):.1f}"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _cell(values: list[tuple[str, str]]) -> str:
    """Several runs' values in one cell, one per line, each labelled when there are several."""
    if len(values) == 1:
        return values[0][1]
    return "\n".join(f"{v} ({label})" for label, v in values) if values else "-"


def origin(run: Run, groups: Groups) -> str:
    """Where a few-shot / fine-tune run's encoder came from, in words."""
    for owner, members in groups.items():
        for member, step in members:
            if member is run:
                if owner is None:
                    return "random init"
                return f"{owner} @ step {step}" if step is not None else owner
    return ""


def _latest(members: list[tuple[Run, int | None]], job: Job) -> list[Run]:
    """The finished `job` runs of the newest checkpoint (a row shows the final encoder)."""
    members = [(m, s) for m, s in members if m.job is job and m.finished]
    steps = [s for _, s in members if s is not None]
    newest = max(steps) if steps else None
    return [m for m, s in members if s == newest]


def _summary_row(label: str, pre: Run | None, members: list, shots: list) -> list[str]:
    obj = (pre.config.get("objective") or {}) if pre else {}
    fewshots, finetunes = _latest(members, FEWSHOT), _latest(members, FINETUNE)
    tables = [(fewshot_pool(m.config), fewshot_table(m.results)) for m in fewshots]
    if not tables and pre and pre.results.get("fewshot"):
        tables = [("in pretraining", fewshot_table(pre.results["fewshot"]))]
    top1 = [
        (m.name, f"{100 * t:.1f}") for m in finetunes if (t := m.results.get("top1")) is not None
    ]
    return [
        label,
        obj.get("target", "-"),
        f"{obj['mask_ratio']:.0%}" if "mask_ratio" in obj else "-",
        str(pre.results.get("step", "-")) if pre else "0",
        *[_cell([(pool, _pct(t.get(k))) for pool, t in tables]) for k in shots],
        _cell(top1),
        _minutes(pre.results.get("wall_time_s")) if pre else "-",
        _cell([(m.name, _minutes(m.results.get("wall_time_s"))) for m in finetunes]),
    ]


def summary_section(runs: list[Run], groups: Groups) -> Section:
    pretrains = [r for r in runs if r.job is PRETRAIN]
    tables = [fewshot_table(m.results) for ms in groups.values() for m, _ in ms]
    tables += [fewshot_table(p.results.get("fewshot") or {}) for p in pretrains]
    shots = sorted({k for t in tables for k in t}, key=shot_order)
    rows = [_summary_row(p.name, p, groups.get(p.name, []), shots) for p in pretrains]
    if groups.get(None):
        rows.append(_summary_row("random init / scratch", None, groups[None], shots))
    header = ["run", "target", "corrupted", "pretrain steps"]
    header += [f"{k}-shot (%)" for k in shots]
    header += ["fine-tune top-1 (%)", "pretrain time", "fine-tune time"]
    notes = [
        "One row per pretraining run (its last checkpoint); few-shot and fine-tune runs are "
        "attached to it by the checkpoint path in their config / results. Few-shot: mean ± std "
        "over seeds at the first L2 regularizer; several values in a cell are several runs "
        "(e.g. cls / gap pooling)."
    ]
    if not rows:
        notes.append("No runs to summarize.")
    return Section("Summary", notes=notes, tables=[Table(header, rows)] if rows else [])


def runs_section(runs: list[Run], groups: Groups) -> Section:
    rows = []
    for r in runs:
        steps = r.results.get("step") if r.job is not FEWSHOT else None
        status = "finished" if r.finished else "no results.json (running or stopped)"
        rows.append(
            [
                r.name,
                r.job.name,
                str(r.results.get("checkpoint", "")) if r.job is PREDICT else origin(r, groups),
                "-" if steps is None else str(steps),
                _minutes(r.results.get("wall_time_s")),
                status,
                str(r.path),
            ]
        )
    header = ["run", "kind", "started from", "steps", "wall time", "status", "directory"]
    return Section("Runs", tables=[Table(header, rows)])
