"""Rollout traces on disk: JSONL, Parquet and slime debug rollout dumps (``.pt``).

A trace has one row per sample with columns ``prompt_len``, ``response_len``
and ``rollout_id`` (optional: defaults to one rollout per sample) and an
optional ``loss_mask`` (list of 0/1 per response token).

slime's ``.pt`` debug dumps are read with ``torch.load(weights_only=True)``:
plain containers, numbers, strings and tensors only, never arbitrary pickled
objects. A dump that would need unpickling is refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.data import files as data_files

__all__ = ["read_trace", "write_trace", "TRACES_DIR", "bundled_traces", "TraceError"]

#: the rollout traces shipped with the package (``varbatch_kit/data/traces``)
TRACES_DIR = Path(str(data_files("traces")))
REQUIRED = ("prompt_len", "response_len")


class TraceError(ValueError):
    """A trace file is missing, malformed or unsafe to load."""


def bundled_traces() -> dict[str, Path]:
    """Name → path of the traces shipped with the package."""
    return {p.name.split(".")[0]: p for p in sorted(TRACES_DIR.glob("*.jsonl"))}


def _from_columns(cols: dict[str, Any], path: Path) -> Rollouts:
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
    try:
        return Rollouts(
            prompt_len=np.asarray(cols["prompt_len"]),
            response_len=np.asarray(cols["response_len"]),
            rollout_id=None if cols.get("rollout_id") is None else np.asarray(cols["rollout_id"]),
            loss_masks=None if masks is None else [np.asarray(m) for m in masks],
        )
    except ValueError as e:
        raise TraceError(f"trace {str(path)!r}: {e}") from None


def _read_jsonl(path: Path) -> dict[str, list]:
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
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        raise TraceError(f"trace {str(path)!r}: some rows lack some columns")
    return cols


def _read_parquet(path: Path) -> dict[str, list]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise TraceError(f"trace {str(path)!r} is not a readable Parquet file: {e}") from None
    return {name: table.column(name).to_pylist() for name in table.column_names}


def _read_slime_dump(path: Path) -> dict[str, list]:
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise TraceError(
            f"slime dump {str(path)!r} holds objects that need unpickling arbitrary code, which "
            f"varbatch_kit refuses for safety ({str(e).splitlines()[0]}). Re-save it with plain "
            "dicts, lists, numbers and tensors (e.g. [sample.to_dict() ...])"
        ) from None
    except Exception as e:
        raise TraceError(f"slime dump {str(path)!r} could not be read: {e}") from None
    samples = obj.get("samples") if isinstance(obj, dict) else obj
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise TraceError(
            f"slime dump {str(path)!r}: expected a dict with a 'samples' list of dicts "
            "(or such a list)"
        )
    cols: dict[str, list] = {"prompt_len": [], "response_len": [], "rollout_id": [],
                             "loss_mask": []}
    for i, s in enumerate(samples):
        if "response_length" not in s or "tokens" not in s and "total_length" not in s:
            raise TraceError(
                f"slime dump {str(path)!r}: sample {i} lacks response_length and tokens "
                "(or total_length)"
            )
        total = int(s["total_length"]) if "total_length" in s else len(s["tokens"])
        resp = int(s["response_length"])
        cols["prompt_len"].append(total - resp)
        cols["response_len"].append(resp)
        rid = s.get("rollout_id", s.get("group_index", s.get("index", i)))
        cols["rollout_id"].append(int(rid) if rid is not None else i)
        mask = s.get("loss_mask")
        cols["loss_mask"].append(None if mask is None else [int(v) for v in list(mask)])
    return cols


def read_trace(path: str | Path) -> Rollouts:
    """Read a trace file into :class:`Rollouts`; the format follows the suffix."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        cols = _read_jsonl(p)
    elif suffix in (".parquet", ".pq"):
        cols = _read_parquet(p)
    elif suffix in (".pt", ".pth"):
        cols = _read_slime_dump(p)
    else:
        raise TraceError(
            f"trace {str(p)!r}: unknown format {suffix!r}; use .jsonl, .parquet or a slime .pt dump"
        )
    if not cols or not any(len(v) for v in cols.values()):
        raise TraceError(f"trace {str(p)!r} holds no samples")
    return _from_columns(cols, p)


def write_trace(rollouts: Rollouts, path: str | Path) -> Path:
    """Write ``rollouts`` as JSONL or Parquet (by suffix)."""
    p = Path(path)
    cols = {
        "prompt_len": rollouts.prompt_len.tolist(),
        "response_len": rollouts.response_len.tolist(),
        "rollout_id": rollouts.rollout_id.tolist(),
    }
    if rollouts.loss_masks is not None:
        cols["loss_mask"] = [m.tolist() for m in rollouts.loss_masks]
    if p.suffix.lower() in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(cols), p)
    elif p.suffix.lower() == ".jsonl":
        with p.open("w") as f:
            for i in range(len(rollouts)):
                f.write(json.dumps({k: v[i] for k, v in cols.items()}) + "\n")
    else:
        raise TraceError(f"cannot write {str(p)!r}: use a .jsonl or .parquet suffix")
    return p
