"""slime's debug rollout dumps (``--save-debug-rollout-data``) as :class:`Rollouts`.

slime writes ``{"rollout_id": k, "samples": [Sample.to_dict(), ...]}`` with
``torch.save``. :func:`read_slime_dump` loads such a file with torch's loader
restricted to the globals torch's own ``weights_only=True`` loader allows
(plain containers, numbers, strings and tensors, never arbitrary pickled
objects): the restriction sits in ``find_class`` of Python's C unpickler
(:class:`_RestrictedUnpickler`, the "restricting globals" recipe of the
``pickle`` documentation), so a dump reads at the speed of an unrestricted
``torch.load`` instead of the pure-Python unpickler behind ``weights_only``
(a 35 MB slime-shaped dump: 0.55 s against 4.2 s, ``benchmarks.dump_loading``).
A dump that would need another global is refused with a clear error and nothing
in it runs. A file already read in this process is not read again while its size
and modification time stay the same (a copy of the cached batch is returned; the
most recent dumps up to :data:`_READ_MAX_BYTES` of files are kept).

The samples are read with the meaning slime's trainer gives them
(:func:`slime_train_data`): lengths from ``tokens`` and ``response_length``,
rollout ids from ``rollout_id`` with fresh ids for the samples without one,
masks with ``remove_sample`` applied; nested sample lists are flattened
(:func:`flatten_slime_samples`). A sample slime (or varbatch_kit) cannot use
raises :class:`SlimeSampleError`, which names it.

:func:`varbatch_kit.core.traces.read_trace` hands ``.pt`` / ``.pth`` files here.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import re
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.trace_errors import TraceError

__all__ = [
    "OlderSlimeDumpWarning",
    "SlimeSampleError",
    "flatten_slime_samples",
    "read_slime_dump",
    "read_slime_dump_with_id",
    "slime_train_data",
]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


class SlimeSampleError(TraceError):
    """A sample of a slime batch that slime's trainer (or varbatch_kit) cannot use.

    ``sample`` is its position in the flattened batch (None for a batch-level
    problem), ``where`` names it (``"sample 3"``, ``"sample 3 (samples[1][0])"``),
    ``detail`` says what is wrong and ``slime_wording`` is how slime's own
    assertion words it, when slime checks it.
    """

    def __init__(self, sample: int | None, where: str, detail: str,
                 slime_wording: str | None = None):
        self.sample, self.where, self.detail = sample, where, detail
        self.slime_wording = slime_wording
        super().__init__(self.located())

    def located(self) -> str:
        """``"sample 3: <detail>"``."""
        return f"{self.where}: {self.detail}" if self.where else self.detail

    def slime_style(self) -> str:
        """slime's wording first (when slime checks this), then ours."""
        if self.slime_wording:
            return f"{self.slime_wording}: {self.located()}"
        return self.located()


def _path(path: tuple[int, ...]) -> str:
    return "samples" + "".join(f"[{j}]" for j in path)


def _check_rollout_siblings(node: Any, depth: int, path: tuple[int, ...]) -> None:
    """slime's rollout-id contract on nested rollout output.

    A list of samples at depth >= 2 (prompt -> rollout -> samples of that
    rollout) is one compact rollout: when it holds several samples, all must
    carry the same non-None ``rollout_id``. Shallower lists (the default
    prompt -> samples shape) are prompt groups and are not checked.
    """
    if not isinstance(node, list):
        return
    if node and isinstance(node[0], dict):
        if depth >= 2 and len(node) > 1:
            rids = [s.get("rollout_id") if isinstance(s, dict) else None for s in node]
            missing = [j for j, r in enumerate(rids) if r is None]
            if missing:
                raise SlimeSampleError(
                    None, _path(path),
                    f"compact rollout of {len(node)} samples has rollout_id unset at positions "
                    f"{missing}; every sibling needs the same non-None rollout_id so the rollout "
                    "counts once")
            if any(r != rids[0] for r in rids):
                raise SlimeSampleError(
                    None, _path(path),
                    f"sibling samples of one compact rollout must share rollout_id; got {rids}")
        return
    for j, item in enumerate(node):
        _check_rollout_siblings(item, depth + 1, path + (j,))


def flatten_slime_samples(samples: Any) -> tuple[list[dict], list[tuple[int, ...]]]:
    """Flatten slime's (possibly nested) rollout output to a list of sample dicts.

    Nested lists are flattened level by level, as slime does before training
    (``[[s0, s1], [s2]]`` -> ``[s0, s1, s2]``), after checking slime's
    rollout-id contract for compact rollouts. Returns the samples and each
    one's position in the nested input.
    """
    if not isinstance(samples, list):
        raise SlimeSampleError(
            None, "", f"'samples' must be a list of sample dicts (Sample.to_dict()), got "
            f"{type(samples).__name__}")
    _check_rollout_siblings(samples, 0, ())
    level: list[tuple[Any, tuple[int, ...]]] = [(s, (i,)) for i, s in enumerate(samples)]
    while level and isinstance(level[0][0], list):
        for node, path in level:
            if not isinstance(node, list):
                raise SlimeSampleError(
                    None, _path(path),
                    f"this entry is a {type(node).__name__} but {_path(level[0][1])} is a list; "
                    "every entry of one nesting level must be a list (or every one a sample dict)")
        level = [(child, path + (j,)) for node, path in level for j, child in enumerate(node)]
    for i, (node, path) in enumerate(level):
        if not isinstance(node, dict):
            where = f"sample {i}" + (f" ({_path(path)})" if len(path) > 1 else "")
            raise SlimeSampleError(
                i, where, f"not a sample dict (Sample.to_dict()) but a {type(node).__name__}")
    return [node for node, _ in level], [path for _, path in level]


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (not a bool, not a float); else None."""
    if isinstance(value, (bool, float, np.floating)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _int_list(values: Any) -> list[int] | None:
    """A 1-D sequence of integers (list, tuple, tensor, array) as a list of int; else None.

    Booleans count as 0/1 and integral floats as integers.
    """
    if values is None or isinstance(values, (str, bytes, dict)):
        return None
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):
        return None
    if arr.ndim != 1:
        return None
    if arr.size == 0:
        return []
    if arr.dtype == bool or np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64).tolist()
    if np.issubdtype(arr.dtype, np.floating) and np.isfinite(arr).all() and \
            (arr == np.round(arr)).all():
        return arr.astype(np.int64).tolist()
    return None


def _convert_slime(samples: Any, reward_key: str | None = None
                   ) -> tuple[dict[str, list], list[dict], list[str]]:
    flat, paths = flatten_slime_samples(samples)
    if not flat:
        raise SlimeSampleError(None, "", "the batch holds no samples")
    nested = any(len(p) > 1 for p in paths)
    wheres = [f"sample {i}" + (f" ({_path(p)})" if nested else "") for i, p in enumerate(paths)]
    train: dict[str, list] = {k: [] for k in (
        "total_lengths", "response_lengths", "rollout_ids", "loss_masks", "rollout_mask_sums",
        "truncated", "raw_reward", "sample_indices")}
    given_ids: list[int | None] = []
    for i, (s, where) in enumerate(zip(flat, wheres)):
        if "response_length" not in s:
            raise SlimeSampleError(i, where, "lacks response_length")
        resp = _as_int(s["response_length"])
        if resp is None or resp < 0:
            raise SlimeSampleError(
                i, where, f"response_length = {s['response_length']!r} is not a token count "
                "(an integer >= 0)")
        tokens = s.get("tokens")
        if tokens is not None:
            if isinstance(tokens, (str, bytes, dict)) or not hasattr(tokens, "__len__") or \
                    getattr(tokens, "ndim", 1) != 1:
                raise SlimeSampleError(
                    i, where,
                    f"tokens must be a 1-D list of token ids, got {type(tokens).__name__}")
            total = len(tokens)
        elif s.get("total_length") is not None:
            total = _as_int(s["total_length"])
            if total is None or total < 0:
                raise SlimeSampleError(
                    i, where, f"total_length = {s['total_length']!r} is not a token count")
        else:
            raise SlimeSampleError(
                i, where, "lacks tokens (prompt + response token ids) and total_length")
        mask_in = s.get("loss_mask")
        if mask_in is None:
            mask = [1] * resp
        else:
            mask = _int_list(mask_in)
            if mask is None:
                raise SlimeSampleError(
                    i, where, f"loss_mask must be a list of 0/1 per response token, got "
                    f"{type(mask_in).__name__}")
        if len(mask) != resp:
            raise SlimeSampleError(
                i, where, f"loss_mask has {len(mask)} entries but response_length is {resp}; a "
                "mask has one entry per response token",
                slime_wording=f"loss mask length {len(mask)} != response length {resp}")
        if s.get("remove_sample"):
            mask = [0] * resp
        rid_in = s.get("rollout_id")
        rid = None if rid_in is None else _as_int(rid_in)
        if rid_in is not None and rid is None:
            raise SlimeSampleError(
                i, where, f"rollout_id = {rid_in!r} is not an integer (or None for a one-sample "
                "rollout)")
        reward = s.get("reward")
        if reward_key:
            if not isinstance(reward, dict) or reward_key not in reward:
                raise SlimeSampleError(
                    i, where, f"reward_key {reward_key!r} selects a key of a dict reward, but "
                    f"the reward is {reward!r}")
            reward = reward[reward_key]
        status = s.get("status")
        status = getattr(status, "value", status)
        train["total_lengths"].append(total)
        train["response_lengths"].append(resp)
        train["loss_masks"].append(mask)
        train["truncated"].append(1 if status == "truncated" else 0)
        train["raw_reward"].append(reward)
        train["sample_indices"].append(s.get("index"))
        given_ids.append(rid)
    # rollout ids: explicit ids are reserved; each sample without one gets the
    # smallest non-negative integer not used yet, in sample order
    used = {r for r in given_ids if r is not None}
    fresh = 0
    for rid in given_ids:
        if rid is None:
            while fresh in used:
                fresh += 1
            rid = fresh
            used.add(rid)
        train["rollout_ids"].append(rid)
    totals: dict[int, int] = {}
    for rid, m in zip(train["rollout_ids"], train["loss_masks"]):
        totals[rid] = totals.get(rid, 0) + sum(m)
    train["rollout_mask_sums"] = [totals[r] for r in train["rollout_ids"]]
    # a metadata["raw_reward"] on any sample replaces the raw rewards (the
    # other samples keep their reward)
    if any(isinstance(s.get("metadata"), dict) and s["metadata"] and "raw_reward" in s["metadata"]
           for s in flat):
        train["raw_reward"] = [
            s["metadata"]["raw_reward"]
            if isinstance(s.get("metadata"), dict) and "raw_reward" in s["metadata"]
            else s.get("reward")
            for s in flat]
    return train, flat, wheres


def slime_train_data(samples: Any, *, reward_key: str | None = None) -> dict[str, list]:
    """slime's trainer view of a batch of sample dicts (``Sample.to_dict()`` form).

    ``samples`` may be nested (lists of samples per rollout or per prompt); it
    is flattened as slime does. Returns ``total_lengths`` (``len(tokens)``; a
    ``total_length`` field stands in for a sample saved without tokens),
    ``response_lengths``, ``rollout_ids`` (the explicit ``rollout_id``, else a
    fresh id: the smallest non-negative integer no sample of the batch uses,
    assigned in sample order), ``loss_masks`` (None -> all ones,
    ``remove_sample`` -> all zeros), ``rollout_mask_sums`` (per sample, the
    mask total of its whole rollout), ``truncated`` (1 when ``status ==
    "truncated"``), ``raw_reward`` (the reward as given, or
    ``reward[reward_key]``; a ``metadata["raw_reward"]`` replaces it) and
    ``sample_indices`` (``index``). Rewards are raw: no group normalisation.

    Raises :class:`SlimeSampleError` naming the sample and field.
    """
    return _convert_slime(samples, reward_key)[0]


def _flat_reward(prefix: str, value: Any, out: dict[str, Any]) -> None:
    for k, v in value.items():
        name = f"{prefix}/{k}"
        if isinstance(v, dict):
            _flat_reward(name, v, out)
        else:
            out[name] = v


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) or (
        hasattr(v, "ndim") and getattr(v, "ndim", 1) == 0 and hasattr(v, "item"))


def _column(values: list, kind: str):
    import pandas as pd

    if kind == "int":
        ints = [None if v is None else _as_int(v) for v in values]
        if all(i is not None or v is None for i, v in zip(ints, values)):
            return pd.array(ints, dtype="Int64")
        return pd.array(values, dtype=object)
    if kind == "float":  # numbers as float, NaN when missing; any other value keeps the column
        if all(v is None or _is_number(v) for v in values):
            return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
        return pd.array(values, dtype=object)
    if kind == "string":
        if all(v is None or isinstance(v, str) for v in values):
            return pd.array(values, dtype="string")
        return pd.array(values, dtype=object)
    return pd.array(values, dtype=object)


def _token_list(tokens: Any) -> list | None:
    if tokens is None or isinstance(tokens, list):
        return tokens
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


def _float_list(values: Any) -> list | None:
    """Per-token log-probs (list, tuple, tensor, array) as a list of float; None stays None."""
    if values is None:
        return None
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().double().numpy()
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values] if isinstance(values, (list, tuple)) else values


def _slime_extra(flat: list[dict], train: dict[str, list]):
    """Per-sample fields of a slime batch beyond lengths and masks.

    The columns are listed in :func:`varbatch_kit.core.traces.read_trace`.
    """
    import pandas as pd

    def get(key):
        return [s.get(key) for s in flat]

    cols: dict[str, Any] = {
        "index": _column(get("index"), "int"),
        "group_index": _column(get("group_index"), "int"),
        "rollout_id": _column(get("rollout_id"), "int"),
        "status": _column([getattr(v, "value", v) for v in get("status")], "string"),
        "truncated": np.array(train["truncated"], dtype=bool),
        "remove_sample": np.array([bool(v) for v in get("remove_sample")], dtype=bool),
    }
    rewards = get("reward")
    # numbers as float (NaN when None); dict rewards stay dicts (the column is then of objects)
    # and each key also gets a float column reward/<key>
    cols["reward"] = _column(rewards, "float")
    flat_rewards: list[dict[str, Any]] = []
    keys: dict[str, None] = {}
    for r in rewards:
        d: dict[str, Any] = {}
        if isinstance(r, dict):
            _flat_reward("reward", r, d)
        flat_rewards.append(d)
        keys.update(dict.fromkeys(d))
    for k in keys:
        cols[k] = _column([d.get(k) for d in flat_rewards], "float")
    if train["raw_reward"] != rewards:
        cols["raw_reward"] = _column(train["raw_reward"], "float")
    for key in ("label", "prompt", "response"):
        if any(key in s for s in flat):
            cols[key] = _column(get(key), "string")
    if any("metadata" in s for s in flat):
        cols["metadata"] = _column(get("metadata"), "object")
    if any(s.get("tokens") is not None for s in flat):
        cols["tokens"] = _column([_token_list(s.get("tokens")) for s in flat], "object")
    for key in ("rollout_log_probs", "teacher_log_probs"):  # per response token
        if any(s.get(key) is not None for s in flat):
            cols[key] = _column([_float_list(s.get(key)) for s in flat], "object")
    if any(s.get("weight_versions") for s in flat):  # the policy versions that generated it
        cols["weight_versions"] = _column(
            [[str(v) for v in (s.get("weight_versions") or [])] for s in flat], "object")
    return pd.DataFrame(cols)


def _clean(text: str) -> str:
    return _ANSI.sub("", text)


class OlderSlimeDumpWarning(UserWarning):
    """A dump without fields slime writes today (``rollout_id``, ``status``): what was
    assumed in their place."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's C unpickler that resolves only the globals torch's ``weights_only`` loader
    allows (every other global is an ``UnpicklingError``, before anything is built)."""

    def find_class(self, module: str, name: str):
        found = _allowed_globals().get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


def _allowed_globals() -> dict[str, Any]:
    from torch import _weights_only_unpickler

    return _weights_only_unpickler._get_allowed_globals()


#: ``torch.load(pickle_module=...)``: torch's loader then unpickles with the restricted class
_RESTRICTED_PICKLE = types.ModuleType("varbatch_kit_restricted_pickle")
_RESTRICTED_PICKLE.Unpickler = _RestrictedUnpickler
_RESTRICTED_PICKLE.load = lambda file, **kw: _RestrictedUnpickler(file, **kw).load()
_RESTRICTED_PICKLE.UnpicklingError = pickle.UnpicklingError


def _load_pt(path: Path) -> Any:
    import torch

    try:
        # the C unpickler restricted to weights_only's globals (module docstring): plain
        # containers, numbers, strings and tensors only; nothing in the file is executed
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_RESTRICTED_PICKLE)
    except pickle.UnpicklingError as e:
        msg = str(e)
        found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([A-Za-z_][\w.]*)", msg)
        if found or re.search(r"Can only (?:create new object|build)", msg):
            needs = f" (it asks for the Python object {found.group(1)!r})" if found else ""
            raise TraceError(
                f"slime dump {str(path)!r} holds objects that need unpickling arbitrary code to "
                f"rebuild{needs}, which would run code from the file, so varbatch_kit refuses it: "
                "it reads dumps with a restricted loader that builds plain data only. Re-save the "
                "dump with plain dicts, lists, numbers, strings and tensors, e.g. "
                "torch.save({'rollout_id': k, 'samples': [s.to_dict() for s in samples]}, path) "
                "(to_dict() stores status as its string value), which is what slime's "
                "--save-debug-rollout-data writes"
            ) from None
        why = re.search(r"WeightsUnpickler error: *\n*([^\n]+)", msg)
        detail = _clean(why.group(1)).strip()[:200] if why else ""
        raise TraceError(
            f"slime dump {str(path)!r} is not a readable torch.save file: it is corrupt or was "
            "not written by torch.save" + (f" (the restricted loader stopped at: {detail})"
                                           if detail and "weights_only" not in detail else "")
        ) from None
    except Exception as e:  # torch raises several types for files it cannot parse
        first = _clean(str(e)).strip().splitlines()[0] if str(e).strip() else ""
        if "weights_only" in first:
            first = ""
        raise TraceError(
            f"slime dump {str(path)!r} is not a readable torch.save file: it is corrupt or was "
            f"not written by torch.save ({type(e).__name__}{': ' + first[:200] if first else ''})"
        ) from None


def read_slime_dump(path: str | Path) -> Rollouts:
    """Read one slime debug rollout dump (``.pt``) into :class:`Rollouts`.

    The file is loaded with torch's loader restricted to the globals of
    ``torch.load(weights_only=True)`` (plain data only, at the C unpickler's
    speed; a dump that needs unpickling is refused, nothing in it runs) and
    read as slime's trainer reads it (:func:`slime_train_data`);
    :func:`varbatch_kit.core.traces.read_trace` documents the columns of
    ``Rollouts.extra``. Raises :class:`~varbatch_kit.core.trace_errors.TraceError`
    naming the file (and the sample) for anything slime's trainer or
    varbatch_kit cannot use.
    """
    return read_slime_dump_with_id(path)[0]


#: dumps read in this process: (path, size, mtime_ns) -> (Rollouts, saved rollout id)
_READ: dict[tuple[str, int, int], tuple[Rollouts, int | None]] = {}
#: the cache keeps the most recent dumps whose files add up to at most this many bytes (the
#: batches they give, with their token columns, take a few times their file size in memory)
_READ_MAX_BYTES = 256 * 2**20


def _copy(rollouts: Rollouts) -> Rollouts:
    """A copy whose ``extra`` table the caller may change without touching the cache (the
    arrays of a ``Rollouts`` are read-only)."""
    if rollouts.extra is None:
        return rollouts
    return dataclasses.replace(rollouts, extra=rollouts.extra.copy())


def read_slime_dump_with_id(path: str | Path) -> tuple[Rollouts, int | None]:
    """:func:`read_slime_dump` and the ``rollout_id`` the dump saved (None without one).

    slime saves ``{"rollout_id": k, "samples": [...]}``; a run's reader
    (:func:`varbatch_kit.core.run_dumps.read_run`) checks ``k`` against the
    file name. A file read before in this process, unchanged since (size and
    modification time), is not read again: a copy of that batch is returned.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"slime dump {str(path)!r} does not exist")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _READ:
        rollouts, saved = _READ[key]
        return _copy(rollouts), saved
    rollouts, saved = _read_dump(path)
    while _READ and sum(k[1] for k in _READ) + st.st_size > _READ_MAX_BYTES:
        _READ.pop(next(iter(_READ)))  # the oldest first
    if st.st_size <= _READ_MAX_BYTES:
        _READ[key] = (rollouts, saved)
    return _copy(rollouts), saved


def _older_dump_warning(path: Path, flat: list[dict]) -> None:
    """One warning for the fields an older slime did not write, saying what was assumed."""
    assumed = []
    if flat and not any(isinstance(s, dict) and "rollout_id" in s for s in flat):
        assumed.append(f"no sample has a rollout_id, so each of the {len(flat)} samples was read "
                       "as a rollout of its own (slime's rule for a sample without one)")
    if flat and not any(isinstance(s, dict) and "status" in s for s in flat):
        assumed.append("no sample has a status, so none was counted as truncated")
    if assumed:
        warnings.warn(f"slime dump {str(path)!r} was written by an older slime: "
                      + "; ".join(assumed), OlderSlimeDumpWarning, stacklevel=4)


def _read_dump(path: Path) -> tuple[Rollouts, int | None]:
    obj = _load_pt(path)
    saved = obj.get("rollout_id") if isinstance(obj, dict) else None
    saved = _as_int(saved) if saved is not None else None
    samples = obj.get("samples") if isinstance(obj, dict) else obj
    if not isinstance(samples, list):
        raise TraceError(
            f"slime dump {str(path)!r}: expected a dict with a 'samples' list of sample dicts "
            "(Sample.to_dict(), as slime's --save-debug-rollout-data writes) or such a list; "
            f"got {type(obj).__name__}" + (f" with keys {sorted(map(str, obj))}"
                                           if isinstance(obj, dict) else "")
        )
    if not samples:
        raise TraceError(f"trace {str(path)!r} holds no samples")
    try:
        train, flat, wheres = _convert_slime(samples)
    except SlimeSampleError as e:
        raise TraceError(f"slime dump {str(path)!r}: {e.located()}") from None
    _older_dump_warning(path, flat)
    for i, where in enumerate(wheres):
        resp, total = train["response_lengths"][i], train["total_lengths"][i]
        if resp < 1:
            raise TraceError(
                f"slime dump {str(path)!r}: {where}: response_length is 0; varbatch_kit needs "
                "at least one response token per sample (slime would schedule it and train on "
                "nothing); drop the sample from the dump")
        if total < resp:
            raise TraceError(
                f"slime dump {str(path)!r}: {where}: tokens has {total} entries but "
                f"response_length is {resp}; tokens holds the prompt and the response")
        if any(v not in (0, 1) for v in train["loss_masks"][i]):
            raise TraceError(
                f"slime dump {str(path)!r}: {where}: loss_mask holds values other than 0 and 1")
    total = np.asarray(train["total_lengths"], dtype=np.int64)
    resp = np.asarray(train["response_lengths"], dtype=np.int64)
    try:
        return Rollouts(
            prompt_len=total - resp,
            response_len=resp,
            rollout_id=np.asarray(train["rollout_ids"], dtype=np.int64),
            loss_masks=[np.asarray(m, dtype=np.int8) for m in train["loss_masks"]],
            extra=_slime_extra(flat, train),
        ), saved
    except ValueError as e:
        raise TraceError(f"slime dump {str(path)!r}: {e}") from None
