"""The layout is the architecture: each layer imports only the layers below it, and no cycles.

Read from the source with ``ast`` (every ``import``, also inside functions),
so a shell import hidden in a core function fails here too. The table is the
one in ``docs/architecture.md``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from _paths import PACKAGE, REPO

PKG = PACKAGE

#: layer -> the layers it may import (itself included)
ALLOWED = {
    "checks": {"checks"},
    "resources": {"resources"},
    "policies": {"policies"},
    "core": {"core", "policies", "resources"},
    "report": {"report"},
    "analysis": {"analysis", "core", "policies", "report", "resources"},
    # ui -> compat: the recommend explorer runs compat.slime.recommend on slime's flags (inside
    # its methods); compat never imports ui
    "ui": {"ui", "compat", "analysis", "core", "policies", "report", "resources"},
    # compat -> train: train_flags maps slime's command line onto TrainConfig (imported inside
    # the function, as varbatch_kit.train needs the [train] extra); train never imports compat
    "compat": {"compat", "analysis", "core", "policies", "report", "resources", "train"},
    "train": {"train", "core", "policies", "report", "analysis", "resources"},
    "cli": {"cli", "ui", "train", "compat", "analysis", "core", "policies", "report", "resources"},
}
#: the integer and range checks (``checks.py``): every layer may import them
for _layers in ALLOWED.values():
    _layers.add("checks")
#: third-party packages a pure layer must never import
SHELL_LIBRARIES = {"plotly", "ipywidgets", "anywidget", "megatron", "nbclient", "nbconvert",
                   "jupyterlab", "playwright"}
PURE = {"checks", "resources", "policies", "core", "report", "analysis"}
#: modules at the top that belong to no layer (any layer may import them)
NEUTRAL = {"_version", "_extras"}
#: the alias modules that are gone (each name has one import path: its layer module's)
REMOVED_ALIASES = ("io", "viz", "widgets", "quality", "simulate", "sweeps", "optimal", "demo")
#: the modules that gather names defined elsewhere (besides package ``__init__`` files)
GATHERERS = {"varbatch_kit.ui.viz", "varbatch_kit.ui.widgets"}


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
    """The layer folder of a module; None for the package root and :data:`NEUTRAL` modules."""
    parts = module.split(".")
    if parts[0] != "varbatch_kit" or len(parts) < 2 or parts[1] in NEUTRAL:
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
             and n.split(".")[1] not in set(ALLOWED) | NEUTRAL]
    assert not loose, f"modules outside every layer folder: {loose}"


def _doc_module_cells() -> dict[str, str]:
    """``docs/architecture.md``'s layer table: layer -> its ``modules`` cell."""
    rows = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 4 else None
        if m:
            rows[m.group(1)] = cells[1]
    return rows


def _missing_from_doc(rows: dict[str, str]) -> list[str]:
    """Modules not named in their layer's row: ``name`` for a module, ``name/`` for a package,
    ``name.py`` for a module at the top; each folder above a module named too."""
    missing = []
    for path, name in MODULES.items():
        parts = name.split(".")[1:]
        if not parts or parts[0] in NEUTRAL:
            continue
        cell = rows.get(parts[0])
        if cell is None:
            missing.append(f"{name}: no row for layer {parts[0]!r}")
            continue
        if len(parts) == 1:
            words = [] if path.name == "__init__.py" else [f"`{parts[0]}.py`"]
        else:
            words = [f"`{d}/`" for d in parts[1:-1]]
            words.append(f"`{parts[-1]}/`" if path.name == "__init__.py" else f"`{parts[-1]}`")
        if not all(w in cell for w in words):
            missing.append(f"{name} ({path.relative_to(PKG.parent)}): not named in its row")
    return missing


def test_every_module_is_named_in_the_architecture_doc():
    """The module table of ``docs/architecture.md`` lists every module in its layer's row."""
    missing = _missing_from_doc(_doc_module_cells())
    assert not missing, "docs/architecture.md omits:\n" + "\n".join(missing)


def test_the_doc_checker_sees_a_missing_module():
    rows = _doc_module_cells()
    assert "`checkpoint`" in rows["train"]
    rows["train"] = rows["train"].replace("`checkpoint`", "")
    assert _missing_from_doc(rows) == [
        "varbatch_kit.train.runs.checkpoint (varbatch_kit/train/runs/checkpoint.py): "
        "not named in its row"]


def test_layers_import_only_downwards():
    bad = []
    for _path, name, target, line in _edges():
        src, dst = _layer(name), _layer(target)
        if src is None or dst is None:
            continue
        if dst not in ALLOWED[src]:
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


def _assigns_sys_modules(path: Path) -> list[int]:
    """Lines of ``path`` that assign, delete or update an entry of ``sys.modules``."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def is_sys_modules(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "modules"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        lines += [node.lineno for t in targets
                  if isinstance(t, ast.Subscript) and is_sys_modules(t.value)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "setdefault", "__setitem__", "pop")
                and is_sys_modules(node.func.value)):
            lines.append(node.lineno)
    return lines


def test_no_module_replaces_itself_in_sys_modules():
    bad = [f"{name}:{line}" for path, name in MODULES.items()
           for line in _assigns_sys_modules(path)]
    assert not bad, "modules that write sys.modules (an alias layer):\n" + "\n".join(bad)


@pytest.mark.parametrize("alias", REMOVED_ALIASES)
def test_the_alias_modules_are_gone(alias):
    """``varbatch_kit.viz`` & co. no longer exist: the package holds no such module.

    Looked up with the path finder on the package's own folder, so an editable
    install of another checkout (whose finder would map the name) does not hide
    a leftover file.
    """
    import importlib.machinery

    import varbatch_kit

    assert not (PKG / f"{alias}.py").exists() and not (PKG / alias).exists()
    assert importlib.machinery.PathFinder.find_spec(
        f"varbatch_kit.{alias}", list(varbatch_kit.__path__)) is None
    assert alias not in {m.name for m in __import__("pkgutil").iter_modules(
        list(varbatch_kit.__path__))}


def _public_exports() -> dict[str, dict[str, object]]:
    """Every module's ``__all__``: module name -> {exported name: object}."""
    import importlib

    out = {}
    for name in sorted(KNOWN):
        mod = importlib.import_module(name)
        out[name] = {n: getattr(mod, n) for n in getattr(mod, "__all__", ())}
    return out


def _ours(obj) -> bool:
    """A class or function defined in the package (constants and re-exported libraries aside)."""
    import inspect

    return ((inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", "").startswith("varbatch_kit."))


@pytest.fixture(scope="module")
def exports():
    return _public_exports()


def test_no_function_or_class_has_a_second_name(exports):
    """``cp_plan = cp_plan_figure`` and the like: one object, one public name."""
    names: dict[int, set[str]] = {}
    where: dict[int, str] = {}
    for table in exports.values():
        for n, obj in table.items():
            if _ours(obj):
                names.setdefault(id(obj), set()).add(n)
                where[id(obj)] = f"{obj.__module__}.{obj.__qualname__}"
    bad = [f"{where[k]} is exported as {sorted(v)}" for k, v in names.items() if len(v) > 1]
    assert not bad, "\n".join(bad)


def test_a_plain_module_exports_only_what_it_defines(exports):
    """Outside package ``__init__`` files and the gatherers, ``__all__`` is the module's own."""
    bad = []
    for module, table in exports.items():
        path = next(p for p, n in MODULES.items() if n == module)
        if path.name == "__init__.py" or module in GATHERERS:
            continue
        bad += [f"{module} exports {n}, defined in {obj.__module__}"
                for n, obj in table.items() if _ours(obj) and obj.__module__ != module]
    assert not bad, "\n".join(bad)


def test_each_name_is_re_exported_by_at_most_one_module(exports):
    """A name defined in one module is gathered by at most one package or gatherer."""
    by: dict[int, list[str]] = {}
    for module, table in exports.items():
        for n, obj in table.items():
            if _ours(obj) and obj.__module__ != module:
                by.setdefault(id(obj), []).append(f"{module}.{n}")
    bad = [" and ".join(v) for v in by.values() if len(v) > 1]
    assert not bad, "names with two import paths:\n" + "\n".join(bad)


def test_the_top_level_names_come_from_the_pure_layers(exports):
    import varbatch_kit

    assert {"read_trace", "bundled_traces", "simulate", "build_schedule"} <= set(
        varbatch_kit.__all__)
    for n, obj in exports["varbatch_kit"].items():
        if _ours(obj):
            assert _layer(obj.__module__) in PURE, f"varbatch_kit.{n} is from {obj.__module__}"


def test_import_varbatch_kit_imports_no_shell_library():
    import subprocess
    import sys

    code = ("import sys, varbatch_kit\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {SHELL_LIBRARIES!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_the_sys_modules_checker_sees_an_alias(tmp_path):
    f = tmp_path / "alias.py"
    f.write_text("import sys\nfrom x import y as _m\nsys.modules[__name__] = _m\n"
                 "sys.modules.update(a=1)\n")
    assert _assigns_sys_modules(f) == [3, 4]


def test_the_checker_sees_a_violation(tmp_path):
    """The import reader finds imports inside functions (so the layer test can fail)."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from varbatch_kit.ui import viz\n    import plotly\n")
    assert ("varbatch_kit.ui.viz", 2) in _imports(f)
    assert ("plotly", 3) in _imports(f)


# ------------------------------------------------------------ the engine's sub-packages
#: ``varbatch_kit/train``'s sub-packages, bottom up: each may import only itself and those before
TRAIN_STACK = ("config", "parallel", "model", "data", "step", "runs", "rl", "measure")
#: libraries ``train/config`` (pure) must not import, even inside a function
ENGINE_LIBRARIES = {"torch", "megatron", "transformers", "safetensors"}
TRAIN = PKG / "train"


def _train_violations(paths) -> list[str]:
    out = []
    for path in paths:
        sub = path.relative_to(TRAIN).parts[0]
        allowed = set(TRAIN_STACK[: TRAIN_STACK.index(sub) + 1])
        for target, line in _imports(path):
            parts = target.split(".")
            if parts[:2] == ["varbatch_kit", "train"] and len(parts) > 2 \
                    and parts[2] in TRAIN_STACK and parts[2] not in allowed:
                out.append(f"{path.relative_to(PKG.parent)}:{line} ({sub}/) imports {target}")
            if sub == "config" and parts[0] in ENGINE_LIBRARIES:
                out.append(f"{path.relative_to(PKG.parent)}:{line} (config/ is pure) imports "
                           f"{target}")
    return out


def test_train_is_only_sub_packages_stacked_upward():
    top = sorted(p.name for p in TRAIN.glob("*.py") if p.name != "__init__.py")
    assert top == [], f"modules at the top of varbatch_kit/train: {top}"
    subs = sorted(p.name for p in TRAIN.iterdir() if (p / "__init__.py").is_file())
    assert subs == sorted(TRAIN_STACK)
    bad = _train_violations(p for p in TRAIN.rglob("*.py") if p.parent != TRAIN)
    assert not bad, "\n".join(bad)


def test_the_train_stack_checker_sees_an_upward_import_and_torch_in_config(tmp_path):
    fake = TRAIN / "config" / "_probe_that_does_not_exist.py"
    (tmp_path / "m.py").write_text("def f():\n    from varbatch_kit.train.step import train_step\n"
                                   "    import torch\n")

    class P(type(fake)):  # the probe's text, read from tmp_path, at a config/ path
        def read_text(self, *a, **k):
            return (tmp_path / "m.py").read_text()

    bad = _train_violations([P(fake)])
    assert any("(config/) imports varbatch_kit.train.step" in b for b in bad), bad
    assert any("(config/ is pure) imports torch" in b for b in bad), bad


def test_every_train_module_imports_by_its_dotted_name():
    """``import varbatch_kit.train.<pkg>.<mod> as m`` works for every module: no sub-package
    is shadowed by a public name of ``varbatch_kit.train`` (a ``run/`` package would be, by the
    function ``run``); and ``varbatch_kit.train.run`` stays that function."""
    import subprocess
    import sys

    pytest.importorskip("megatron.core")
    names = sorted(_module_name(p) for p in TRAIN.rglob("*.py") if p.name != "__init__.py")
    code = "\n".join(f"import {n} as _m" for n in names) + (
        "\nimport varbatch_kit.train as t\nassert callable(t.run) and t.run.__name__ == 'run'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
