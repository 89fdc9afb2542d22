"""`ssl-vit report`: HTML / Markdown reports of run directories (needs the `report` extra,
matplotlib, which only the figure modules import)."""

from ssl_vit.report.build import build_report

__all__ = ["build_report"]
