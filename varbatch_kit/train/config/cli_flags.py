"""Command-line flags generated from :class:`TrainConfig`'s fields, and the config back.

One rule: the sub-config field ``GROUP.NAME`` (``optim.lr``, ``run.max_steps``,
``model.num_layers``, ...) is the flag ``--GROUP.NAME`` with dashes between the words
(``--optim.lr``, ``--run.max-steps``, ``--model.num-layers``); a top-level field
(``mode``, ``cp_impl``) is ``--NAME`` (``--mode``, ``--cp-impl``), as every other flag of
the CLI (``--global-batch-size``). The flag's type comes from the field's annotation
(``int``, ``float``, ``str``, ``X | None``, ``tuple[int, ...]`` as several
values), its help from the field's ``metadata["help"]``, its choices from
``metadata["choices"]``, its default is the field's. The layout (the
``schedule`` field, a ScheduleConfig) is not generated here: the train CLI
spells its flags after ScheduleConfig's fields (``--dp``,
``--global-batch-size``, ...).

:func:`add_config_flags` adds the flags to a parser (``many`` names flags that
take several values, for a sweep); :func:`config_kwargs` turns parsed
arguments into ``TrainConfig`` keyword arguments (a sub-config each).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any

from varbatch_kit.train.config.train_config import SUB_CONFIGS, TrainConfig

__all__ = ["add_config_flags", "config_kwargs", "flag_fields"]

# TrainConfig's own fields that get a flag (the schedule has its own flags)
TOP_LEVEL = ("mode", "tp", "ep", "sequence_parallel", "cp_impl", "precision")


def _dashed(name: str) -> str:
    """A field name as the CLI spells it: words joined by dashes, as slime's flags are."""
    return name.replace("_", "-")


def _scalar_type(tp: Any) -> tuple[Any, bool, bool]:
    """(element type, optional, several values) of an annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        (tp,) = args
        origin = typing.get_origin(tp)
    if origin is tuple:
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False


def flag_fields(groups: tuple[str, ...] | None = None) -> list[tuple[str, str, Any, Any]]:
    """``(dest, flag, field, annotation)`` for every generated flag, in field order.

    ``groups``: the sub-configs to include (default all, plus the top-level fields)."""
    out = []
    hints = typing.get_type_hints(TrainConfig)
    if groups is None:
        for name in TOP_LEVEL:
            f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
            out.append((name, f"--{_dashed(name)}", f, hints[name]))
    for group, cls in SUB_CONFIGS.items():
        if groups is not None and group not in groups:
            continue
        sub_hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((f"{group}.{f.name}", f"--{group}.{_dashed(f.name)}", f,
                        sub_hints[f.name]))
    return out


def add_config_flags(parser: argparse.ArgumentParser, *, groups: tuple[str, ...] | None = None,
                     many: tuple[str, ...] = ()) -> None:
    """Add the generated flags (one argument group per sub-config) to ``parser``.

    ``many``: dests (``"mode"``, ``"optim.lr"``) that take several values, each a run.
    """
    titles: dict[str, argparse._ArgumentGroup] = {}
    for dest, flag, f, tp in flag_fields(groups):
        group = dest.partition(".")[0] if "." in dest else "mode"
        if group not in titles:
            cls = SUB_CONFIGS.get(group)
            doc = ((cls.__doc__ or "").strip().splitlines()[0] if cls
                   else "the report mode, tp, cp_impl and precision")
            doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc.rstrip(".").replace("``", ""))
            titles[group] = parser.add_argument_group(f"{group}: {doc}")
        elem, optional, several = _scalar_type(tp)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f.metadata.get("help", "")
        if default not in (None, ()):
            text += f" (default {default!r})"
        kw: dict[str, Any] = {"dest": dest, "help": text}
        if elem is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = elem if elem in (int, float) else str
            kw["metavar"] = {int: "N", float: "X"}.get(elem, "S")
        if "choices" in f.metadata:
            kw["choices"] = list(f.metadata["choices"])
            kw.pop("metavar", None)
        if several:
            kw["nargs"] = "*"
            kw["default"] = list(default)
        elif dest in many:
            kw["nargs"] = "+"
            kw["default"] = [default]
            kw["help"] += " (several values: every combination)"
        else:
            kw["default"] = default
        if optional and not several and elem is not bool:
            kw["help"] += "; 'none' for None"
            base = kw["type"]
            kw["type"] = lambda s, _b=base: None if s.lower() == "none" else _b(s)
        titles[group].add_argument(flag, **kw)


def config_kwargs(args: argparse.Namespace, *, groups: tuple[str, ...] | None = None,
                  chosen: dict[str, Any] | None = None) -> dict[str, Any]:
    """``TrainConfig`` keyword arguments from parsed flags: one sub-config per group, and the
    top-level fields. ``chosen`` overrides values of ``many`` flags (one combination)."""
    chosen = chosen or {}
    values: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for dest, _, _field, tp in flag_fields(groups):
        v = chosen.get(dest, getattr(args, dest))
        if _scalar_type(tp)[2]:
            v = tuple(v)
        group, dot, name = dest.partition(".")
        if dot:
            values.setdefault(group, {})[name] = v
        else:
            top[dest] = v
    return {**top, **{g: SUB_CONFIGS[g](**kw) for g, kw in values.items()}}
