"""The layout is the architecture: each layer imports only the layers below it, and no cycles.

Read from the source with ``ast`` (every ``import``, also inside functions),
so a shell import hidden in a core function fails here too. The table is the
one in ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _paths import PACKAGE

PKG = PACKAGE

#: layer -> the layers it may import (itself included)
ALLOWED = {
    "resources": {"resources"},
    "policies": {"policies"},
    "core": {"core", "policies", "resources"},
    "report": {"report"},
    "analysis": {"analysis", "core", "policies", "report", "resources"},
    "ui": {"ui", "analysis", "core", "policies", "report", "resources"},
    "compat": {"compat", "core", "policies", "report", "resources"},
    "train": {"train", "core", "policies", "report", "analysis", "resources"},
    "cli": {"cli", "ui", "train", "compat", "analysis", "core", "policies", "report", "resources"},
}
#: third-party packages a pure layer must never import
SHELL_LIBRARIES = {"plotly", "ipywidgets", "anywidget", "megatron", "nbclient", "nbconvert",
                   "jupyterlab", "playwright"}
PURE = {"resources", "policies", "core", "report", "analysis"}
#: the stable import paths at the top (``varbatch_kit.viz`` is ``varbatch_kit.ui.viz``, ...)
ALIASES = {"__init__", "io", "viz", "widgets", "quality", "simulate", "sweeps", "optimal",
           "demo"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute names of everything ``path`` imports, with line numbers."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path).split(".") if PKG in path.parents else ["outside"]
    if path.name != "__init__.py":
        here = here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _layer(module: str) -> str | None:
    """The layer folder of a module; None for the package root and ``_version`` (neutral)."""
    parts = module.split(".")
    if parts[0] != "varbatch_kit" or len(parts) < 2 or parts[1] == "_version":
        return None
    return parts[1]


MODULES = {p: _module_name(p) for p in sorted(PKG.rglob("*.py"))
           if "notebooks" not in p.parts}
KNOWN = set(MODULES.values())


def _edges():
    for path, name in MODULES.items():
        for target, line in _imports(path):
            if target in KNOWN:
                yield path, name, target, line


def test_every_module_sits_in_a_layer():
    loose = [n for n in MODULES.values() if n.count(".") == 1
             and n.split(".")[1] not in ALIASES | set(ALLOWED) | {"_version"}]
    assert not loose, f"modules outside every layer folder: {loose}"


def test_layers_import_only_downwards():
    bad = []
    for _path, name, target, line in _edges():
        src, dst = _layer(name), _layer(target)
        if src in ALIASES or src is None or dst is None:
            continue
        if dst in ALIASES:
            bad.append(f"{name}:{line} imports the alias {target}; import the module itself")
        elif dst not in ALLOWED[src]:
            bad.append(f"{name}:{line} ({src}) imports {target} ({dst})")
    assert not bad, "\n".join(bad)


def test_pure_layers_import_no_shell_library():
    bad = []
    for path, name in MODULES.items():
        if _layer(name) not in PURE:
            continue
        for target, line in _imports(path):
            top = target.split(".")[0]
            if top in SHELL_LIBRARIES or target.startswith("torch.distributed") and \
                    _layer(name) != "report":
                bad.append(f"{name}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {n: set() for n in KNOWN}
    for _, name, target, _ in _edges():
        if target != name and not name.startswith(target + "."):  # a package's own __init__
            graph[name].add(target)
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("alias,module", [
    ("io", "varbatch_kit.core.traces"), ("viz", "varbatch_kit.ui.viz"),
    ("widgets", "varbatch_kit.ui.widgets"), ("quality", "varbatch_kit.analysis.quality"),
    ("simulate", "varbatch_kit.analysis.simulate"), ("sweeps", "varbatch_kit.analysis.sweeps"),
    ("demo", "varbatch_kit.cli.demo"),
])
def test_stable_import_paths_are_the_modules_themselves(alias, module):
    import importlib

    assert importlib.import_module(f"varbatch_kit.{alias}") is importlib.import_module(module)


def test_optimal_path_holds_the_solver_and_the_gap_study():
    from varbatch_kit import optimal
    from varbatch_kit.analysis.optimum_gap import gap_to_optimal
    from varbatch_kit.policies.optimal import solve_min_max_rank_flops

    assert optimal.solve_min_max_rank_flops is solve_min_max_rank_flops
    assert optimal.gap_to_optimal is gap_to_optimal


def test_the_checker_sees_a_violation(tmp_path):
    """The import reader finds imports inside functions (so the layer test can fail)."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from varbatch_kit.ui import viz\n    import plotly\n")
    assert ("varbatch_kit.ui.viz", 2) in _imports(f)
    assert ("plotly", 3) in _imports(f)
