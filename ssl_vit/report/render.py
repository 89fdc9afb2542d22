"""Writing the report: `report.html` (self-contained, PNGs as base64 data URIs) and
`report.md` (PNGs in a `figures/` folder next to it), from a list of sections."""

from __future__ import annotations

import base64
import html
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from ssl_vit.atomic import write_bytes, write_text

__all__ = ["Chart", "Section", "Table", "write_html", "write_markdown"]


@dataclass
class Chart:
    """A rendered figure: `name` (file stem), PNG bytes, caption."""

    name: str
    png: bytes
    caption: str = ""


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""  # a line above the table (plain text)


@dataclass
class Section:
    title: str
    notes: list[str] = field(default_factory=list)  # paragraphs (plain text)
    tables: list[Table] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)

    def chart(self, name: str, fig, caption: str) -> None:
        """Add a matplotlib Figure as a chart (PNG)."""
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        self.charts.append(Chart(name, buf.getvalue(), caption))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


CSS = """
body { font-family: system-ui, sans-serif; max-width: 1280px; margin: 2em auto; padding: 0 1em;
       color: #222; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; font-size: 13px; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
td { white-space: pre; }
div.scroll { overflow-x: auto; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f4; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
p.note { color: #555; }
nav a { margin-right: 1em; }
"""


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows
    )
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    caption = f"<p class='note'>{html.escape(t.caption)}</p>" if t.caption else ""
    return f"{caption}<div class='scroll'>{table}</div>"


def write_html(path: Path, title: str, intro: list[str], sections: list[Section]) -> None:
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    parts += [f"<p class='note'>{html.escape(p)}</p>" for p in intro]
    parts.append(
        "<nav>"
        + "".join(f"<a href='#{_slug(s.title)}'>{html.escape(s.title)}</a>" for s in sections)
        + "</nav>"
    )
    for s in sections:
        parts.append(f"<h2 id='{_slug(s.title)}'>{html.escape(s.title)}</h2>")
        parts += [f"<p class='note'>{html.escape(p)}</p>" for p in s.notes]
        parts += [_html_table(t) for t in s.tables]
        for c in s.charts:
            data = base64.b64encode(c.png).decode("ascii")
            parts.append(
                f"<figure><img alt='{html.escape(c.name)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{html.escape(c.caption)}</figcaption></figure>"
            )
    parts.append("</body></html>\n")
    write_text(path, "\n".join(parts))  # atomic: a failed write keeps the earlier report


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def write_markdown(path: Path, title: str, intro: list[str], sections: list[Section]) -> None:
    """report.md with its figures written to `figures/NAME.png` next to it."""
    fig_dir = path.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", *[f"{p}\n" for p in intro]]
    for s in sections:
        lines += [f"## {s.title}", ""]
        lines += [f"{p}\n" for p in s.notes]
        for t in s.tables:
            lines += [t.caption, ""] if t.caption else []
            lines.append("| " + " | ".join(map(_md_cell, t.header)) + " |")
            lines.append("|" + "|".join(["---"] + ["---:"] * (len(t.header) - 1)) + "|")
            lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in t.rows]
            lines.append("")
        for c in s.charts:
            write_bytes(fig_dir / f"{c.name}.png", c.png)
            lines += [f"![{c.name}](figures/{c.name}.png)", "", f"*{c.caption}*", ""]
    write_text(path, "\n".join(lines))
