"""A notebook's settings cell: the one code cell a user edits to point it at their data.

Every notebook opens with one code cell tagged :data:`PARAMETERS_TAG` (papermill's name)
that assigns its settings (trace or dump path, dp / cp, the token cap, ...); every later cell
reads those names. :func:`parameters_cell` finds it; :func:`set_parameters` gives settings new
values the way a user would, by rewriting their assignments in that cell only (the demo's
smaller matrix, the tests that run a notebook on another dump).
"""

from __future__ import annotations

__all__ = ["PARAMETERS_TAG", "parameters_cell", "set_parameters"]

#: the tag of a notebook's settings cell (papermill's name): the one cell a user edits
PARAMETERS_TAG = "parameters"


def parameters_cell(nb):
    """The notebook's one code cell tagged :data:`PARAMETERS_TAG`; ``ValueError`` if none or
    several."""
    cells = [c for c in nb.cells
             if c.cell_type == "code" and PARAMETERS_TAG in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"the notebook has {len(cells)} code cells tagged "
                         f"{PARAMETERS_TAG!r}; expected exactly one (its settings cell)")
    return cells[0]


def set_parameters(nb, values: dict):
    """Give the settings of ``nb``'s parameters cell new values, in place; returns ``nb``.

    Each name of ``values`` must be assigned at the top level of the cell (``NAME = ...``);
    the right-hand side of that assignment is replaced by the value's ``repr`` (a path
    becomes its string), the rest of the cell (comments, other settings) stays as written.
    A name the cell does not assign raises ``KeyError`` naming the cell's settings, so a
    renamed setting cannot be overridden silently. Values must be Python literals (numbers,
    strings, None, bools, and lists / tuples / dicts of them).
    """
    import ast
    import os

    cell = parameters_cell(nb)
    source = cell.source
    tree = ast.parse(source)
    spans = {}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        for t in targets:
            if isinstance(t, ast.Name):
                spans[t.id] = node.value
    missing = sorted(set(values) - set(spans))
    if missing:
        raise KeyError(f"the parameters cell assigns no {missing}; its settings are "
                       f"{sorted(spans)}")
    lines = [line.encode() for line in source.splitlines(keepends=True)]
    # the AST's columns count UTF-8 bytes; replace from the last assignment up
    for name in sorted(values, key=lambda n: (spans[n].lineno, spans[n].col_offset),
                       reverse=True):
        v, node = values[name], spans[name]
        v = os.fspath(v) if isinstance(v, os.PathLike) else v
        text = repr(v)
        try:
            same = ast.literal_eval(text) == v
        except (ValueError, SyntaxError):
            same = False
        if same is not True:
            raise ValueError(f"{name}={v!r} is not a Python literal")
        first, last = node.lineno - 1, node.end_lineno - 1
        head, tail = lines[first][:node.col_offset], lines[last][node.end_col_offset:]
        lines[first:last + 1] = [head + text.encode() + tail]
    cell.source = b"".join(lines).decode()
    return nb
