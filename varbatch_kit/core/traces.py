"""Rollout traces on disk: JSONL, Parquet, and slime debug rollout dumps (``.pt``).

A trace has one row per sample with columns ``prompt_len``, ``response_len``
and ``rollout_id`` (optional: defaults to one rollout per sample) and an
optional ``loss_mask`` (list of 0/1 per response token). Any other column is
kept in :attr:`Rollouts.extra <varbatch_kit.core.rollouts.Rollouts.extra>`.

:func:`read_trace` reads ``.jsonl`` / ``.json`` and ``.parquet`` here and
hands slime's ``.pt`` debug dumps (``--save-debug-rollout-data``) to
:mod:`varbatch_kit.core.slime_dumps`, which reads them with the meaning slime's
trainer gives them, without unpickling anything. :func:`write_trace` writes
JSONL or Parquet; :func:`bundled_traces` lists the traces shipped with the
package. Errors are :class:`~varbatch_kit.core.trace_errors.TraceError`
(also ``varbatch_kit.TraceError``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit._extras import require
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.run_dumps import RUN_TEMPLATE_FIELD, is_run_path
from varbatch_kit.core.slime_dumps import read_slime_dump
from varbatch_kit.core.trace_errors import TraceError, at_file_rows, missing_trace
from varbatch_kit.resources import data_dir

__all__ = [
    "read_trace",
    "write_trace",
    "TRACES_DIR",
    "bundled_traces",
]

#: the rollout traces shipped with the package (``data/traces``)
TRACES_DIR = Path(str(data_dir("traces")))
REQUIRED = ("prompt_len", "response_len")
CORE_COLUMNS = ("prompt_len", "response_len", "rollout_id", "loss_mask")


def bundled_traces() -> dict[str, Path]:
    """Name → path of the traces shipped with the package."""
    return {p.name.split(".")[0]: p for p in sorted(TRACES_DIR.glob("*.jsonl"))}


def _from_columns(cols: dict[str, Any], path: Path, rows: list[int] | None = None,
                  unit: str = "row") -> Rollouts:
    missing = [c for c in REQUIRED if c not in cols]
    if missing:
        raise TraceError(
            f"trace {str(path)!r} lacks column(s) {missing}; a trace needs prompt_len and "
            f"response_len (and optionally rollout_id, loss_mask); found {sorted(cols)}"
        )
    masks = cols.get("loss_mask")
    if masks is not None and all(m is None for m in masks):
        masks = None
    elif masks is not None:  # a sample without a mask trains on every response token
        masks = [np.ones(int(n), dtype=np.int8) if m is None else m
                 for m, n in zip(masks, cols["response_len"])]
    extra = None
    others = {k: v for k, v in cols.items() if k not in CORE_COLUMNS}
    if others:
        import pandas as pd

        extra = pd.DataFrame(others)
    try:
        return Rollouts(  # lists, not arrays: a bad value is found at its own index
            prompt_len=list(cols["prompt_len"]),
            response_len=list(cols["response_len"]),
            rollout_id=None if cols.get("rollout_id") is None else list(cols["rollout_id"]),
            loss_masks=None if masks is None else [np.asarray(m) for m in masks],
            extra=extra,
        )
    except ValueError as e:  # sample i -> the file's line (JSONL) or row (Parquet)
        rows = rows if rows is not None else list(range(1, len(cols["response_len"]) + 1))
        raise TraceError(f"trace {str(path)!r} {at_file_rows(str(e), rows, unit)}") from None


def _read_jsonl(path: Path, lines: list[int] | None = None) -> dict[str, list]:
    """The columns of a JSONL trace; ``lines`` (if given) gets each row's line number."""
    cols: dict[str, list] = {}
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"trace {str(path)!r} line {lineno} is not JSON: {e}") from None
            if not isinstance(row, dict):
                raise TraceError(f"trace {str(path)!r} line {lineno} is not a JSON object")
            for k, v in row.items():
                cols.setdefault(k, []).append(v)
            if lines is not None:
                lines.append(lineno)
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        raise TraceError(f"trace {str(path)!r}: some rows lack some columns")
    return cols


def _read_parquet(path: Path) -> dict[str, list]:
    require("reading a .parquet trace", "parquet", ("pyarrow",))
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise TraceError(f"trace {str(path)!r} is not a readable Parquet file: {e}") from None
    return {name: table.column(name).to_pylist() for name in table.column_names}


def read_trace(path: str | Path) -> Rollouts:
    """Read a trace file into :class:`Rollouts`; the format follows the suffix.

    ``.jsonl`` / ``.parquet``: one row per sample (see the module docstring);
    columns other than ``prompt_len``, ``response_len``, ``rollout_id`` and
    ``loss_mask`` land in ``Rollouts.extra``.

    ``.pt`` / ``.pth``: a slime debug rollout dump, read as slime's trainer
    reads it (:func:`~varbatch_kit.core.slime_dumps.read_slime_dump`): ``total_len = len(tokens)``,
    ``response_len = response_length``, the rollout ids slime assigns, the
    loss masks it trains on (None -> all ones, ``remove_sample`` -> all zeros;
    the sample stays). ``Rollouts.extra`` then holds, one row per sample in
    dump order: ``index``, ``group_index`` and ``rollout_id`` as given
    (nullable Int64; ``group_index`` is the prompt group, not a rollout),
    ``status`` (string), ``truncated`` and ``remove_sample`` (bool),
    ``reward`` (as slime's ``Sample.reward``: float, NaN when None; a dict
    reward stays a dict, the column then holds objects, and the training
    engine picks ``LossConfig.reward_key`` from it), ``reward/<key>`` (float,
    NaN where absent) for every key of the dict rewards, ``raw_reward`` (only
    when a ``metadata["raw_reward"]`` replaces the reward, as slime does),
    ``label``, ``prompt``, ``response``, ``metadata`` (dict), ``tokens`` (list
    of int), ``rollout_log_probs`` and ``teacher_log_probs`` (list of float per
    response token, None for a sample without) and ``weight_versions`` (list
    of str: the policy versions that generated the sample; kept when a sample
    has one), each when the dump has it.

    A directory of dumps or slime's ``--save-debug-rollout-data`` template
    (``run/rollout_{rollout_id}.pt``) is a whole run, several rollout
    batches: read it with :func:`varbatch_kit.core.run_dumps.read_run`, which
    returns a :class:`~varbatch_kit.core.run_dumps.RunDumps`; given one here,
    ``read_trace`` raises a :class:`TraceError` saying so (one file is one
    :class:`Rollouts`).

    JSONL and Parquet traces keep any column as it is: a ``reward`` column of
    JSON objects (dict rewards) and a ``rollout_log_probs`` column of lists
    are read back the same way (a Parquet column cannot mix dicts and
    numbers: write such rollouts as JSONL).
    """
    p = Path(path)
    if is_run_path(p):
        raise TraceError(
            f"trace {str(p)!r} is a run (a folder or a {RUN_TEMPLATE_FIELD} template), not one "
            "trace file: read its rollout steps with varbatch_kit.core.run_dumps.read_run, or "
            "pass one dump of it")
    if not p.is_file():
        raise TraceError(missing_trace(str(path), bundled_traces()))
    suffix = p.suffix.lower()
    if suffix in (".pt", ".pth"):
        return read_slime_dump(p)
    lines: list[int] = []
    if suffix in (".jsonl", ".json"):
        cols = _read_jsonl(p, lines)
    elif suffix in (".parquet", ".pq"):
        cols = _read_parquet(p)
    else:
        raise TraceError(
            f"trace {str(p)!r}: unknown format {suffix!r}; use .jsonl, .parquet or a slime .pt dump"
        )
    if not cols or not any(len(v) for v in cols.values()):
        raise TraceError(f"trace {str(p)!r} holds no samples")
    if suffix in (".jsonl", ".json"):
        return _from_columns(cols, p, lines, "line")
    return _from_columns(cols, p)


def _plain(value: Any) -> Any:
    """A cell of ``Rollouts.extra`` as plain JSON-able Python (missing -> None)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        return None
    import pandas as pd

    if value is pd.NA or value is pd.NaT:
        return None
    return value


def write_trace(rollouts: Rollouts, path: str | Path, *, extra: bool = True) -> Path:
    """Write ``rollouts`` as JSONL or Parquet (by suffix).

    With ``extra`` (default), the columns of ``rollouts.extra`` are written
    too, except those named like a trace column (e.g. a slime dump's
    ``rollout_id`` as given: the trace's ``rollout_id`` is the one slime
    assigns).
    """
    p = Path(path)
    cols = {
        "prompt_len": rollouts.prompt_len.tolist(),
        "response_len": rollouts.response_len.tolist(),
        "rollout_id": rollouts.rollout_id.tolist(),
    }
    if rollouts.loss_masks is not None:
        cols["loss_mask"] = [m.tolist() for m in rollouts.loss_masks]
    if extra and rollouts.extra is not None:
        for name in rollouts.extra.columns:
            if str(name) not in CORE_COLUMNS:
                cols[str(name)] = [_plain(v) for v in rollouts.extra[name].tolist()]
    if p.suffix.lower() in (".parquet", ".pq"):
        require("writing a .parquet trace", "parquet", ("pyarrow",))
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrays = {}
        for name, values in cols.items():
            try:
                arrays[name] = pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as e:
                raise TraceError(
                    f"cannot write {str(p)!r}: column {name!r} of rollouts.extra does not fit "
                    f"a Parquet column ({e}); write a .jsonl trace or pass extra=False"
                ) from None
        pq.write_table(pa.table(arrays), p)
    elif p.suffix.lower() == ".jsonl":
        with p.open("w") as f:
            for i in range(len(rollouts)):
                f.write(json.dumps({k: v[i] for k, v in cols.items()}) + "\n")
    else:
        raise TraceError(f"cannot write {str(p)!r}: use a .jsonl or .parquet suffix")
    return p
