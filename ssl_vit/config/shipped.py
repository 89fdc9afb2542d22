"""The configs shipped with ssl-vit: `configs/` of a checkout, or the `ssl_vit.configs` package
data of an installed wheel (the same files). `--config pretrain/smoke` names one of them."""

from __future__ import annotations

from pathlib import Path

from ssl_vit.jobs import PRETRAIN

__all__ = ["configs_dir", "find_config", "shipped_configs"]


def configs_dir() -> Path | None:
    """The directory of the shipped configs (installed package first, then the checkout)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "configs", package.parent / "configs"):
        if (candidate / PRETRAIN.name).is_dir():  # configs/<job>/<name>.yaml
            return candidate
    return None


def shipped_configs() -> list[str]:
    """Names of the shipped configs, e.g. ['accelerate/1gpu', ..., 'study/quickstart']."""
    root = configs_dir()
    if root is None:
        return []
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def find_config(path: str | Path) -> Path:
    """`path` if it is a file; else the shipped config it names (`pretrain/smoke`, with or
    without `.yaml`, or `configs/pretrain/smoke.yaml` from outside a checkout); else `path`."""
    path = Path(path)
    root = configs_dir()
    if path.is_file() or root is None or path.is_absolute():
        return path
    name = path.as_posix().removeprefix("configs/")
    for candidate in (root / name, root / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    return path
