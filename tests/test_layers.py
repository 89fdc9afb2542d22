"""The package's layers import in one direction, and no two modules import each other.

Every `import` of `ssl_vit/` and `pipelines/` is read with `ast` (at module level, inside
functions and under `TYPE_CHECKING` alike: a late import is a dependency all the same), and
each module is placed in a layer by its sub-package. A module may import its own layer or one
before it, never one after; and the import graph has no cycle (a cycle is two modules that
cannot be understood, tested or moved apart).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. Small torch-free helpers, then config -> data -> run directories -> model ->
# objectives -> eval -> train -> what uses trained models (publish, report, study) -> what
# drives the jobs (the CLI, the pipelines, the benchmarks that run them in process, and the
# package's public API, which re-exports from every layer).
LAYERS = [
    {"errors", "jsonfile", "atomic", "progress", "seeds", "watchdog", "children"},
    {"config", "jobs"},
    {"data", "datasets"},
    {"runs"},
    {"model", "interop"},
    {"objectives"},
    {"eval"},
    {"train"},
    {"publish", "report", "study"},
    {"cli", "cli_data", "bench", "pipelines", "ssl_vit"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in [*ROOT.glob("ssl_vit/**/*.py"), *ROOT.glob("pipelines/*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports: `from a.b import c` is `a.b.c` where that is a
    module, else `a.b`; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    group = parts[0] if parts[0] == "pipelines" or len(parts) == 1 else parts[1]
    for i, layer in enumerate(LAYERS):
        if group in layer:
            return i
    raise AssertionError(f"{module}: no layer for {group!r}; add it to LAYERS")


@functools.cache  # parsed once for the three tests (it reads every module)
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_goes_down_the_layers():
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, targets in sorted(_graph().items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = _graph()
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The two checks are not vacuous: the parser finds the imports they must refuse."""
    graph = _graph()
    assert "ssl_vit.errors" in graph["ssl_vit.config.checks"]  # module level
    assert "ssl_vit.train.encoder_init" in graph["ssl_vit.train.preflight"]  # in a function
    assert "ssl_vit.seeds" in graph["ssl_vit.data.stages"]  # `from ssl_vit import seeds`
    assert _layer("ssl_vit.eval.readouts") < _layer("ssl_vit.train.loop")
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in _strongly_connected(cyclic) if len(c) > 1] == [{"a", "b", "c"}]
